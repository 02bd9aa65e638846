/* The rest of the libitm ABI: clone tables, mode changes, user actions, version queries
 * and the C++ entry points. Everything a hardened binary can reference is defined
 * here, so that nothing binds to the real libitm (the gcc driver links it). */
#include <stdint.h>
#include <stdlib.h>

#include "internal.h"

/* ---- transactional clones of functions called through pointers ---- */

struct clone_table {
    const void *const *pairs; /* original, clone, original, clone, ... */
    size_t n;
    struct clone_table *next;
};

static struct clone_table *tables;
static pthread_mutex_t tables_lock = PTHREAD_MUTEX_INITIALIZER;

/* crtbegin.o calls these for each object's .tm_clone_table (weak references). */
void _ITM_registerTMCloneTable(void *table, size_t n) {
    struct clone_table *t = malloc(sizeof *t);
    if (t == NULL) sei_unsupported("out of memory registering a clone table");
    t->pairs = table;
    t->n = n;
    pthread_mutex_lock(&tables_lock);
    t->next = tables;
    tables = t;
    pthread_mutex_unlock(&tables_lock);
}

void _ITM_deregisterTMCloneTable(void *table) {
    pthread_mutex_lock(&tables_lock);
    for (struct clone_table **p = &tables; *p; p = &(*p)->next)
        if ((*p)->pairs == table) {
            struct clone_table *dead = *p;
            *p = dead->next;
            free(dead);
            break;
        }
    pthread_mutex_unlock(&tables_lock);
}

static void *find_clone(const void *fn) {
    void *clone = NULL;
    pthread_mutex_lock(&tables_lock);
    for (struct clone_table *t = tables; t && !clone; t = t->next)
        for (size_t i = 0; i < t->n; i++)
            if (t->pairs[2 * i] == fn) {
                clone = (void *)(uintptr_t)t->pairs[2 * i + 1];
                break;
            }
    pthread_mutex_unlock(&tables_lock);
    return clone;
}

void *_ITM_getTMCloneSafe(void *fn) {
    void *clone = find_clone(fn);
    if (clone != NULL) return clone;
    /* A function of the program without a clone is the program's mistake (70), the same in
     * every run; a pointer to no function can only be one a fault corrupted (86). */
    char name[128];
    int function = sei_is_function(fn, name, sizeof name);
    if (function != 0)
        sei_unsupported("a handler called %s (%p) through a pointer, and it has no transactional clone "
                        "(declare it SEI_SAFE)%s", name[0] ? name : "a function", fn,
                        function == 2 ? "; the binary has no symbol table, so a corrupted pointer into "
                                        "code would look the same" : "");
    sei_fail("a handler called %p through a pointer, which is no function of the program (a corrupted "
             "pointer)", fn);
}

/* libitm would run an unknown function irrevocably; a handler that runs twice cannot. */
void *_ITM_getTMCloneOrIrrevocable(void *fn) { return _ITM_getTMCloneSafe(fn); }

void _ITM_changeTransactionMode(int mode) {
    (void)mode;
    sei_unsupported("a handler needs irrevocable execution (an unsafe call in __transaction_relaxed?)");
}

/* ---- queries and user actions ---- */

int _ITM_inTransaction(void) { return sei_in_handler(sei_self) ? 1 /* inRetryableTransaction */ : 0; }

uint64_t _ITM_getTransactionId(void) {
    struct sei_thread *t = sei_self;
    return sei_in_handler(t) ? t->stats.handlers + 1 : 0;
}

/* Runs fn(arg) once, after V. */
void _ITM_addUserCommitAction(void (*fn)(void *), uint64_t tid, void *arg) {
    (void)tid;
    struct sei_thread *t = sei_thread_get();
    if (!sei_in_handler(t)) {
        fn(arg);
        return;
    }
    if (t->execution != 2) return; /* E2 records what both executions asked for */
    if (t->ncommit == 4) sei_unsupported("more than 4 commit actions in one handler");
    t->commit_fn[t->ncommit] = fn;
    t->commit_arg[t->ncommit] = arg;
    t->ncommit++;
}

/* Undo actions run only when a transaction rolls back for good; SEI's reset is not
 * one, and a cancelled handler has no user-visible effect to undo. */
void _ITM_addUserUndoAction(void (*fn)(void *), void *arg) {
    (void)fn;
    (void)arg;
}

void _ITM_dropReferences(void *start, size_t len) {
    (void)start;
    (void)len;
}

void _ITM_commitTransactionEH(void *exception) {
    (void)exception;
    _ITM_commitTransaction();
}

void _ITM_error(const void *where, int code) {
    (void)where;
    sei_unsupported("the TM ABI reported error %d", code);
}

int _ITM_versionCompatible(int version) { return version == 1; }

const char *_ITM_libraryVersion(void) { return "libsei 1 (lockstep), ABI 1"; }

/* ---- C++ ---- */

static __attribute__((noreturn)) void no_exceptions(void) {
    sei_unsupported("C++ exceptions inside a handler");
}
void *_ITM_cxa_allocate_exception(size_t size) {
    (void)size;
    no_exceptions();
}
void _ITM_cxa_free_exception(void *e) {
    (void)e;
    no_exceptions();
}
void _ITM_cxa_throw(void *obj, void *tinfo, void (*dest)(void *)) {
    (void)obj;
    (void)tinfo;
    (void)dest;
    no_exceptions();
}
void *_ITM_cxa_begin_catch(void *e) {
    (void)e;
    no_exceptions();
}
void _ITM_cxa_end_catch(void) { no_exceptions(); }

/* the transactional clones of operator new and delete */
void *_ITM_malloc(size_t size);
void _ITM_free(void *p);
static void *new_or_fail(size_t size) {
    void *p = _ITM_malloc(size);
    if (p == NULL) sei_unsupported("operator new failed inside a handler");
    return p;
}
void *_ZGTtnwm(size_t size) { return new_or_fail(size); }
void *_ZGTtnam(size_t size) { return new_or_fail(size); }
void *_ZGTtnwmRKSt9nothrow_t(size_t size, const void *tag) {
    (void)tag;
    return _ITM_malloc(size);
}
void *_ZGTtnamRKSt9nothrow_t(size_t size, const void *tag) {
    (void)tag;
    return _ITM_malloc(size);
}
void _ZGTtdlPv(void *p) { _ITM_free(p); }
void _ZGTtdaPv(void *p) { _ITM_free(p); }
void _ZGTtdlPvm(void *p, size_t size) {
    (void)size;
    _ITM_free(p);
}
void _ZGTtdlPvRKSt9nothrow_t(void *p, const void *tag) {
    (void)tag;
    _ITM_free(p);
}
void _ZGTtdaPvRKSt9nothrow_t(void *p, const void *tag) {
    (void)tag;
    _ITM_free(p);
}
void _ZGTtdlPvmRKSt9nothrow_t(void *p, size_t size, const void *tag) {
    (void)size;
    (void)tag;
    _ITM_free(p);
}
