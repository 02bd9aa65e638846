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

#endif /* SEI_NATIVE_H */
