/* libsei: handler-level hardening of event-driven C services (SEI).
 *
 * A hardened handler runs twice in the same process (E1, reset, E2) and is then
 * validated (V): the state updates of both executions must agree, outputs carry a
 * CRC32C computed by the second execution, and every failed check stops the process
 * with exit status 86 and a one-line reason on stderr. Build with `lockstep cc`,
 * which adds -fgnu-tm, this header's directory and libsei. See docs/sei.md.
 *
 *     if (sei_begin(msg, len, crc)) {      // phase I: discards a message whose CRC is wrong
 *         SEI_ATOMIC {                     // the handler: instrumented, executed twice
 *             handle(msg, len, reply, &n);
 *             sei_output_append(reply, n); // the reply's CRC is computed by E2
 *             sei_output_done();
 *         }
 *         sei_end();                       // the handler must have been validated
 *         send_reply(reply, n, sei_crc_pop());
 *     }
 *
 * SEI_HANDLER(msg, len, crc) { ... } and SEI_LOCAL_HANDLER() { ... } combine the three.
 */
#ifndef SEI_H
#define SEI_H

#ifdef SEI_NATIVE /* the unhardened build of the same source */
#include "sei_native.h"
#else

#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#if !defined(__GNUC__) || defined(__clang__)
#error "libsei needs GCC's -fgnu-tm instrumentation; build with lockstep cc"
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Attributes.
 * SEI_PURE: the function is not instrumented and may be called from a handler: its
 *   writes are not logged and its reads are not checked (not even in dup mode), so it
 *   may write only its locals and its result, and should read only the input message
 *   or data its caller checked (CRCs, parsing helpers).
 * SEI_LOCAL: the function writes only memory that dies with the handler (its own
 *   locals, or buffers passed to sei_ignore_addr); it is not instrumented either.
 * SEI_SAFE: the function is instrumented, so it can be called through a pointer from
 *   a handler (declare the pointer type SEI_SAFE as well). */
#define SEI_PURE __attribute__((transaction_pure))
#define SEI_LOCAL __attribute__((transaction_pure))
#define SEI_SAFE __attribute__((transaction_safe))

/* The handler body: a GCC TM transaction, which libsei executes twice. */
#define SEI_ATOMIC __transaction_atomic

/* A handler on an input message: runs the block only if crc matches the message. */
#define SEI_HANDLER(msg, len, crc)                                                  \
    for (int sei_once_ = sei_begin((msg), (len), (crc)); sei_once_; sei_once_ = 0, \
             sei_end())                                                             \
    SEI_ATOMIC

/* A handler with no input message (timers, clean-up of state after a send). */
#define SEI_LOCAL_HANDLER()                                                          \
    for (int sei_once_ = sei_begin_nm(); sei_once_; sei_once_ = 0, sei_end()) \
    SEI_ATOMIC

/* Phase I for a message: returns 1 if CRC32C(msg, len) == crc and the handler may run,
 * 0 if the message is corrupt and must be discarded. */
int sei_begin(const void *msg, size_t len, uint32_t crc);
/* Phase I for a local handler (no message); always returns 1. */
int sei_begin_nm(void);
/* After the SEI_ATOMIC block: checks that the handler was validated (or cancelled with
 * __transaction_cancel in both executions) and closes it. */
void sei_end(void);

/* Output messages. Inside a handler: append len bytes at buf (which must outlive the
 * handler) to the current output message; sei_output_done() closes it. After the
 * handler, sei_crc_pop() returns the CRC32C of the oldest closed message not popped. */
void sei_output_append(const void *buf, size_t len) SEI_PURE;
void sei_output_done(void) SEI_PURE;
uint32_t sei_crc_pop(void);

/* Writes to [addr, addr+len) in this handler are not logged, reset or compared: for
 * scratch buffers that die with the handler. Call it inside the handler. */
void sei_ignore_addr(const void *addr, size_t len) SEI_PURE;

/* The checking barrier (multithreaded services). Returns 1 when every handler that ran
 * concurrently with the caller's last one has been validated, so its output may leave;
 * 0 means "try again" (serve another connection meanwhile). sei_barrier_wait() blocks.
 * Deferred sends of a handler already wait at the barrier. */
int sei_barrier(void);
void sei_barrier_wait(void);
/* Turns the barrier off (it then returns 1 at once): faster, but a fault that skips a
 * lock acquisition can then reach another thread's output. Also SEI_BARRIER=0. */
void sei_barrier_disable(void);

/* Memory modes. ecc (default) trusts hardware error detection for check(v); dup keeps a
 * software copy of every byte a handler wrote and checks it on each handler read, so a
 * bit flip between handlers is detected (the paper's mc-sei-dup). Chosen at build time
 * with -DSEI_BUILD_DUP (lockstep cc --sei-mode dup) or at run time with SEI_MODE=ecc|dup. */
enum sei_mode { SEI_MODE_ECC = 0, SEI_MODE_DUP = 1 };
enum sei_mode sei_mode(void);

/* CRC32C (Castagnoli), the checksum of every lockstep component. */
uint32_t sei_crc32c(uint32_t crc, const void *buf, size_t len) SEI_PURE;

/* A transaction-safe libc subset: libc's signatures and semantics (C locale), callable
 * from handlers, where the libc functions are not (GCC reports "unsafe function call").
 * Inside a handler the bytes each one reads are checked in dup mode and the bytes it
 * writes are logged, as instrumented code would do; outside a handler, and in the native
 * build (sei_native.h maps them to libc), they are the plain functions.
 * sei_snprintf / sei_vsnprintf convert d i u x X o c s p and %% with the flags - + space
 * # 0, a width and a precision (numbers or *), and the lengths hh h l ll z j t; any other
 * conversion (floating point, %n) stops the program with status 70 naming it.
 * sei_utoa writes value's digits in base (2-36, lowercase) and a NUL to buf (65 bytes
 * hold any value) and returns the number of digits. */
int sei_libc_memcmp(const void *a, const void *b, size_t n) SEI_PURE;
size_t sei_libc_strlen(const char *s) SEI_PURE;
size_t sei_libc_strnlen(const char *s, size_t max) SEI_PURE;
void *sei_libc_memchr(const void *s, int c, size_t n) SEI_PURE;
char *sei_libc_strchr(const char *s, int c) SEI_PURE;
unsigned long sei_libc_strtoul(const char *s, char **endptr, int base) SEI_PURE;
unsigned long long sei_libc_strtoull(const char *s, char **endptr, int base) SEI_PURE;
int sei_libc_vsnprintf(char *buf, size_t size, const char *fmt, va_list ap) SEI_PURE
    __attribute__((format(printf, 3, 0)));
int sei_libc_snprintf(size_t anchor, char *buf, size_t size, const char *fmt, ...) SEI_PURE
    __attribute__((format(printf, 4, 5)));
size_t sei_libc_utoa(unsigned long long value, char *buf, unsigned base) SEI_PURE;
/* Always 0. The wrappers below read it so that a handler whose only work is calls to
 * them still has an instrumented access: without one, GCC emits no transaction and the
 * handler would run once, unchecked. */
extern size_t sei_tx_anchor;
#define SEI_ANCHOR_ sei_tx_anchor

static inline SEI_SAFE int sei_memcmp(const void *a, const void *b, size_t n) {
    return sei_libc_memcmp(a, b, n) + (int)SEI_ANCHOR_;
}
static inline SEI_SAFE size_t sei_strlen(const char *s) { return sei_libc_strlen(s) + SEI_ANCHOR_; }
static inline SEI_SAFE size_t sei_strnlen(const char *s, size_t max) {
    return sei_libc_strnlen(s, max) + SEI_ANCHOR_;
}
/* (a null result takes no offset: that would be undefined behaviour) */
static inline SEI_SAFE void *sei_memchr(const void *s, int c, size_t n) {
    void *found = sei_libc_memchr(s, c, n);
    return SEI_ANCHOR_ != 0 ? NULL : found;
}
static inline SEI_SAFE char *sei_strchr(const char *s, int c) {
    char *found = sei_libc_strchr(s, c);
    return SEI_ANCHOR_ != 0 ? NULL : found;
}
static inline SEI_SAFE unsigned long sei_strtoul(const char *s, char **endptr, int base) {
    return sei_libc_strtoul(s, endptr, base) + SEI_ANCHOR_;
}
static inline SEI_SAFE unsigned long long sei_strtoull(const char *s, char **endptr, int base) {
    return sei_libc_strtoull(s, endptr, base) + SEI_ANCHOR_;
}
__attribute__((format(printf, 3, 0))) static inline SEI_SAFE int sei_vsnprintf(char *buf, size_t size,
                                                                               const char *fmt, va_list ap) {
    return sei_libc_vsnprintf(buf, size, fmt, ap) + (int)SEI_ANCHOR_;
}
/* A macro: a transaction-safe function cannot be variadic (va_start is not allowed in
 * one), and the pure one it calls must be reached through an instrumented access. */
#define sei_snprintf(buf, size, ...) sei_libc_snprintf(SEI_ANCHOR_, (buf), (size), __VA_ARGS__)
static inline SEI_SAFE size_t sei_utoa(unsigned long long value, char *buf, unsigned base) {
    return sei_libc_utoa(value, buf, base) + SEI_ANCHOR_;
}

/* Counters of this thread, for tests and benchmarks. */
struct sei_stats {
    uint64_t handlers;        /* validated handlers */
    uint64_t discarded;       /* messages discarded for a bad CRC */
    uint64_t cancelled;       /* handlers cancelled in both executions */
    uint64_t words_logged;    /* snapshot entries, summed over handlers */
    uint64_t max_words;       /* the largest handler's snapshot entries */
    size_t bytes_per_thread;  /* memory held by this thread's hardening structures */
};
void sei_stats(struct sei_stats *out);

#ifdef SEI_BUILD_DUP
__attribute__((weak)) const int sei_build_mode = SEI_MODE_DUP;
#endif

/* Test hooks: flip bit `bit` of the byte at addr at the next handler write barrier in
 * execution `execution` (1 or 2), or at once outside a handler (execution 0). Only
 * for tests and fault demonstrations; off unless called. */
void sei_test_flip(void *addr, unsigned bit, int execution) SEI_PURE;

/* Calls with side effects outside the process are deferred until the handler has been
 * validated, and happen exactly once; inside a handler they return the full length
 * (or 0 for close) and their real result is not visible to the handler. */
ssize_t sei_tx_send(int fd, const void *buf, size_t len, int flags)
    __attribute__((transaction_wrap(send), transaction_pure));
ssize_t sei_tx_sendto(int fd, const void *buf, size_t len, int flags,
                      const struct sockaddr *to, socklen_t tolen)
    __attribute__((transaction_wrap(sendto), transaction_pure));
ssize_t sei_tx_sendmsg(int fd, const struct msghdr *msg, int flags)
    __attribute__((transaction_wrap(sendmsg), transaction_pure));
ssize_t sei_tx_write(int fd, const void *buf, size_t len)
    __attribute__((transaction_wrap(write), transaction_pure));
int sei_tx_close(int fd) __attribute__((transaction_wrap(close), transaction_pure));

/* Mutexes inside handlers: acquisitions are recorded and E2 must take the same locks in
 * the same order; releases are deferred until after validation, and releasing a lock
 * the handler does not hold stops the process. (__THROW: the same exception
 * specification as glibc's declarations, which C++ compares.) */
int sei_tx_mutex_lock(pthread_mutex_t *m) __THROW
    __attribute__((transaction_wrap(pthread_mutex_lock), transaction_pure));
int sei_tx_mutex_trylock(pthread_mutex_t *m) __THROW
    __attribute__((transaction_wrap(pthread_mutex_trylock), transaction_pure));
int sei_tx_mutex_unlock(pthread_mutex_t *m) __THROW
    __attribute__((transaction_wrap(pthread_mutex_unlock), transaction_pure));

#ifdef __cplusplus
}
#endif

#endif /* SEI_NATIVE */
#endif /* SEI_H */
