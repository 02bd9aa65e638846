/* The checking barrier (SEI §4.2): each thread has a counter, odd while it runs a
 * handler. After V a thread makes its counter even, snapshots everyone's, and its
 * outputs may leave once every other thread is even (validated, locks released) or
 * has moved past the snapshot (started a later handler). Two threads that entered the
 * same critical section by a fault therefore cannot send before both have checked
 * their locks. */
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static _Atomic uint64_t counters[SEI_MAX_THREADS];
static _Atomic int nslots;
static _Atomic int disabled = -1; /* -1: SEI_BARRIER not read yet */

static __thread uint64_t snapshot[SEI_MAX_THREADS];
static __thread int snapshot_slots;

static int barrier_off(void) {
    int d = atomic_load_explicit(&disabled, memory_order_relaxed);
    if (d < 0) {
        const char *v = getenv("SEI_BARRIER");
        d = (v != NULL && strcmp(v, "0") == 0) ? 1 : 0;
        atomic_store(&disabled, d);
    }
    return d;
}

void sei_barrier_disable(void) { atomic_store(&disabled, 1); }

void sei_barrier_enter(struct sei_thread *t) {
    if (t->barrier_slot < 0) {
        int slot = atomic_fetch_add(&nslots, 1);
        if (slot >= SEI_MAX_THREADS)
            sei_unsupported("more than %d threads run handlers (SEI_MAX_THREADS)", SEI_MAX_THREADS);
        t->barrier_slot = slot;
    }
    uint64_t c = atomic_fetch_add(&counters[t->barrier_slot], 1) + 1;
    if ((c & 1) == 0) sei_fail("checking barrier: counter even at a handler's start");
}

void sei_barrier_leave(struct sei_thread *t) {
    uint64_t c = atomic_fetch_add(&counters[t->barrier_slot], 1) + 1;
    if ((c & 1) != 0) sei_fail("checking barrier: counter odd after V");
    snapshot_slots = atomic_load(&nslots);
    if (snapshot_slots > SEI_MAX_THREADS) snapshot_slots = SEI_MAX_THREADS;
    for (int i = 0; i < snapshot_slots; i++) snapshot[i] = atomic_load(&counters[i]);
}

int sei_barrier(void) {
    if (barrier_off()) return 1;
    for (int i = 0; i < snapshot_slots; i++) {
        if ((snapshot[i] & 1) == 0) continue;
        uint64_t now = atomic_load(&counters[i]);
        if ((now & 1) != 0 && now == snapshot[i]) return 0; /* still in the same handler */
    }
    return 1;
}

void sei_barrier_wait(void) {
    while (!sei_barrier()) sched_yield();
}
