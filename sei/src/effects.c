/* What a handler does besides writing memory, kept consistent across E1 and E2:
 * - allocations: E1 calls malloc/calloc, E2 gets E1's pointers; frees wait for V;
 * - mutexes (R3/R4, R8/R9): E1 locks, E2 must take the same locks in the same order,
 *   releases wait until after V, releasing a lock not held stops the process;
 * - outputs (R7): both executions CRC the output, V compares them and re-reads it;
 * - external calls (send, sendto, sendmsg, write, close): recorded in both executions,
 *   compared in V, then performed once after the checking barrier. */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "internal.h"

/* The running handler's context, or NULL outside handlers. */
static struct sei_thread *in_handler(void) {
    struct sei_thread *t = sei_self;
    return sei_in_handler(t) ? t : NULL;
}

void sei_effects_begin(struct sei_thread *t) {
    t->nallocs = 0;
    t->nlocks = 0;
    t->held_mask_e1 = 0;
    t->released_mask_e1 = 0;
    t->released_mask_e2 = 0;
    t->nsegments = 0;
    t->noutputs = 0;
    t->ncalls = 0;
    t->defer_used = 0;
    sei_effects_rewind(t); /* and the cursors and the open CRC */
}

/* Before E2: E2 replays E1's effects from the start. */
void sei_effects_rewind(struct sei_thread *t) {
    t->alloc_cursor = 0;
    t->lock_cursor = 0;
    t->segment_cursor = 0;
    t->output_cursor = 0;
    t->call_cursor = 0;
    t->open_crc = 0;
    t->open_segments = 0;
}

/* ---- allocations ---- */

static void *allocate(size_t size, int zero) {
    struct sei_thread *t = in_handler();
    if (t == NULL) return zero ? calloc(1, size) : malloc(size);
    if (t->phase == PHASE_E1) {
        if (t->nallocs == SEI_MAX_ALLOCS)
            sei_unsupported("more than %d allocations in one handler", SEI_MAX_ALLOCS);
        void *p = zero ? calloc(1, size) : malloc(size);
        t->allocs[t->nallocs++] = (struct sei_alloc){p, size, 0};
        return p;
    }
    if (t->alloc_cursor >= t->nallocs) sei_fail("E2 allocated memory that E1 did not");
    struct sei_alloc *a = &t->allocs[t->alloc_cursor++];
    if (a->is_free || a->size != size) sei_fail("E2 allocated %zu bytes where E1 did otherwise", size);
    return a->ptr;
}

void *_ITM_malloc(size_t size) { return allocate(size, 0); }

void *_ITM_calloc(size_t n, size_t size) {
    size_t total;
    if (__builtin_mul_overflow(n, size, &total)) return NULL;
    return allocate(total, 1);
}

void _ITM_free(void *p) {
    struct sei_thread *t = in_handler();
    if (t == NULL) {
        sei_dup_forget((uintptr_t)p, p ? malloc_usable_size(p) : 0);
        free(p);
        return;
    }
    if (t->phase == PHASE_E1) {
        if (t->nallocs == SEI_MAX_ALLOCS)
            sei_unsupported("more than %d allocations and frees in one handler", SEI_MAX_ALLOCS);
        t->allocs[t->nallocs++] = (struct sei_alloc){p, 0, 1};
        return;
    }
    if (t->alloc_cursor >= t->nallocs) sei_fail("E2 freed memory that E1 did not");
    struct sei_alloc *a = &t->allocs[t->alloc_cursor++];
    if (!a->is_free || a->ptr != p) sei_fail("E2 freed %p where E1 did otherwise", p);
}

/* ---- mutexes ---- */

static int lock_index(const struct sei_thread *t, const pthread_mutex_t *m) {
    for (uint32_t i = 0; i < t->nlocks; i++)
        if (t->locks[i].mutex == m) return (int)i;
    return -1;
}

/* E1 keeps the distinct locks in acquisition order; lock_cursor walks that order in
 * E2, which must acquire the same locks in the same order. */
static int acquire(pthread_mutex_t *m, int try) {
    struct sei_thread *t = in_handler();
    if (t == NULL) return try ? pthread_mutex_trylock(m) : pthread_mutex_lock(m);
    int i = lock_index(t, m);
    if (t->phase == PHASE_E1) {
        if (i >= 0) {
            /* released earlier in this handler, but the release is deferred: still ours */
            if (!(t->released_mask_e1 & (1u << i))) sei_fail("a handler locked %p twice", (void *)m);
            t->released_mask_e1 &= ~(1u << i);
            return 0;
        }
        if (t->nlocks == SEI_MAX_LOCKS) sei_unsupported("more than %d locks in one handler", SEI_MAX_LOCKS);
        int rc = try ? pthread_mutex_trylock(m) : pthread_mutex_lock(m);
        if (rc != 0) return rc; /* a busy trylock: nothing held, E2 must see the same */
        t->locks[t->nlocks].mutex = m;
        t->held_mask_e1 |= 1u << t->nlocks;
        t->nlocks++;
        return 0;
    }
    /* E2: the lock is already held by this thread since E1 */
    if (i < 0) {
        if (try) return EBUSY; /* E1's trylock failed too, or V will find the mismatch */
        sei_fail("E2 locked %p, which E1 did not lock", (void *)m);
    }
    if ((uint32_t)i != t->lock_cursor && !(t->released_mask_e2 & (1u << i)))
        sei_fail("E2 locked %p out of E1's order", (void *)m);
    if ((uint32_t)i == t->lock_cursor) t->lock_cursor++;
    t->released_mask_e2 &= ~(1u << i);
    return 0;
}

int sei_tx_mutex_lock(pthread_mutex_t *m) { return acquire(m, 0); }
int sei_tx_mutex_trylock(pthread_mutex_t *m) { return acquire(m, 1); }

int sei_tx_mutex_unlock(pthread_mutex_t *m) {
    struct sei_thread *t = in_handler();
    if (t == NULL) return pthread_mutex_unlock(m);
    int i = lock_index(t, m);
    uint32_t *released = t->phase == PHASE_E1 ? &t->released_mask_e1 : &t->released_mask_e2;
    int held = i >= 0 && (t->phase == PHASE_E1 || (uint32_t)i < t->lock_cursor);
    if (!held || (*released & (1u << i)))
        sei_fail("a handler released %p, which it does not hold (R4/R9)", (void *)m);
    *released |= 1u << i; /* the real release waits until after V */
    return 0;
}

/* ---- outputs ---- */

/* A handler whose body has nothing to instrument (only calls like these) is compiled
 * without a transaction: it runs once, in phase I, and is closed by sei_end. */
static struct sei_thread *output_context(const char *what) {
    struct sei_thread *t = sei_self;
    if (t == NULL || !(sei_in_handler(t) || t->phase == PHASE_INIT))
        sei_unsupported("%s outside a handler", what);
    return t;
}

/* An output's CRC so far, continued over buf. An output that starts with the handler's
 * input message (a reply CRC that covers the request it answers) starts from the
 * message's CRC, which phase I checked and V checks again, instead of reading the
 * message once more in each execution and in V. */
static uint32_t continue_crc(const struct sei_thread *t, int first, uint32_t crc, const void *buf, size_t len) {
    if (first && t->msg != NULL && buf == t->msg && len == t->msg_len) return t->msg_crc;
    return sei_crc32c(crc, buf, len);
}

void sei_output_append(const void *buf, size_t len) {
    struct sei_thread *t = output_context("sei_output_append");
    if (t->phase == PHASE_E2) {
        if (t->segment_cursor >= t->nsegments) sei_fail("E2 appended output that E1 did not");
        const struct sei_segment *s = &t->segments[t->segment_cursor++];
        if (s->buf != buf || s->len != len) sei_fail("E2 appended different output than E1");
    } else {
        if (t->nsegments == SEI_MAX_SEGMENTS)
            sei_unsupported("more than %d sei_output_append calls in one handler", SEI_MAX_SEGMENTS);
        t->segments[t->nsegments++] = (struct sei_segment){buf, len};
        if (t->phase == PHASE_INIT) t->segment_cursor = t->nsegments;
    }
    t->open_crc = continue_crc(t, t->open_segments++ == 0, t->open_crc, buf, len);
}

void sei_output_done(void) {
    struct sei_thread *t = output_context("sei_output_done");
    if (t->phase == PHASE_E2) {
        if (t->output_cursor >= t->noutputs) sei_fail("E2 produced an output that E1 did not");
        struct sei_output *o = &t->outputs[t->output_cursor++];
        if (t->segment_cursor != o->first_segment + o->segments) sei_fail("E2's output has other segments");
        o->crc_e2 = t->open_crc;
    } else {
        if (t->noutputs == SEI_MAX_OUTPUTS)
            sei_unsupported("more than %d output messages in one handler", SEI_MAX_OUTPUTS);
        uint32_t first = t->noutputs ? t->outputs[t->noutputs - 1].first_segment +
                                           t->outputs[t->noutputs - 1].segments
                                     : 0;
        t->outputs[t->noutputs++] = (struct sei_output){t->open_crc, 0, first, t->nsegments - first};
        if (t->phase == PHASE_INIT) {
            t->outputs[t->noutputs - 1].crc_e2 = t->open_crc;
            t->output_cursor = t->noutputs;
        }
    }
    t->open_crc = 0;
    t->open_segments = 0;
}

uint32_t sei_crc_pop(void) {
    struct sei_thread *t = sei_thread_get();
    if (sei_in_handler(t)) sei_unsupported("sei_crc_pop inside a handler (pop it after sei_end)");
    if (t->crc_count == 0) sei_unsupported("sei_crc_pop with no output CRC left (call sei_output_done)");
    uint32_t crc = t->crcs[t->crc_head];
    t->crc_head = (t->crc_head + 1) % SEI_MAX_CRCS;
    t->crc_count--;
    return crc;
}

/* ---- external calls ---- */

static struct sei_call *record_call(struct sei_thread *t, enum sei_call_kind kind, int fd, int flags,
                                    const struct iovec *iov, size_t iovcnt, const void *addr, size_t addr_len) {
    size_t len = 0;
    uint32_t crc = 0;
    for (size_t i = 0; i < iovcnt; i++) {
        len += iov[i].iov_len;
        crc = sei_crc32c(crc, iov[i].iov_base, iov[i].iov_len);
    }
    if (t->phase == PHASE_E1) {
        if (t->ncalls == SEI_MAX_DEFERRED)
            sei_unsupported("more than %d sends/writes/closes in one handler", SEI_MAX_DEFERRED);
        struct sei_call *c = &t->calls[t->ncalls++];
        *c = (struct sei_call){kind, fd, flags, 0, (uint32_t)len, crc, 0, (uint32_t)addr_len};
        return c;
    }
    if (t->call_cursor >= t->ncalls) sei_fail("E2 made an external call that E1 did not");
    struct sei_call *c = &t->calls[t->call_cursor++];
    if (c->kind != kind || c->fd != fd || c->flags != flags || c->len != len || c->addr_len != addr_len)
        sei_fail("E2's external call on fd %d differs from E1's", fd);
    if (c->crc_e1 != crc) sei_fail("E2 sent other bytes than E1 on fd %d", fd);
    /* E2 keeps the payload: the buffer may be a local that dies with the handler */
    if (t->defer_used + len + addr_len > SEI_DEFER_BYTES)
        sei_unsupported("a handler's deferred sends carry more than %d bytes", SEI_DEFER_BYTES);
    c->offset = t->defer_used;
    for (size_t i = 0; i < iovcnt; i++) {
        memcpy(t->defer_bytes + t->defer_used, iov[i].iov_base, iov[i].iov_len);
        t->defer_used += (uint32_t)iov[i].iov_len;
    }
    c->addr_offset = t->defer_used;
    if (addr_len) memcpy(t->defer_bytes + t->defer_used, addr, addr_len);
    t->defer_used += (uint32_t)addr_len;
    return c;
}

ssize_t sei_tx_send(int fd, const void *buf, size_t len, int flags) {
    struct sei_thread *t = in_handler();
    if (t == NULL) return send(fd, buf, len, flags);
    struct iovec iov = {(void *)(uintptr_t)buf, len};
    record_call(t, CALL_SEND, fd, flags, &iov, 1, NULL, 0);
    return (ssize_t)len;
}

ssize_t sei_tx_sendto(int fd, const void *buf, size_t len, int flags, const struct sockaddr *to, socklen_t tolen) {
    struct sei_thread *t = in_handler();
    if (t == NULL) return sendto(fd, buf, len, flags, to, tolen);
    struct iovec iov = {(void *)(uintptr_t)buf, len};
    record_call(t, CALL_SENDTO, fd, flags, &iov, 1, to, to ? tolen : 0);
    return (ssize_t)len;
}

ssize_t sei_tx_sendmsg(int fd, const struct msghdr *msg, int flags) {
    struct sei_thread *t = in_handler();
    if (t == NULL) return sendmsg(fd, msg, flags);
    if (msg->msg_controllen != 0) sei_unsupported("sendmsg with control data inside a handler");
    struct sei_call *c =
        record_call(t, CALL_SENDMSG, fd, flags, msg->msg_iov, msg->msg_iovlen, msg->msg_name, msg->msg_namelen);
    return (ssize_t)c->len;
}

ssize_t sei_tx_write(int fd, const void *buf, size_t len) {
    struct sei_thread *t = in_handler();
    if (t == NULL) return write(fd, buf, len);
    struct iovec iov = {(void *)(uintptr_t)buf, len};
    record_call(t, CALL_WRITE, fd, 0, &iov, 1, NULL, 0);
    return (ssize_t)len;
}

int sei_tx_close(int fd) {
    struct sei_thread *t = in_handler();
    if (t == NULL) return close(fd);
    record_call(t, CALL_CLOSE, fd, 0, NULL, 0, NULL, 0);
    return 0;
}

/* Sends all of a deferred payload, waiting while a non-blocking socket is full. */
static void perform(const struct sei_thread *t, const struct sei_call *c) {
    const unsigned char *p = t->defer_bytes + c->offset;
    const struct sockaddr *addr = c->addr_len ? (const void *)(t->defer_bytes + c->addr_offset) : NULL;
    if (c->kind == CALL_CLOSE) {
        close(c->fd);
        return;
    }
    size_t done = 0;
    while (done < c->len) {
        ssize_t n;
        if (c->kind == CALL_WRITE)
            n = write(c->fd, p + done, c->len - done);
        else if (addr != NULL)
            n = sendto(c->fd, p + done, c->len - done, c->flags, addr, c->addr_len);
        else
            n = send(c->fd, p + done, c->len - done, c->flags);
        if (n > 0) {
            done += (size_t)n;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            struct pollfd pfd = {c->fd, POLLOUT, 0};
            poll(&pfd, 1, 1000);
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else {
            return; /* the peer is gone: as if the send had failed outside the handler */
        }
    }
}

/* V's part: both executions had the same effects. */
void sei_effects_validate(struct sei_thread *t) {
    if (t->alloc_cursor != t->nallocs) sei_fail("E2 made fewer allocations than E1");
    if (t->lock_cursor != t->nlocks) sei_fail("E2 took fewer locks than E1");
    if (t->released_mask_e1 != t->released_mask_e2) sei_fail("E1 and E2 released different locks");
    if (t->segment_cursor != t->nsegments || t->output_cursor != t->noutputs)
        sei_fail("E2 produced fewer outputs than E1");
    if (t->call_cursor != t->ncalls) sei_fail("E2 made fewer external calls than E1");
    for (uint32_t i = 0; i < t->noutputs; i++) {
        const struct sei_output *o = &t->outputs[i];
        if (o->crc_e1 != o->crc_e2) sei_fail("output %u differs between E1 and E2", i);
        uint32_t crc = 0;
        for (uint32_t s = o->first_segment; s < o->first_segment + o->segments; s++)
            crc = continue_crc(t, s == o->first_segment, crc, t->segments[s].buf, t->segments[s].len);
        if (crc != o->crc_e2) sei_fail("output %u changed after E2 computed its CRC", i);
    }
    for (uint32_t i = 0; i < t->ncalls; i++) {
        const struct sei_call *c = &t->calls[i];
        if (sei_crc32c(0, t->defer_bytes + c->offset, c->len) != c->crc_e1)
            sei_fail("a deferred send's payload changed before it left");
    }
}

static void release_locks(struct sei_thread *t) {
    for (uint32_t i = t->nlocks; i-- > 0;) pthread_mutex_unlock(t->locks[i].mutex);
    t->nlocks = 0;
}

/* After V: locks, the checking barrier, then the effects that leave the process. */
void sei_effects_commit(struct sei_thread *t) {
    /* locks a handler leaves held stay held, as they would without hardening */
    for (uint32_t i = t->nlocks; i-- > 0;)
        if (t->released_mask_e1 & (1u << i)) pthread_mutex_unlock(t->locks[i].mutex);
    t->nlocks = 0;
    sei_barrier_leave(t);
    if (t->ncalls != 0) sei_barrier_wait();
    for (uint32_t i = 0; i < t->ncalls; i++) perform(t, &t->calls[i]);
    for (uint32_t i = 0; i < t->nallocs; i++)
        if (t->allocs[i].is_free && t->allocs[i].ptr != NULL) {
            sei_dup_forget((uintptr_t)t->allocs[i].ptr, malloc_usable_size(t->allocs[i].ptr));
            free(t->allocs[i].ptr);
        }
    for (uint32_t i = 0; i < t->noutputs; i++) {
        if (t->crc_count == SEI_MAX_CRCS)
            sei_unsupported("more than %d output CRCs not popped (call sei_crc_pop)", SEI_MAX_CRCS);
        t->crcs[(t->crc_head + t->crc_count) % SEI_MAX_CRCS] = t->outputs[i].crc_e2;
        t->crc_count++;
    }
}

/* A cancelled handler: no effect survives. */
void sei_effects_cancel(struct sei_thread *t) {
    release_locks(t);
    sei_barrier_leave(t);
    for (uint32_t i = 0; i < t->nallocs; i++)
        if (!t->allocs[i].is_free) free(t->allocs[i].ptr);
}
