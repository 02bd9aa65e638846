/* The libitm read, write, log and bulk-memory barriers that GCC emits inside handlers,
 * for every access size and kind. Reads apply check(v) (R1/R5); writes go through the
 * write log (R2/R6) before they store. The "after read/after write/for write" variants
 * are hints for a TM that libsei does not need, so each maps to the plain barrier. */
#include <string.h>

#include "internal.h"

typedef uint8_t sei_u1;
typedef uint16_t sei_u2;
typedef uint32_t sei_u4;
typedef uint64_t sei_u8;
typedef float sei_f;
typedef double sei_d;
typedef long double sei_e;
typedef int sei_m64 __attribute__((vector_size(8)));
typedef float sei_m128 __attribute__((vector_size(16)));
typedef float sei_m256 __attribute__((vector_size(32)));
typedef _Complex float sei_cf;
typedef _Complex double sei_cd;
typedef _Complex long double sei_ce;

static inline void write_barrier(void *addr, size_t len) {
    sei_log_write(sei_thread_get(), (uintptr_t)addr, len);
}

/* check(v) of R1/R5: nothing to do in software under ECC */
static inline void read_barrier(const void *addr, size_t len) {
    if (__builtin_expect(sei_dup, 0)) sei_dup_check(sei_self, (uintptr_t)addr, len);
}

#define READS(NAME, T, ATTR)                                                          \
    ATTR T _ITM_R##NAME(const T *p) { read_barrier(p, sizeof(T)); return *p; }   \
    ATTR T _ITM_RaR##NAME(const T *p) { read_barrier(p, sizeof(T)); return *p; } \
    ATTR T _ITM_RaW##NAME(const T *p) { read_barrier(p, sizeof(T)); return *p; } \
    ATTR T _ITM_RfW##NAME(const T *p) { read_barrier(p, sizeof(T)); return *p; }

#define WRITES(NAME, T, ATTR)                                                                 \
    ATTR void _ITM_W##NAME(T *p, T v) { write_barrier(p, sizeof(T)); *p = v; }            \
    ATTR void _ITM_WaR##NAME(T *p, T v) { write_barrier(p, sizeof(T)); *p = v; }          \
    ATTR void _ITM_WaW##NAME(T *p, T v) { write_barrier(p, sizeof(T)); *p = v; }          \
    ATTR void _ITM_L##NAME(const T *p) { write_barrier((void *)(uintptr_t)p, sizeof(T)); }

#define BARRIERS(NAME, T, ATTR) READS(NAME, T, ATTR) WRITES(NAME, T, ATTR)

#define NO_ATTR
BARRIERS(U1, sei_u1, NO_ATTR)
BARRIERS(U2, sei_u2, NO_ATTR)
BARRIERS(U4, sei_u4, NO_ATTR)
BARRIERS(U8, sei_u8, NO_ATTR)
BARRIERS(F, sei_f, NO_ATTR)
BARRIERS(D, sei_d, NO_ATTR)
BARRIERS(E, sei_e, NO_ATTR)
BARRIERS(M64, sei_m64, NO_ATTR)
BARRIERS(M128, sei_m128, NO_ATTR)
/* callers that use 32-byte vectors pass them in %ymm registers, as libitm expects */
BARRIERS(M256, sei_m256, __attribute__((target("avx"))))
BARRIERS(CF, sei_cf, NO_ATTR)
BARRIERS(CD, sei_cd, NO_ATTR)
BARRIERS(CE, sei_ce, NO_ATTR)

void _ITM_LB(const void *p, size_t len) { write_barrier((void *)(uintptr_t)p, len); }

/* Bulk copies: Rt = the source is handler state (checked), Wt = the destination is
 * (logged); Rn/Wn = not instrumented (a handler-local buffer). */
#define COPY(OP, SUFFIX, CHECK_SRC, LOG_DST)                                     \
    void _ITM_##OP##SUFFIX(void *dst, const void *src, size_t len) {             \
        if (CHECK_SRC) read_barrier(src, len);                                   \
        if (LOG_DST) write_barrier(dst, len);                                    \
        OP(dst, src, len);                                                       \
    }

#define COPIES(OP)                         \
    COPY(OP, RnWt, 0, 1)                   \
    COPY(OP, RnWtaR, 0, 1)                 \
    COPY(OP, RnWtaW, 0, 1)                 \
    COPY(OP, RtWn, 1, 0)                   \
    COPY(OP, RtaRWn, 1, 0)                 \
    COPY(OP, RtaWWn, 1, 0)                 \
    COPY(OP, RtWt, 1, 1)                   \
    COPY(OP, RtWtaR, 1, 1)                 \
    COPY(OP, RtWtaW, 1, 1)                 \
    COPY(OP, RtaRWt, 1, 1)                 \
    COPY(OP, RtaRWtaR, 1, 1)               \
    COPY(OP, RtaRWtaW, 1, 1)               \
    COPY(OP, RtaWWt, 1, 1)                 \
    COPY(OP, RtaWWtaR, 1, 1)               \
    COPY(OP, RtaWWtaW, 1, 1)

COPIES(memcpy)
COPIES(memmove)

void _ITM_memsetW(void *dst, int c, size_t len) {
    write_barrier(dst, len);
    memset(dst, c, len);
}
void _ITM_memsetWaR(void *dst, int c, size_t len) { _ITM_memsetW(dst, c, len); }
void _ITM_memsetWaW(void *dst, int c, size_t len) { _ITM_memsetW(dst, c, len); }
