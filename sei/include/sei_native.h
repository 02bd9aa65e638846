/* The unhardened build of a libsei-annotated program: compile with -DSEI_NATIVE and
 * plain gcc, and every annotation becomes a no-op (handlers run once, uninstrumented).
 * Output CRCs are still computed, so that a client that checks them works with both
 * builds. Used as the baseline of benchmarks and fault campaigns. */
#ifndef SEI_NATIVE_H
#define SEI_NATIVE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define SEI_PURE
#define SEI_LOCAL
#define SEI_SAFE
#define SEI_ATOMIC
#define SEI_HANDLER(msg, len, crc) if (sei_begin((msg), (len), (crc)))
#define SEI_LOCAL_HANDLER()

enum sei_mode { SEI_MODE_ECC = 0, SEI_MODE_DUP = 1 };

__attribute__((target("sse4.2"))) static inline uint32_t sei_crc32c(uint32_t crc, const void *buf, size_t len) {
    const unsigned char *p = (const unsigned char *)buf;
    uint64_t c = ~crc;
    for (; len >= 8; p += 8, len -= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = __builtin_ia32_crc32di(c, v);
    }
    uint32_t c32 = (uint32_t)c;
    while (len--) c32 = __builtin_ia32_crc32qi(c32, *p++);
    return ~c32;
}

static __thread uint32_t sei_native_open_crc_;
static __thread uint32_t sei_native_crcs_[64];
static __thread unsigned sei_native_head_, sei_native_count_;

static inline int sei_begin(const void *msg, size_t len, uint32_t crc) {
    (void)msg, (void)len, (void)crc;
    return 1;
}
static inline int sei_begin_nm(void) { return 1; }
static inline void sei_end(void) {}
static inline void sei_output_append(const void *buf, size_t len) {
    sei_native_open_crc_ = sei_crc32c(sei_native_open_crc_, buf, len);
}
static inline void sei_output_done(void) {
    sei_native_crcs_[(sei_native_head_ + sei_native_count_++) % 64] = sei_native_open_crc_;
    sei_native_open_crc_ = 0;
}
static inline uint32_t sei_crc_pop(void) {
    uint32_t crc = sei_native_crcs_[sei_native_head_];
    sei_native_head_ = (sei_native_head_ + 1) % 64;
    sei_native_count_--;
    return crc;
}
static inline void sei_ignore_addr(const void *addr, size_t len) { (void)addr, (void)len; }
static inline int sei_barrier(void) { return 1; }
static inline void sei_barrier_wait(void) {}
static inline void sei_barrier_disable(void) {}
static inline enum sei_mode sei_mode(void) { return SEI_MODE_ECC; }

/* The libc subset of sei.h, as libc itself (sei_utoa has no libc twin). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
static inline int sei_memcmp(const void *a, const void *b, size_t n) { return memcmp(a, b, n); }
static inline size_t sei_strlen(const char *s) { return strlen(s); }
/* strnlen is POSIX, not C: a program built with -std=c11 would not see it */
static inline size_t sei_strnlen(const char *s, size_t max) {
    const char *end = (const char *)memchr(s, 0, max);
    return end != NULL ? (size_t)(end - s) : max;
}
static inline void *sei_memchr(const void *s, int c, size_t n) { return (void *)(uintptr_t)memchr(s, c, n); }
static inline char *sei_strchr(const char *s, int c) { return (char *)(uintptr_t)strchr(s, c); }
static inline unsigned long sei_strtoul(const char *s, char **endptr, int base) { return strtoul(s, endptr, base); }
static inline unsigned long long sei_strtoull(const char *s, char **endptr, int base) {
    return strtoull(s, endptr, base);
}
__attribute__((format(printf, 3, 0))) static inline int sei_vsnprintf(char *buf, size_t size, const char *fmt,
                                                                      va_list ap) {
    return vsnprintf(buf, size, fmt, ap);
}
__attribute__((format(printf, 3, 4))) static inline int sei_snprintf(char *buf, size_t size, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, size, fmt, ap);
    va_end(ap);
    return n;
}
static inline size_t sei_utoa(unsigned long long value, char *buf, unsigned base) {
    char rev[64];
    size_t n = 0;
    if (base < 2 || base > 36) abort(); /* the hardened build stops with 70 and a message */
    do {
        rev[n++] = "0123456789abcdefghijklmnopqrstuvwxyz"[value % base];
        value /= base;
    } while (value != 0);
    for (size_t i = 0; i < n; i++) buf[i] = rev[n - 1 - i];
    buf[n] = 0;
    return n;
}

#endif /* SEI_NATIVE_H */
