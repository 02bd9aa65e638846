/* libsei internals: the per-thread handler context and its limits.
 *
 * Data flow of one handler (see docs/sei.md, "How it works"):
 *   sei_begin (I) -> _ITM_beginTransaction (checkpoint) -> E1 -> _ITM_commitTransaction
 *   -> reset (R) -> restart at the checkpoint -> E2 -> _ITM_commitTransaction -> V
 *   -> post-V actions (lock release, barrier, deferred calls, frees) -> sei_end.
 * The write log holds, per 8-byte word a handler wrote, the snapshot O (old value and
 * the bytes E1 wrote), the new-value buffer N (filled by R) and the update set U (the
 * bytes E2 wrote). */
#ifndef SEI_INTERNAL_H
#define SEI_INTERNAL_H

#include <stdint.h>
#include <stddef.h>
#include <pthread.h>

#include "sei.h"

/* Explicit limits, per thread. Exceeding one stops the process with a message that
 * names the limit and its environment variable. */
/* words written per handler (SEI_MAX_WORDS): 8 MiB of state, a reply buffer included;
 * the log starts at SEI_INITIAL_WORDS and doubles as a handler needs */
#define SEI_DEFAULT_MAX_WORDS (1u << 20)
#define SEI_INITIAL_WORDS 1024u
#define SEI_MAX_ALLOCS 64          /* malloc/calloc/free calls per handler */
#define SEI_MAX_LOCKS 16           /* mutex acquisitions per handler */
#define SEI_MAX_OUTPUTS 16         /* output messages per handler */
#define SEI_MAX_SEGMENTS 64        /* sei_output_append calls per handler */
#define SEI_MAX_DEFERRED 16        /* deferred external calls per handler */
#define SEI_DEFER_BYTES 4096       /* bytes those calls carry, per handler */
#define SEI_MAX_IGNORED 8          /* sei_ignore_addr ranges per handler */
#define SEI_MAX_CRCS 64            /* output CRCs not yet popped */
#define SEI_MAX_THREADS 256        /* threads with a checking-barrier counter */

/* Exit status for a detected error (the lockstep-wide contract). */
#define SEI_EXIT_DETECTED 86
/* Exit status for a program libsei cannot harden (an unsafe construct). */
#define SEI_EXIT_UNSUPPORTED 70

/* Control-flow gate values: far apart in Hamming distance, so that a bit flip in the
 * phase variable yields no valid phase. The phase is also kept complemented. */
enum sei_phase {
    PHASE_IDLE = 0x1d5a0c33,
    PHASE_INIT = 0x2e694f0c,
    PHASE_E1 = 0x47b2d1e8,
    PHASE_RESET = 0x58c1a2d7,
    PHASE_E2 = 0x6b17f4a1,
    PHASE_VALIDATE = 0x7c8e39b6,
    PHASE_DONE = 0x93f0d65e,
};

/* The registers _ITM_beginTransaction saves; layout shared with tx.S. */
struct sei_checkpoint {
    uint64_t cfa; /* the caller's stack pointer: the stack below it dies with the handler */
    uint64_t rbx, rbp, r12, r13, r14, r15;
    uint64_t rip;
};

struct sei_word {
    uintptr_t addr;   /* 8-byte aligned */
    uint64_t old;     /* O: the word before E1's first write */
    uint64_t fresh;   /* N: the word after E1, saved by R */
    uint8_t mask_e1;  /* bytes E1 wrote (Oc) */
    uint8_t mask_e2;  /* bytes E2 wrote (U) */
    uint8_t pad[6];
};

struct sei_alloc {
    void *ptr;
    size_t size;
    int is_free; /* 0: malloc/calloc, 1: free (deferred) */
};

struct sei_lock {
    pthread_mutex_t *mutex;
};

struct sei_segment {
    const void *buf;
    size_t len;
};

struct sei_output {
    uint32_t crc_e1, crc_e2;
    uint32_t first_segment, segments; /* into segments[] */
};

enum sei_call_kind { CALL_SEND, CALL_SENDTO, CALL_SENDMSG, CALL_WRITE, CALL_CLOSE };

struct sei_call {
    enum sei_call_kind kind;
    int fd, flags;
    uint32_t offset, len; /* payload in defer_bytes (E2's copy) */
    uint32_t crc_e1;      /* payload CRC seen by E1 */
    uint32_t addr_offset, addr_len;
};

struct sei_range {
    uintptr_t start, end;
};

struct sei_thread {
    /* control-flow gate: phase and its complement must agree */
    uint32_t phase, phase_check;
    int nesting;
    int cancelled_e1;
    int execution; /* 1 or 2 */
    struct sei_checkpoint checkpoint;
    uintptr_t stack_low; /* lowest address of this thread's stack */

    const void *msg;
    size_t msg_len;
    uint32_t msg_crc;

    /* the write log and its open-addressing index (slot = word index + 1) */
    struct sei_word *words;
    uint32_t *index;
    uint32_t nwords, capacity, max_words, index_mask; /* capacity: entries allocated */

    struct sei_alloc allocs[SEI_MAX_ALLOCS];
    uint32_t nallocs, alloc_cursor;

    struct sei_lock locks[SEI_MAX_LOCKS]; /* Q: in E1's acquisition order */
    uint32_t nlocks, lock_cursor;
    uint32_t held_mask_e1, released_mask_e1, released_mask_e2; /* bits over locks[] */

    struct sei_segment segments[SEI_MAX_SEGMENTS];
    uint32_t nsegments, segment_cursor;
    struct sei_output outputs[SEI_MAX_OUTPUTS];
    uint32_t noutputs, output_cursor;
    uint32_t open_crc; /* CRC of the message being appended, this execution */
    uint32_t open_segments; /* segments appended to it so far */

    struct sei_call calls[SEI_MAX_DEFERRED];
    uint32_t ncalls, call_cursor;
    unsigned char defer_bytes[SEI_DEFER_BYTES];
    uint32_t defer_used;

    struct sei_range ignored[SEI_MAX_IGNORED];
    uint32_t nignored;

    uint32_t crcs[SEI_MAX_CRCS]; /* a ring of output CRCs not popped */
    uint32_t crc_head, crc_count;

    /* a test hook: flip one bit at the end of one execution */
    unsigned char *flip_addr;
    unsigned flip_bit;
    int flip_execution;

    /* user commit and undo actions (ABI) */
    void (*commit_fn[4])(void *);
    void *commit_arg[4];
    uint32_t ncommit;

    int barrier_slot;
    struct sei_stats stats;
};

extern __thread struct sei_thread *sei_self;

struct sei_thread *sei_thread_create(void);
/* The calling thread's context (created on first use). */
static inline struct sei_thread *sei_thread_get(void) {
    struct sei_thread *t = sei_self;
    return __builtin_expect(t != NULL, 1) ? t : sei_thread_create();
}

/* Bit i of mask -> byte i of the result is 0xff: spreads the 8 bits to the low bit of
 * each byte in three shift-and-mask steps, then fills the bytes. */
static inline uint64_t sei_byte_mask(uint8_t mask) {
    uint64_t x = mask;
    x = (x | (x << 28)) & 0x0000000f0000000full;
    x = (x | (x << 14)) & 0x0003000300030003ull;
    x = (x | (x << 7)) & 0x0101010101010101ull;
    return x * 0xff;
}
__attribute__((noreturn, format(printf, 1, 2))) void sei_fail(const char *fmt, ...);
__attribute__((noreturn, format(printf, 1, 2))) void sei_unsupported(const char *fmt, ...);

/* gates */
static inline void sei_set_phase(struct sei_thread *t, uint32_t phase) {
    t->phase = phase;
    t->phase_check = ~phase;
}
void sei_expect_phase(const struct sei_thread *t, uint32_t phase, const char *where);
/* inline: every read check and libc twin asks it */
static inline int sei_in_handler(const struct sei_thread *t) {
    return t != NULL && (t->phase == PHASE_E1 || t->phase == PHASE_E2);
}

/* log.c */
void sei_log_init(struct sei_thread *t);
void sei_log_clear(struct sei_thread *t);
void sei_log_write(struct sei_thread *t, uintptr_t addr, size_t len);
struct sei_word *sei_log_find(const struct sei_thread *t, uintptr_t word);
void sei_log_reset(struct sei_thread *t);
void sei_log_undo(struct sei_thread *t);
void sei_log_validate(struct sei_thread *t);

/* mode.c: check(v) */
extern int sei_dup;
void sei_mode_init(void);
void sei_dup_check(const struct sei_thread *t, uintptr_t addr, size_t len);
void sei_dup_commit(const struct sei_thread *t);
void sei_dup_forget(uintptr_t addr, size_t len);

/* effects.c: allocations, locks, outputs, deferred calls */
void sei_effects_begin(struct sei_thread *t);
void sei_effects_rewind(struct sei_thread *t);
void sei_effects_validate(struct sei_thread *t);
void sei_effects_commit(struct sei_thread *t);
void sei_effects_cancel(struct sei_thread *t);

/* barrier.c */
void sei_barrier_enter(struct sei_thread *t);
void sei_barrier_leave(struct sei_thread *t);

/* symbols.c: 1 if fn starts a function of a loaded object (its name, if known, in
 * name), 0 if it points to no function, 2 if it points into code of an object whose
 * symbol table is stripped (either) */
int sei_is_function(const void *fn, char *name, size_t name_size);
/* The data symbol that holds addr, as "name+offset" in out, or "" if none is known. */
void sei_data_symbol(const void *addr, char *out, size_t out_size);

/* tx.S */
uint32_t _ITM_beginTransaction(uint32_t props, ...);
void _ITM_commitTransaction(void);
__attribute__((noreturn)) void sei_restart(const struct sei_checkpoint *cp, uint32_t code);

/* The libitm ABI's codes (GCC's libitm.h). */
enum {
    a_runInstrumentedCode = 0x01,
    a_runUninstrumentedCode = 0x02,
    a_saveLiveVariables = 0x04,
    a_restoreLiveVariables = 0x08,
    a_abortTransaction = 0x10,
};
enum { pr_instrumentedCode = 0x0001 };

#endif
