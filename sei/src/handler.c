/* The phases of a hardened handler: I (sei_begin), E1, R, E2, V (_ITM_commitTransaction)
 * and the end gate (sei_end), with the control-flow gates between them. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

__thread struct sei_thread *sei_self;

static void report(const char *prefix, const char *fmt, va_list ap) {
    char line[512];
    int n = snprintf(line, sizeof line, "%s", prefix);
    if (n < 0) n = 0;
    if ((size_t)n < sizeof line) {
        int m = vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
        if (m > 0) n += m;
    }
    if ((size_t)n >= sizeof line - 1) n = (int)sizeof line - 2;
    line[n++] = '\n';
    /* one write, so that the line is not interleaved with other threads' output */
    ssize_t ignored = write(2, line, (size_t)n);
    (void)ignored;
}

void sei_fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    report("sei: error detected: ", fmt, ap);
    va_end(ap);
    _exit(SEI_EXIT_DETECTED);
}

void sei_unsupported(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    report("sei: cannot harden this program: ", fmt, ap);
    va_end(ap);
    _exit(SEI_EXIT_UNSUPPORTED);
}

static const char *phase_name(uint32_t phase) {
    switch (phase) {
    case PHASE_IDLE: return "idle";
    case PHASE_INIT: return "I";
    case PHASE_E1: return "E1";
    case PHASE_RESET: return "R";
    case PHASE_E2: return "E2";
    case PHASE_VALIDATE: return "V";
    case PHASE_DONE: return "done";
    default: return "corrupt";
    }
}

void sei_expect_phase(const struct sei_thread *t, uint32_t phase, const char *where) {
    if (t->phase != phase || t->phase_check != ~phase)
        sei_fail("control-flow gate: %s reached in phase %s, expected %s", where, phase_name(t->phase),
                 phase_name(phase));
}

static size_t parse_limit(const char *name, size_t fallback) {
    const char *v = getenv(name);
    if (v == NULL || *v == 0) return fallback;
    char *end;
    unsigned long n = strtoul(v, &end, 10);
    if (*end != 0 || n < 16 || n > (1ul << 26))
        sei_unsupported("%s=%s: expected a number from 16 to 67108864", name, v);
    return n;
}

struct sei_thread *sei_thread_create(void) {
    struct sei_thread *t;
    sei_mode_init();
    t = calloc(1, sizeof *t);
    if (t == NULL) sei_unsupported("out of memory for the handler context");
    t->max_words = (uint32_t)parse_limit("SEI_MAX_WORDS", SEI_DEFAULT_MAX_WORDS);
    sei_log_init(t);
    pthread_attr_t attr;
    void *stack_addr = NULL;
    size_t stack_size = 0;
    if (pthread_getattr_np(pthread_self(), &attr) == 0) {
        pthread_attr_getstack(&attr, &stack_addr, &stack_size);
        pthread_attr_destroy(&attr);
    }
    t->stack_low = (uintptr_t)stack_addr;
    t->barrier_slot = -1;
    sei_set_phase(t, PHASE_IDLE);
    sei_self = t;
    return t;
}

static void start(struct sei_thread *t, const void *msg, size_t len, uint32_t crc) {
    sei_expect_phase(t, PHASE_IDLE, "a handler's start (was the previous one ended with sei_end?)");
    sei_set_phase(t, PHASE_INIT);
    t->msg = msg;
    t->msg_len = len;
    t->msg_crc = crc;
    t->nesting = 0;
    t->cancelled_e1 = 0;
    t->execution = 0;
    t->nignored = 0;
    t->ncommit = 0;
    sei_log_clear(t);
    sei_effects_begin(t);
    sei_barrier_enter(t);
}

int sei_begin(const void *msg, size_t len, uint32_t crc) {
    struct sei_thread *t = sei_thread_get();
    if (sei_crc32c(0, msg, len) != crc) {
        t->stats.discarded++;
        return 0;
    }
    start(t, msg, len, crc);
    return 1;
}

int sei_begin_nm(void) {
    start(sei_thread_get(), NULL, 0, 0);
    return 1;
}

void sei_end(void) {
    struct sei_thread *t = sei_thread_get();
    if (t->phase == PHASE_INIT && t->phase_check == ~(uint32_t)PHASE_INIT) {
        /* GCC emitted no transaction: the body had no memory access to instrument */
        sei_set_phase(t, PHASE_VALIDATE);
        sei_effects_validate(t);
        sei_effects_commit(t);
        t->stats.handlers++;
        sei_set_phase(t, PHASE_DONE);
    }
    sei_expect_phase(t, PHASE_DONE, "sei_end");
    sei_set_phase(t, PHASE_IDLE);
}

/* Called by _ITM_beginTransaction with the checkpoint it built on its stack. */
uint32_t sei_tx_begin(uint32_t props, const struct sei_checkpoint *cp) {
    struct sei_thread *t = sei_thread_get();
    if (t->phase == PHASE_E1 || t->phase == PHASE_E2) {
        t->nesting++; /* a nested transaction is flattened into its handler */
        return a_runInstrumentedCode;
    }
    if (t->phase == PHASE_IDLE)
        sei_unsupported("a transaction outside a handler: open it with sei_begin or SEI_HANDLER");
    sei_expect_phase(t, PHASE_INIT, "E1's start");
    if (!(props & pr_instrumentedCode))
        sei_unsupported("the handler has no instrumented code path (an irrevocable construct such as asm?)");
    t->checkpoint = *cp;
    t->execution = 1;
    sei_set_phase(t, PHASE_E1);
    return a_runInstrumentedCode | a_saveLiveVariables;
}

static void apply_test_flip(struct sei_thread *t) {
    if (t->flip_addr != NULL && t->flip_execution == t->execution) {
        *(volatile unsigned char *)t->flip_addr ^= (unsigned char)(1u << t->flip_bit);
        t->flip_addr = NULL;
    }
}

/* R: save E1's new values, restore the snapshot, and run the handler again. */
static __attribute__((noreturn)) void reset_and_restart(struct sei_thread *t, uint32_t code) {
    sei_set_phase(t, PHASE_RESET);
    sei_log_reset(t);
    sei_effects_rewind(t);
    t->nignored = 0;
    t->execution = 2;
    sei_expect_phase(t, PHASE_RESET, "E2's start");
    sei_set_phase(t, PHASE_E2);
    sei_restart(&t->checkpoint, code);
}

/* V, then the actions that only a validated handler may take. */
static void validate_and_commit(struct sei_thread *t) {
    sei_set_phase(t, PHASE_VALIDATE);
    if (t->msg != NULL && sei_crc32c(0, t->msg, t->msg_len) != t->msg_crc)
        sei_fail("the input message changed during the handler");
    sei_log_validate(t);
    sei_effects_validate(t);
    sei_expect_phase(t, PHASE_VALIDATE, "the commit");
    if (sei_dup) sei_dup_commit(t);
    t->stats.handlers++;
    t->stats.words_logged += t->nwords;
    if (t->nwords > t->stats.max_words) t->stats.max_words = t->nwords;
    sei_effects_commit(t); /* releases locks, waits at the barrier, runs deferred calls */
    for (uint32_t i = 0; i < t->ncommit; i++) t->commit_fn[i](t->commit_arg[i]);
    sei_set_phase(t, PHASE_DONE);
}

void _ITM_commitTransaction(void) {
    struct sei_thread *t = sei_thread_get();
    if (t->nesting > 0) {
        t->nesting--;
        return;
    }
    apply_test_flip(t);
    if (t->phase == PHASE_E1) {
        sei_expect_phase(t, PHASE_E1, "E1's end");
        reset_and_restart(t, a_runInstrumentedCode | a_restoreLiveVariables);
    }
    sei_expect_phase(t, PHASE_E2, "E2's end");
    if (t->cancelled_e1) sei_fail("E1 cancelled the handler and E2 committed it");
    validate_and_commit(t);
}

/* __transaction_cancel: both executions must cancel, after the same updates; the
 * updates are then undone and the handler is skipped. */
void _ITM_abortTransaction(uint32_t reason) {
    (void)reason;
    struct sei_thread *t = sei_thread_get();
    if (t->nesting > 0)
        sei_unsupported("__transaction_cancel in a nested transaction (only the outermost may cancel)");
    apply_test_flip(t);
    if (t->phase == PHASE_E1) {
        t->cancelled_e1 = 1;
        reset_and_restart(t, a_runInstrumentedCode | a_restoreLiveVariables);
    }
    sei_expect_phase(t, PHASE_E2, "a cancel");
    if (!t->cancelled_e1) sei_fail("E2 cancelled the handler and E1 committed it");
    sei_set_phase(t, PHASE_VALIDATE);
    sei_log_validate(t);
    sei_log_undo(t);
    sei_effects_cancel(t);
    t->stats.cancelled++;
    sei_set_phase(t, PHASE_DONE);
    sei_restart(&t->checkpoint, a_abortTransaction | a_restoreLiveVariables);
}

void sei_ignore_addr(const void *addr, size_t len) {
    struct sei_thread *t = sei_thread_get();
    if (!sei_in_handler(t)) return;
    if (t->nignored == SEI_MAX_IGNORED)
        sei_unsupported("more than %d sei_ignore_addr ranges in one handler", SEI_MAX_IGNORED);
    t->ignored[t->nignored].start = (uintptr_t)addr;
    t->ignored[t->nignored].end = (uintptr_t)addr + len;
    t->nignored++;
}

void sei_test_flip(void *addr, unsigned bit, int execution) {
    if (execution == 0) {
        *(volatile unsigned char *)addr ^= (unsigned char)(1u << (bit & 7));
        return;
    }
    struct sei_thread *t = sei_thread_get();
    if (execution != t->execution) return;
    t->flip_addr = addr;
    t->flip_bit = bit & 7;
    t->flip_execution = execution;
}

void sei_stats(struct sei_stats *out) {
    struct sei_thread *t = sei_thread_get();
    *out = t->stats;
    out->bytes_per_thread = sizeof *t + (size_t)t->capacity * sizeof(struct sei_word) +
                            (size_t)(t->index_mask + 1) * sizeof(uint32_t);
}
