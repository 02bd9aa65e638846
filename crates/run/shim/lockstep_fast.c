/* lockstep_fast.c - the in-process fast path of `lockstep run --backend fast`.
 * Loaded with LD_PRELOAD; inert unless LOCKSTEP_FAST is set.
 *
 * INTERCEPTION, after lazypoline. Syscall User Dispatch (SUD) is the catch-all: a syscall
 * made from outside page 0 raises SIGSYS; the handler rewrites that site's `syscall`
 * (0f 05) into `call *%rax` (ff d0) and runs the call. From then on the site calls the
 * trampoline directly: `rax` holds the syscall number, so the call lands in a nop sled on
 * page 0 that slides into `lf_entry`, which calls `lf_dispatch` and returns to the
 * instruction after the site. Under ptrace each SIGSYS is a signal stop, so SUD is only
 * the discovery path: a site costs one stop, once. Calls whose stack or return differs
 * (rt_sigreturn, clone, clone3, fork, vfork, execve, execveat) are never rewritten: the
 * handler opens an ALLOW window on the SUD selector and runs the instruction again.
 *
 * GATES. Every syscall the shim makes goes through one of two `syscall; ret` gates on page
 * 0: the fast gate at LF_GATE_FAST, which the monitor's seccomp filter lets through
 * without a stop, and the slow gate, which meets the filter like any call of the program
 * (so the ptrace monitor sees it, and handles it as it always did).
 *
 * THE RING (with LOCKSTEP_FAST_RING, set by the monitor). The monitor creates one shared
 * file: a header it writes, a clock area, and one region per replica. The shim maps its
 * own region read-write, the others and the header read-only, and seals the mappings.
 * In the main thread of the first program image, the calls of lockstep_fast_table.h (the
 * hot inputs and outputs, generated from lockstep-trace's table) are replicated here:
 *  - the leader runs an input once through the fast gate and publishes a record {sequence,
 *    number, digest of the arguments, result, output buffers, CRC32C} in its region; a
 *    follower checks number and digest against its own call, copies the buffers and the
 *    result, and never enters the kernel;
 *  - for an output, each follower publishes its digest first; the leader runs the call only
 *    when every digest equals its own, then publishes the result;
 *  - clock reads are answered from per-clock value sequences in the clock area, as the
 *    monitor does (clock.rs), re-aligned at every output.
 *  - a signal the monitor posts to the lane's mailbox becomes a SIGNAL record in place of
 *    the leader's next call, and every replica raises it on itself there (see "signals as
 *    records" below);
 *  - the program's pthread mutex, condition variable and semaphore operations are SYNC
 *    records (see "synchronisation"), and every record of every lane has a place in the
 *    leader's order, which followers' threads keep (struct lf_order).
 * Anything else, and any doubt, goes through the slow gate to the monitor: a mismatch on
 * an output makes the leader publish ESCALATE,
 * and every replica then makes that call through the monitor, which votes as always; a
 * follower that finds a record that does not match its call reports it (lockstep_fast
 * DIVERGED). The monitor switches the ring off (`off`) when the replica set changes;
 * records already published are still consumed. When the set is whole again, the monitor
 * writes the next epoch into lf_reattach_to and the shim attaches that epoch's ring.
 *
 * Limits (docs/run.md): page 0 is mapped; the `call` writes 8 bytes below the stack
 * pointer; the main thread of the first image and up to LF_LANES - 1 threads it starts with
 * pthread_create use the ring (other threads, forked children and exec'd programs go to
 * the monitor); a fast-path call given an unreadable
 * buffer faults in the shim where the kernel would return EFAULT; the clock area is
 * writable by every replica.
 *
 * Built with -mgeneral-regs-only: the trampoline saves only the general registers, so
 * nothing here may touch vector state. No libc function is called after start-up. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <link.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/socket.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>
#include <linux/futex.h>
#include <dlfcn.h>
#include <pthread.h>
#include <semaphore.h>

#include "lockstep_fast_layout.h"

#ifndef PR_SET_SYSCALL_USER_DISPATCH
#define PR_SET_SYSCALL_USER_DISPATCH 59
#define PR_SYS_DISPATCH_ON 1
#endif
#ifndef MADV_WIPEONFORK
#define MADV_WIPEONFORK 18
#endif
#define SYS_MSEAL 462
#define SELECTOR_ALLOW 0
#define SELECTOR_BLOCK 1
#define SI_SYS_USER_DISPATCH 2
#define KSA_RESTORER 0x04000000UL

/* Page 0: the sled covers every syscall number below SLED_LEN. */
#define SLED_LEN 512
#define MAX_NR SLED_LEN
#define GATE_SLOW (LF_GATE_FAST + 0x10)
#define RESTORER (LF_GATE_FAST + 0x20)

/* lockstep_fast(op, ...) */
#define OP_HELLO 1
#define OP_DIVERGED 2
#define OP_HELLO_THREAD 3
#define DIVERGED_CRC 0xffffffffUL /* in place of the leader's number: the record is corrupt */
#define DIVERGED_LEADER 0xfffffffeUL /* the leader's record does not match its call's result */
#define DIVERGED_STATE 0xfffffffdUL  /* in place of the leader's number: this replica's own wait gave an impossible answer */

#define RING_MAGIC 0x4c4f434b53544550ULL /* "LOCKSTEP" */
#define KIND_RESULT 1
#define KIND_ESCALATE 2
#define KIND_SIGNAL 3 /* a signal goes in before this call (see deliver_signal) */
#define KIND_SYNC 4   /* a synchronisation operation of the program (see "synchronisation") */
/* A SIGNAL record's `signal` word: the number, what happens to the call afterwards, and
 * the kernel's restart code when the signal interrupted it. */
#define SIGNAL_NUMBER 0xffULL
#define SIGNAL_RESTART (1ULL << 8)     /* the call is made (again) after the handler */
#define SIGNAL_INTERRUPTED (1ULL << 9) /* it had entered the kernel; otherwise it returns EINTR */
#define SIGNAL_CODE_SHIFT 16
#define ERESTARTSYS 512
#define ERESTARTNOINTR 513
/* ring_call: the call is made again as a new record (after a signal's handler). */
#define LF_AGAIN LONG_MIN

/* --- the generated table ------------------------------------------------------------ */
#define LF_MAX_NR MAX_NR
enum { F_SLOW = 0, F_INPUT, F_OUTPUT, F_CLOCK, F_LOCAL };
enum { A_IGNORE = 0, A_VAL, A_IN, A_OUT, A_INOUT, A_IOV_IN, A_IOV_OUT, A_NULL_ONLY, A_MSG_IN };
enum { L_FIXED = 0, L_ARG, L_RET };
struct lf_arg {
    unsigned char kind, len_kind, len_arg;
    unsigned int size;
};
struct lf_desc {
    unsigned char fast, nargs;
    struct lf_arg args[6];
};
#include "lockstep_fast_table.h"

/* --- the shared layout (same field order as `fast::Header` in crates/run/src/fast.rs) - */
struct lf_header {
    uint64_t magic;
    uint32_t version, replicas;
    uint32_t leader, off;
    uint32_t sync_order, spin; /* SYNC_ORDER_*: which order the followers' threads keep */
    uint64_t clocks_offset, regions_offset, region_size, total_size;
    int32_t cpu[4]; /* each replica's CPU, -1 if not pinned */
    uint32_t strict; /* 1: the monitor checks every output before it runs */
    uint32_t epoch;  /* this ring's place in LOCKSTEP_FAST_RING's list */
    uint32_t lanes;       /* LF_LANES */
    uint32_t leader_lost; /* the leader was removed: what it had in flight never comes */
    uint64_t clocks_size; /* bytes of one lane's clock area */
    uint64_t orders_offset; /* where each replica's `struct lf_order` starts (LF_ORDER_SIZE apart) */
    /* Bit r: replica region r was removed (a follower voted out while the ring stays on):
     * nobody waits for it any more. */
    uint32_t lost;
    /* The region + 1 of a leader replaced in place by a follower (0: none; see "a new
     * leader in place"): records up to each lane's `cut` are that region's. */
    uint32_t former;
    /* 1: the monitor's committer makes the leader's outputs (see "the output commit") */
    uint32_t commit;
    /* nonzero while the committer sleeps on the doorbell */
    uint32_t committer_sleeping;
    /* where the doorbell word lies: in the page after the clock areas, writable by all */
    uint64_t doorbell_offset;
    /* bumped by the committer when some descriptor may no longer take posted outputs: each
     * replica then forgets every posting hint it holds (see "posted outputs") */
    uint32_t post_epoch, pad;
};

/* The monitor's request to deliver a signal in one lane: `request` grows by one per request,
 * `sig` is 0 when the monitor delivered it otherwise meanwhile, `code` the kernel's restart
 * code of the call it interrupted for it (0: none). In the header page, read-only here. */
struct lf_mailbox {
    uint32_t request, sig;
    int64_t code;
};
_Static_assert(LF_MAILBOX_OFFSET + LF_LANES * sizeof(struct lf_mailbox) <= LF_COMMIT_OFFSET, "mailboxes");

/* The committer's answer to a lane's commit request (see "the output commit"): `seq` is
 * the request answered, `verdict` a COMMIT_* code, `ret` the kernel's result when
 * COMMIT_DONE. `word` is the futex word the leader sleeps on. In the header page, written
 * by the monitor alone. */
struct lf_commit_answer {
    uint64_t seq;
    int64_t ret;
    uint32_t word, verdict;
    /* every posted output of the lane up to this record is written (or will never be) */
    uint64_t taken;
    /* with COMMIT_DONE: nonzero when the descriptor may take posted outputs from now on,
     * the committer's name for the open file (see "posted outputs") */
    uint32_t handle, pad;
    uint64_t pad2;
};
#define COMMIT_DONE 1     /* the committer wrote the output; `ret` is the call's result */
#define COMMIT_ESCALATE 2 /* no go-ahead (votes differ, the ring changed, an error): the monitor votes */
#define COMMIT_OWN 3      /* a descriptor the committer does not write (a pipe, a tty): the leader does */
_Static_assert(LF_COMMIT_OFFSET + LF_LANES * sizeof(struct lf_commit_answer) <= LF_HEADER_SIZE, "commit answers");

struct lf_time {
    int64_t sec, nsec;
};

struct lf_clock {
    uint32_t lock, pad;
    uint64_t produced;
    struct lf_time values[LF_CLOCK_RING];
};

struct lf_record {
    uint64_t seq;
    uint32_t nr, kind;
    uint64_t digest;
    int64_t ret;
    uint32_t len, crc;
    union {
        uint64_t clock_sync[LF_CLOCKS];
        /* KIND_SYNC, a mutex take (lock, trylock, a wait's return; see "owned mutexes"):
         * the lane's take number, and the previous owner's (lane + 1) << TAKE_LANE_SHIFT |
         * its takes at that moment (0: none) */
        struct {
            uint64_t take, after;
        } sync;
    };
    uint64_t signal; /* KIND_SIGNAL: SIGNAL_* */
    uint64_t order;  /* the record's place in the leader's order of events across lanes */
    /* A posted output (see "posted outputs"): the bytes of its copy in the payload (0: not
     * posted), the committer's handle of its descriptor, and where the leader saw the
     * payload (the copy's iovecs point into it). */
    uint32_t post_len, post_handle;
    uint64_t post_base;
    uint64_t post_flags; /* sendto's and sendmsg's flags; writev's iovec count << 32 */
    unsigned char payload[LF_PAYLOAD_MAX];
};
_Static_assert(offsetof(struct lf_record, payload) == LF_RECORD_HEAD, "record head");

struct lf_region_head {
    /* written as a follower */
    uint64_t consumed, vote_seq, vote_digest, slow_seq;
    uint32_t progress; /* futex word, bumped after each change above */
    uint32_t sleeping; /* nonzero while this replica sleeps on another's futex word */
    /* written as the leader */
    uint64_t published;
    uint32_t published_word; /* futex word, bumped after each publication */
    /* written as the leader: the call it entered the kernel for waits for the outside
     * world (epoll_wait, poll with a timeout); nonzero until its record is published */
    uint32_t waiting_outside;
    /* for --stats */
    uint64_t fast_calls, slow_calls;
    /* diagnostics: calls the ring thread made around the ring (a vfork child's), and
     * the leader's calls taken to the monitor without a record (off, stuck follower) */
    uint64_t bypassed, unrecorded;
    /* written as a follower: the record it waits for (0: none) */
    uint64_t awaiting;
    /* written as the leader: the call whose votes it waits for (0: none) */
    uint64_t vote_wanted;
    /* written as the leader before it enters the kernel for call `in_flight` (number
     * `in_flight_nr`); `published` catches up once the record is out. A leader lost in
     * between may have run the call: the monitor then stops the run (see fast_session.rs). */
    uint64_t in_flight, in_flight_nr;
    /* written as the leader: the last signal request of the monitor it took */
    uint64_t signal_seen;
    /* written as a follower: nonzero while this lane's thread waits in a futex call */
    uint64_t in_futex;
    /* As a leader promoted in place (by the monitor): the former leader published this
     * lane's records up to this one (see "a new leader in place"). */
    uint64_t cut;
    /* written as the leader: the output call `commit_seq` waits for the committer, with
     * its number and arguments (see "the output commit") */
    uint64_t commit_seq, commit_nr;
    uint64_t commit_args[6];
    /* written as a follower: its vote on posted output `post_vote_seq` (at that output's
     * seq % LF_SLOTS), the digest of its own call, once it found the record the same */
    uint64_t post_vote_seq[LF_SLOTS], post_vote_digest[LF_SLOTS];
    /* written as a follower: it is done with the records up to this one, having taken
     * them (and voted) or found one different from its call: it votes on none later */
    uint64_t passed;
    /* The lane's mutex takes (see "owned mutexes"): as the leader, the takes it decided
     * (a recorded one once its record is out); as a follower, those done natively */
    uint64_t takes;
    /* written as the leader, for --stats: takes that needed no record */
    uint64_t takes_unrecorded;
};
/* The order of events (issue 17). Threads of the leader run as they will; each record of
 * any lane claims the next index of the leader's order when it is published (an event
 * that hands something to another thread, such as unlocking a mutex, before it does so;
 * one that takes something, such as a call's result or a lock, after), and names its lane
 * and record there. A follower's thread takes each of its records only in its turn, once
 * every earlier index is done in its replica, so that its threads meet in the order the
 * leader's did: a lock taken first there is taken first here. One per replica. */
struct lf_order_entry {
    uint64_t index; /* index + 1 once written */
    uint64_t what;  /* lane << ORDER_LANE_SHIFT | record */
};
#define ORDER_LANE_SHIFT 56
struct lf_order_head {
    uint64_t claimed; /* as the leader: the next index */
    /* As the leader in the serial order: a ticket lock, the right to run the program's code
     * (see "the serial order"). */
    uint32_t token_next, token_serving;
    /* As a leader promoted in place (by the monitor): its first index; every earlier one
     * is the former leader's (0: none). */
    uint64_t first_claim;
    uint64_t pad0[5];
    uint64_t consumed;  /* as a follower: every index below this one is done */
    uint32_t turn_word; /* futex word, bumped when `consumed` moves */
    uint32_t sleepers;  /* threads asleep on turn_word */
    uint64_t skipped;   /* records taken before their turn (see take_turn) */
    uint32_t object_word;     /* futex word, bumped when an object's `count` moves (a follower) */
    uint32_t object_sleepers; /* threads asleep on object_word */
    /* Sleeps of this replica's threads that ended in futex_wait's timeout with what they
     * waited for already there: a wake-up that came late or never (see futex_wait). */
    uint64_t late_wakes;
    /* Futex wakes this replica's threads sent to another replica's threads in the ring
     * (a leader waking its followers, a follower its leader), for --stats: a hand-off
     * across CPUs each, so `make test` bounds them per request. */
    uint64_t wakes;
    uint64_t pad1[2];
};
#define SYNC_ORDER_GLOBAL 0
#define SYNC_ORDER_OBJECT 1
#define SYNC_ORDER_SERIAL 2
/* Objects with an order of their own (SYNC_ORDER_OBJECT): a synchronisation
 * record does not take a place in the order of every event, but the next ticket of its
 * object (the mutex, semaphore, read-write lock, barrier or once control, by address), and
 * a follower's thread waits only for the earlier tickets of the same object. Threads that
 * work on different objects then never wait for each other (RomainMT's per-lock order).
 * A record's `order` names the object's slot and the ticket (ORDER_OBJECT set). */
struct lf_object {
    uint64_t addr;  /* as the leader: the object's address (0: a free slot) */
    uint64_t count; /* as the leader: tickets handed out; as a follower: tickets done in a row */
};
#define ORDER_OBJECT (1ULL << 63)
#define ORDER_SLOT_SHIFT 40
#define ORDER_TICKET_MASK ((1ULL << ORDER_SLOT_SHIFT) - 1)
#define OBJECT_PROBES 32 /* slots tried for an address before the order of every event is used */
struct lf_order {
    struct lf_order_head h;
    struct lf_order_entry entries[LF_ORDER_SLOTS]; /* as the leader, at index % LF_ORDER_SLOTS */
    uint64_t done[LF_ORDER_SLOTS];                 /* as a follower: index + 1 once taken */
    struct lf_object objects[LF_OBJECTS];
};
_Static_assert(sizeof(struct lf_order_head) == 128, "order head (fast::OrderHead)");
_Static_assert(sizeof(struct lf_order) <= LF_ORDER_SIZE, "order size");
_Static_assert(offsetof(struct lf_order, objects) == 128 + LF_ORDER_SLOTS * 24, "objects (fast::OBJECTS_OFFSET)");

struct lf_region {
    struct lf_region_head h;
    unsigned char pad[LF_REGION_HEAD - sizeof(struct lf_region_head)];
    struct lf_record records[LF_SLOTS];
};

/* Per lane (one thread's share of the ring), in each replica; on a page that a fork wipes,
 * so a child never touches the parent's ring. */
struct lf_state {
    volatile struct lf_header *hdr; /* NULL: no ring */
    struct lf_clock *clocks;
    struct lf_region *regions[LF_MAX_REPLICAS];
    struct lf_order *orders[LF_MAX_REPLICAS];
    const volatile struct lf_mailbox *mailbox;
    volatile struct lf_commit_answer *answer; /* this lane's commit answers (header page, read-only) */
    volatile uint32_t *doorbell;                    /* the committer's futex word */
    uint32_t me, leader, replicas, spin;
    uint32_t signal_seen; /* the mailbox's last request taken */
    uint32_t promoted;    /* this lane led after its replica was promoted in place */
    uint32_t spin_budget; /* this lane's current spin (adaptive, at most `spin`) */
    uint32_t wake_pending; /* as the leader: records published since it last woke followers (below) */
    uint32_t owed_votes;   /* as a follower: posted outputs voted on since the last doorbell */
    uint64_t last_posted;  /* as the leader: the last output it posted since it rang the doorbell */
    uint32_t posting;      /* as the leader: the record being published is a posted output */
    uint32_t posted_unwoken; /* as the leader: outputs posted since it last woke followers */
    uint64_t seq; /* the last replicated call */
    uint64_t clock_next[LF_CLOCKS];
    unsigned char *stack; /* RING_STACK bytes above a guard page */
    volatile int stack_busy; /* a call runs on `stack` (entered from another stack) */
    long owner_tid;       /* the thread that uses this lane */
    /* glibc's tid word of the lane's thread, which the kernel clears once the thread is
     * gone (NULL: not found); `exiting`: the thread's exit has had its turn (see "thread
     * exits and glibc's stack cache"). */
    volatile pid_t *tid_word;
    volatile uint32_t exiting;
    uint64_t end; /* the number of the thread's end among this replica's (0: not yet) */
    uint32_t lane;
    /* The serial order: as the leader, whether this thread holds the token, and the events
     * it published since it took it; as a follower, the place it holds (index + 1, 0: none). */
    uint32_t serial_token, serial_events;
    uint64_t serial_place;
};

struct kernel_sigaction {
    void *handler;
    unsigned long flags;
    void *restorer;
    uint64_t mask;
};

/* The SUD selector, one per thread (an ALLOW window opened by one thread must not let
 * another's calls past): BLOCK sends every syscall from outside page 0 to SIGSYS. */
static __thread volatile char lf_selector __attribute__((tls_model("initial-exec"))) = SELECTOR_ALLOW;
static int lf_active;
static int lf_report;
static unsigned long lf_counts[MAX_NR];
static unsigned long lf_sites;
static unsigned long lf_unrewritable;
static unsigned long lf_windows;
/* The lanes of the ring in use (LF_LANES states), and the calling thread's lane (NULL: the
 * thread goes to the monitor for every call). */
static struct lf_state *lf_lanes;
/* Who took each mutex last (see "owned mutexes"); wiped in a fork's child, as the lanes
 * are. NULL: every take is recorded. */
struct lf_owner {
    uint64_t addr; /* the mutex (0: a free slot) */
    /* (ring epoch + 1) << 32 | the lane that took it last + 1 (0: none yet), read and
     * written under the mutex: an owner of an earlier ring is none, so that every replica,
     * one forked by re-integration too, starts each ring with the same (empty) table */
    uint64_t owner;
};
static struct lf_owner *lf_owners;
#define LF_OWNERS 16384    /* mutexes tracked; one past them is always recorded */
#define OWNER_PROBES 32    /* slots tried for a mutex's address */
static __thread struct lf_state *lf_my __attribute__((tls_model("initial-exec")));
/* Whether this thread asked for a lane already (attach_thread), so that one without stays
 * without at no further cost. */
static __thread int lf_attach_tried __attribute__((tls_model("initial-exec")));
/* A vfork-like clone happened in this thread: until it shows its own tid again, a call may
 * come from the child that borrows its memory (and its TLS), which must not touch the ring. */
static __thread volatile int lf_vfork_seen __attribute__((tls_model("initial-exec")));
/* Rings: the monitor creates one per epoch up front (LOCKSTEP_FAST_RING lists them). When
 * the replica set changes the ring in use is switched off; once the set is whole again
 * the monitor writes the next epoch into lf_reattach_to in every replica, all stopped at
 * the same call, and each attaches the next ring right after that call returns. */
#define LF_RINGS 4
static char lf_ring_paths[LF_RINGS][128];
static uint32_t lf_ring_count, lf_ring_epoch;
static volatile uint32_t lf_reattach_to;
static unsigned char *lf_ring_stacks; /* one per lane; kept across epochs and re-integration forks */
static long after_slow_call(long ret);

/* Test hooks (LOCKSTEP_FAST_TEST, tests/run_fast.rs): "corrupt:N" makes the leader damage
 * record N after its CRC is computed; "lie:N" makes the leader run call N with its third
 * argument one less than it compared (as a register flipped after the check would);
 * "result:N" flips a bit of call N's result on its way from the kernel into the record;
 * "wild-result:N" flips bit 40 of call N's result before any copy of it is taken;
 * "crash:N" makes the leader fault right after call N returned, before its record is out;
 * "bad-wait:N" makes the last follower's wait for its first call from record N on give an
 * impossible answer (whether record N of a thread is a call or a lock depends on who owned
 * the lock, see "owned mutexes"); "hang:N"
 * makes the leader wait forever in a private futex wait (through the monitor)
 * before call N; "flap:N" makes the leader, before call N, spin and sleep on ring memory in
 * turn for ever; "signal:N" makes the leader publish a SIGNAL record (SIGUSR1) for its first call from record N on that the monitor
 * never posted, as a corrupted mailbox check would;
 * "post-corrupt:N" makes the leader damage the copy of posted output N after its digest;
 * "selector-allow" leaves SUD's selector open, as a corrupted selector would, so that only
 * the seccomp backstop sees the program's calls. */
static uint64_t lf_test_post_corrupt;
static int lf_test_signal_sent;
static uint64_t lf_test_corrupt, lf_test_lie, lf_test_result, lf_test_wild_result, lf_test_crash, lf_test_signal,
    lf_test_hang, lf_test_bad_wait, lf_test_flap, lf_test_die, lf_test_die_call;
static int lf_test_selector_allow;
/* The thread that attached the ring (lane 0): the main thread of the image. Later epochs'
 * rings are attached through it. */
static __thread int lf_ring_thread __attribute__((tls_model("initial-exec")));

long lf_raw(long nr, long a1, long a2, long a3, long a4, long a5, long a6);
long lf_fast(long nr, long a1, long a2, long a3, long a4, long a5, long a6);
void lf_entry(void);

/* C ABI (nr, a1..a6) to the syscall ABI, then a tail jump to a page-0 gate. */
#define GATE_CALL(name, gate)                                                                  \
    ".globl " name "\n.type " name ",@function\n" name ":\n"                                  \
    "  mov %rdi, %rax\n  mov %rsi, %rdi\n  mov %rdx, %rsi\n  mov %rcx, %rdx\n"                  \
    "  mov %r8, %r10\n  mov %r9, %r8\n  mov 8(%rsp), %r9\n  mov $" gate ", %r11d\n  jmp *%r11\n"
#define STR2(x) #x
#define STR(x) STR2(x)
__asm__(".text\n" GATE_CALL("lf_raw", STR(GATE_SLOW)) GATE_CALL("lf_fast", STR(LF_GATE_FAST)));

/* lf_fast that also stores the kernel's result, straight from rax, at `*copy` (the 8th C
 * argument). The leader checks its record against this copy before publishing: a fault
 * that changes the result on its way from rax into the record would otherwise hand every
 * follower the same wrong result, which no vote can catch. */
long lf_fast_dup(long nr, long a1, long a2, long a3, long a4, long a5, long a6, long *copy);
__asm__(".text\n"
        ".globl lf_fast_dup\n.type lf_fast_dup,@function\nlf_fast_dup:\n"
        "  push %rbx\n"
        "  mov 24(%rsp), %rbx\n" /* copy (a6 is at 16) */
        "  mov %rdi, %rax\n  mov %rsi, %rdi\n  mov %rdx, %rsi\n  mov %rcx, %rdx\n"
        "  mov %r8, %r10\n  mov %r9, %r8\n  mov 16(%rsp), %r9\n"
        "  mov $" STR(LF_GATE_FAST) ", %r11d\n  call *%r11\n"
        "  mov %rax, (%rbx)\n"
        "  pop %rbx\n"
        "  ret\n");

long lf_dispatch(long nr, long a1, long a2, long a3, long a4, long a5, long a6);

/* The trampoline. Entered by `call *%rax` from a rewritten site, through the page-0 sled
 * (r11 held the jump target; the syscall ABI clobbers r11 and rcx anyway). Skips the red
 * zone below the return address, keeps every register the syscall ABI preserves, and
 * returns the result in rax. */
__asm__(".text\n"
        ".globl lf_entry\n.type lf_entry,@function\nlf_entry:\n"
        "  lea -128(%rsp), %rsp\n"
        "  push %rbp\n  mov %rsp, %rbp\n  and $-16, %rsp\n"
        "  push %rdi\n  push %rsi\n  push %rdx\n  push %r10\n  push %r8\n  push %r9\n"
        "  push %rbx\n  push %r9\n" /* a6 as the 7th C argument, keeps alignment */
        "  mov %r8, %r9\n  mov %r10, %r8\n  mov %rdx, %rcx\n  mov %rsi, %rdx\n"
        "  mov %rdi, %rsi\n  mov %rax, %rdi\n"
        "  call lf_dispatch\n"
        "  add $8, %rsp\n  pop %rbx\n"
        "  pop %r9\n  pop %r8\n  pop %r10\n  pop %rdx\n  pop %rsi\n  pop %rdi\n"
        "  mov %rbp, %rsp\n  pop %rbp\n"
        "  lea 128(%rsp), %rsp\n"
        "  ret\n");

/* --- small tools (no libc: vector registers are the interrupted code's) ------------- */

static inline uint64_t load(const volatile uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline uint32_t load32(const volatile uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void store(volatile uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline void cpu_relax(void) { __asm__ volatile("pause" ::: "memory"); }

static inline void copy_bytes(void *dst, const void *src, uint64_t n)
{
    __asm__ volatile("rep movsb" : "+D"(dst), "+S"(src), "+c"(n) : : "memory");
}

static inline uint32_t crc_u64(uint32_t crc, uint64_t v)
{
    uint64_t c = crc;
    __asm__("crc32q %1, %0" : "+r"(c) : "rm"(v));
    return (uint32_t)c;
}

static inline uint32_t crc_u8(uint32_t crc, uint8_t v)
{
    __asm__("crc32b %1, %0" : "+r"(crc) : "rm"(v));
    return crc;
}

static uint32_t crc_bytes(uint32_t crc, const unsigned char *p, uint64_t n)
{
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t v;
        __builtin_memcpy(&v, p, 8);
        crc = crc_u64(crc, v);
    }
    while (n--)
        crc = crc_u8(crc, *p++);
    return crc;
}

/* A 64-bit digest of a call. Its 8-byte words go round four lanes (word i of a buffer to
 * lane i % 4; single values to lane 0), each a CRC32C (raw state, no inversion) and a
 * multiplicative hash; the value folds the CRC lanes into the high half and the hash lanes
 * into the low half. Four lanes, because each lane is a chain of dependent instructions
 * (a crc32q and a multiply per word, 3 cycles each): one chain ran at 8 bytes per 3
 * cycles, four keep the CPU's units busy (measured: digest_bytes 6-7% of a memcached
 * replica's CPU with one lane). fast_check.rs computes the same value. */
#define DIGEST_LANES 4
#define DIGEST_MIX_SEED 0xcbf29ce484222325ULL
#define DIGEST_MIX_PRIME 0x100000001b3ULL
struct digest {
    uint32_t crc[DIGEST_LANES];
    uint64_t mix[DIGEST_LANES];
};

static void digest_init(struct digest *d)
{
    for (int i = 0; i < DIGEST_LANES; i++) {
        d->crc[i] = ~0u;
        d->mix[i] = DIGEST_MIX_SEED;
    }
}

static inline void digest_lane(uint32_t *crc, uint64_t *mix, uint64_t v)
{
    *crc = crc_u64(*crc, v);
    *mix = (*mix ^ v) * DIGEST_MIX_PRIME;
}

static void digest_word(struct digest *d, uint64_t v) { digest_lane(&d->crc[0], &d->mix[0], v); }

static inline uint64_t word_at(const unsigned char *p)
{
    uint64_t v;
    __builtin_memcpy(&v, p, 8);
    return v;
}

static void digest_bytes(struct digest *d, const unsigned char *p, uint64_t n)
{
    uint32_t c0 = d->crc[0], c1 = d->crc[1], c2 = d->crc[2], c3 = d->crc[3];
    uint64_t m0 = d->mix[0], m1 = d->mix[1], m2 = d->mix[2], m3 = d->mix[3];
    for (; n >= 8 * DIGEST_LANES; p += 8 * DIGEST_LANES, n -= 8 * DIGEST_LANES) {
        digest_lane(&c0, &m0, word_at(p));
        digest_lane(&c1, &m1, word_at(p + 8));
        digest_lane(&c2, &m2, word_at(p + 16));
        digest_lane(&c3, &m3, word_at(p + 24));
    }
    if (n >= 8)
        digest_lane(&c0, &m0, word_at(p)), p += 8, n -= 8;
    if (n >= 8)
        digest_lane(&c1, &m1, word_at(p)), p += 8, n -= 8;
    if (n >= 8)
        digest_lane(&c2, &m2, word_at(p)), p += 8, n -= 8;
    uint64_t tail = 0;
    for (uint64_t i = 0; i < n; i++) {
        c0 = crc_u8(c0, p[i]);
        tail |= (uint64_t)p[i] << (8 * i);
    }
    m0 = (m0 ^ tail ^ (n << 56)) * DIGEST_MIX_PRIME;
    d->crc[0] = c0, d->crc[1] = c1, d->crc[2] = c2, d->crc[3] = c3;
    d->mix[0] = m0, d->mix[1] = m1, d->mix[2] = m2, d->mix[3] = m3;
}

static inline uint32_t rotl32(uint32_t v, int k) { return (v << k) | (v >> (32 - k)); }
static inline uint64_t rotl64(uint64_t v, int k) { return (v << k) | (v >> (64 - k)); }

static uint64_t digest_value(const struct digest *d)
{
    uint32_t crc = d->crc[0] ^ rotl32(d->crc[1], 8) ^ rotl32(d->crc[2], 16) ^ rotl32(d->crc[3], 24);
    uint64_t mix = d->mix[0] ^ rotl64(d->mix[1], 13) ^ rotl64(d->mix[2], 29) ^ rotl64(d->mix[3], 47);
    return ((uint64_t)crc << 32) ^ (mix >> 32) ^ (mix << 32 >> 32);
}

#define FUTEX_WAIT_MS 10 /* the longest futex_wait sleeps before it looks again */

/* Whether the sleep ended in its timeout. Every wait loops on its condition, so a missed
 * wake-up costs FUTEX_WAIT_MS, not a hang; waits count the ones that found their condition
 * met (late_wake), which the monitor reports: a protocol that forgets a wake shows there. */
static long futex_wait_result(volatile uint32_t *word, uint32_t seen)
{
    struct {
        long sec, nsec;
    } timeout = {0, FUTEX_WAIT_MS * 1000 * 1000};
    return lf_raw(SYS_futex, (long)word, FUTEX_WAIT, seen, (long)&timeout, 0, 0);
}

static int futex_wait(volatile uint32_t *word, uint32_t seen) { return futex_wait_result(word, seen) == -ETIMEDOUT; }

static void late_wake(struct lf_state *st) { __atomic_fetch_add(&st->orders[st->me]->h.late_wakes, 1, __ATOMIC_RELAXED); }

/* Milliseconds of CLOCK_MONOTONIC, for patience in waits (from the fast gate: no record,
 * no stop; through the slow gate each read was a ptrace stop, and the work-queue kernel
 * ran twice as long). */
static uint64_t monotonic_ms(void)
{
    struct {
        long sec, nsec;
    } now = {0, 0};
    lf_fast(SYS_clock_gettime, CLOCK_MONOTONIC, (long)&now, 0, 0, 0, 0);
    return (uint64_t)now.sec * 1000 + (uint64_t)now.nsec / 1000000;
}

static void futex_wake(volatile uint32_t *word) { lf_raw(SYS_futex, (long)word, FUTEX_WAKE, 0x7fffffff, 0, 0, 0); }

/* A futex wake of another replica's thread (see the order head's `wakes`). */
static void wake_replica(struct lf_state *st, volatile uint32_t *word)
{
    __atomic_fetch_add(&st->orders[st->me]->h.wakes, 1, __ATOMIC_RELAXED);
    futex_wake(word);
}

/* --- arguments ------------------------------------------------------------------------ */

/* Bytes an output argument receives: `ret` known (after the call), or its bound (before). */
static uint64_t out_len(const struct lf_arg *g, const long *a, long ret, int bound)
{
    switch (g->len_kind) {
    case L_FIXED:
        return g->size;
    case L_ARG:
        return (uint64_t)a[g->len_arg] * g->size;
    default: /* L_RET: bounded by the count argument that follows the buffer */
        if (bound)
            return (uint64_t)a[g->len_arg] * g->size;
        return ret > 0 ? (uint64_t)ret * g->size : 0;
    }
}

static int iov_count(const struct lf_arg *g, const long *a)
{
    long n = a[g->len_arg];
    return n >= 0 && (uint64_t)n <= LF_MAX_IOVECS ? (int)n : -1;
}

/* Argument `i`'s iovecs and their count (-1: not a fast-path argument): an iovec array, or
 * the one a `struct msghdr` to send names, when it has no address and no control data. */
static const struct iovec *iovecs(const struct lf_arg *g, const long *a, int i, int *count)
{
    if (g->kind != A_MSG_IN) {
        *count = iov_count(g, a);
        return (const struct iovec *)a[i];
    }
    const struct msghdr *m = (const struct msghdr *)a[i];
    *count = -1;
    if (m == NULL || m->msg_name != NULL || m->msg_controllen != 0 || m->msg_iovlen > LF_MAX_IOVECS)
        return NULL;
    *count = (int)m->msg_iovlen;
    return m->msg_iov;
}

/* The digest of a call (its number, values and input buffers) and the most bytes its output
 * buffers can take; -1 when the call cannot take the fast path (a NULL_ONLY argument that
 * is not NULL, a NULL buffer of nonzero length, too many iovecs). */
static long inspect(long nr, const struct lf_desc *d, const long *a, uint64_t *digest)
{
    struct digest dg;
    digest_init(&dg);
    uint64_t bound = 0;
    digest_word(&dg, (uint64_t)nr);
    for (int i = 0; i < d->nargs; i++) {
        const struct lf_arg *g = &d->args[i];
        const unsigned char *p = (const unsigned char *)a[i];
        switch (g->kind) {
        case A_VAL:
            digest_word(&dg, (uint64_t)a[i]);
            break;
        case A_NULL_ONLY:
            if (a[i] != 0)
                return -1;
            break;
        case A_IN:
        case A_INOUT: {
            uint64_t n = out_len(g, a, 0, 1);
            if (n > 0 && p == NULL)
                return -1;
            if (n > LF_PAYLOAD_MAX)
                return -1;
            digest_word(&dg, n);
            if (p != NULL)
                digest_bytes(&dg, p, n);
            if (g->kind == A_INOUT && p != NULL)
                bound += n + 8;
            break;
        }
        case A_OUT: {
            uint64_t n = out_len(g, a, 0, 1);
            digest_word(&dg, p != NULL);
            if (p != NULL)
                bound += n + 8;
            break;
        }
        case A_IOV_IN:
        case A_IOV_OUT:
        case A_MSG_IN: {
            int count;
            const struct iovec *iov = iovecs(g, a, i, &count);
            if (count < 0 || (count > 0 && iov == NULL))
                return -1;
            uint64_t total = 0;
            for (int k = 0; k < count; k++) {
                digest_word(&dg, iov[k].iov_len);
                if (g->kind != A_IOV_OUT) {
                    if (iov[k].iov_len > LF_PAYLOAD_MAX || (iov[k].iov_len > 0 && iov[k].iov_base == NULL))
                        return -1;
                    digest_bytes(&dg, iov[k].iov_base, iov[k].iov_len);
                }
                total += iov[k].iov_len;
            }
            if (g->kind == A_IOV_OUT)
                bound += total + 8;
            break;
        }
        default:
            break;
        }
        if (bound > LF_PAYLOAD_MAX)
            bound = LF_PAYLOAD_MAX + 1; /* too big for a record: the monitor's job */
    }
    *digest = digest_value(&dg);
    return (long)bound;
}

/* The leader's output buffers into the record's payload: [u64 length][bytes] per buffer. */
static uint32_t pack(const struct lf_desc *d, const long *a, long ret, unsigned char *payload)
{
    unsigned char *p = payload;
    for (int i = 0; i < d->nargs; i++) {
        const struct lf_arg *g = &d->args[i];
        if ((g->kind == A_OUT || g->kind == A_INOUT) && a[i] != 0) {
            uint64_t n = g->kind == A_INOUT ? out_len(g, a, ret, 1) : out_len(g, a, ret, 0);
            copy_bytes(p, &n, 8);
            copy_bytes(p + 8, (const void *)a[i], n);
            p += 8 + n;
        } else if (g->kind == A_IOV_OUT) {
            const struct iovec *iov = (const struct iovec *)a[i];
            uint64_t n = ret > 0 ? (uint64_t)ret : 0, left = n;
            copy_bytes(p, &n, 8);
            p += 8;
            for (int k = 0; k < iov_count(g, a) && left > 0; k++) {
                uint64_t take = iov[k].iov_len < left ? iov[k].iov_len : left;
                copy_bytes(p, iov[k].iov_base, take);
                p += take;
                left -= take;
            }
        }
    }
    return (uint32_t)(p - payload);
}

static int same_bytes(const unsigned char *x, const volatile unsigned char *y, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        if (x[i] != y[i])
            return 0;
    return 1;
}

/* Whether a record's result and payload match their sources read again: `ret` as the gate
 * stored it, the argument pointers loaded afresh, the buffers the kernel wrote. Between
 * the kernel's return and the publication only the leader holds the truth; a single fault
 * there (a register on its way into the record) shows up as a difference here. */
static int plausible_result(long nr, const struct lf_desc *d, const volatile long *a, long ret);

static int record_matches(const struct lf_record *rec, const struct lf_desc *d, const volatile long *a, long ret)
{
    if (rec->ret != ret || (d != NULL && rec->kind == KIND_RESULT && !plausible_result(rec->nr, d, a, ret)))
        return 0;
    const unsigned char *p = rec->payload, *end = rec->payload + rec->len;
    if (d == NULL || ret < 0)
        return rec->len == 0;
    long args[6];
    for (int i = 0; i < 6; i++)
        args[i] = a[i];
    for (int i = 0; i < d->nargs; i++) {
        const struct lf_arg *g = &d->args[i];
        if ((g->kind == A_OUT || g->kind == A_INOUT) && args[i] != 0) {
            uint64_t n = g->kind == A_INOUT ? out_len(g, args, ret, 1) : out_len(g, args, ret, 0);
            if ((uint64_t)(end - p) < 8 + n || !same_bytes(p, (const volatile unsigned char *)&n, 8) ||
                !same_bytes(p + 8, (const volatile unsigned char *)args[i], n))
                return 0;
            p += 8 + n;
        } else if (g->kind == A_IOV_OUT) {
            const volatile struct iovec *iov = (const volatile struct iovec *)args[i];
            uint64_t n = ret > 0 ? (uint64_t)ret : 0, left = n;
            if ((uint64_t)(end - p) < 8 + n || !same_bytes(p, (const volatile unsigned char *)&n, 8))
                return 0;
            p += 8;
            for (int k = 0; k < iov_count(g, args) && left > 0; k++) {
                uint64_t take = iov[k].iov_len < left ? iov[k].iov_len : left;
                if (!same_bytes(p, (const volatile unsigned char *)iov[k].iov_base, take))
                    return 0;
                p += take;
                left -= take;
            }
        }
    }
    return p == end;
}

/* Whether `ret` can be what call `nr` returned: an errno, or at most the count it asked for
 * (bytes, events, descriptors; fstat's 0). A bit flipped in the result register before any
 * copy of it is taken is out of that range unless it is one of the low bits. */
static int plausible_result(long nr, const struct lf_desc *d, const volatile long *a, long ret)
{
    if (ret < 0)
        return ret >= -133; /* EHWPOISON is the highest errno */
    if (nr == SYS_fstat)
        return ret == 0;
    if (nr == SYS_poll || nr == SYS_getrandom)
        return (unsigned long)ret <= (unsigned long)a[1];
    for (int i = 0; i < d->nargs; i++) {
        const struct lf_arg *g = &d->args[i];
        if (g->kind == A_IOV_IN || g->kind == A_IOV_OUT || g->kind == A_MSG_IN) {
            long args[6];
            for (int k = 0; k < 6; k++)
                args[k] = a[k];
            int count;
            const volatile struct iovec *iov = iovecs(g, args, i, &count);
            uint64_t total = 0;
            for (long k = 0; k < count && iov != NULL; k++)
                total += iov[k].iov_len;
            return (uint64_t)ret <= total;
        }
        if ((g->kind == A_IN || g->kind == A_OUT) && g->len_kind != L_FIXED)
            return (unsigned long)ret <= (unsigned long)a[g->len_arg];
    }
    return 1;
}

/* The record's payload into a follower's own buffers; 0 when it does not fit them. */
static int unpack(const struct lf_desc *d, const long *a, const unsigned char *payload, uint32_t len)
{
    const unsigned char *p = payload, *end = payload + len;
    for (int i = 0; i < d->nargs; i++) {
        const struct lf_arg *g = &d->args[i];
        int plain = (g->kind == A_OUT || g->kind == A_INOUT) && a[i] != 0;
        if (!plain && g->kind != A_IOV_OUT)
            continue;
        uint64_t n;
        if (end - p < 8)
            return 0;
        copy_bytes(&n, p, 8);
        p += 8;
        if (n > (uint64_t)(end - p))
            return 0;
        if (plain) {
            if (n > out_len(g, a, 0, 1))
                return 0;
            copy_bytes((void *)a[i], p, n);
            p += n;
            continue;
        }
        const struct iovec *iov = (const struct iovec *)a[i];
        uint64_t left = n;
        for (int k = 0; k < iov_count(g, a) && left > 0; k++) {
            uint64_t take = iov[k].iov_len < left ? iov[k].iov_len : left;
            copy_bytes(iov[k].iov_base, p, take);
            p += take;
            left -= take;
        }
        if (left > 0)
            return 0;
    }
    return p == end;
}

/* The CRC32C of a record as published with sequence number `s`. */
static uint32_t record_crc(const struct lf_record *r, uint64_t s)
{
    uint32_t crc = crc_bytes(~0u, (const unsigned char *)r + 8, offsetof(struct lf_record, crc) - 8);
    crc = crc_bytes(crc, (const unsigned char *)r->clock_sync, LF_RECORD_HEAD - offsetof(struct lf_record, clock_sync));
    crc = crc_u64(crc, s);
    return crc_bytes(crc, r->payload, r->len);
}

/* --- waiting ---------------------------------------------------------------------------- */

/* MOVED: the leader waited on was replaced in place; the record comes from the new one. */
enum { READY = 1, NOT_YET = 0, GIVE_UP_OFF = -1, GIVE_UP_SLOW = -2, CORRUPT = -3, MOVED = 2 };

/* A wait's answer is one of the five above; anything else is this replica's own state
 * gone wrong (a fault in the shim's code or registers, seen in campaigns: a follower that
 * took it for "give up" skipped a record, and every later turn of its replica waited). */
static int checked_answer(int r)
{
    return r == READY || r == NOT_YET || r == GIVE_UP_OFF || r == GIVE_UP_SLOW || r == MOVED ? r : CORRUPT;
}

struct wait_for {
    struct lf_state *st;
    uint32_t who;    /* the replica waited on */
    uint64_t target; /* the sequence number waited for */
    uint64_t take;   /* take_known: the lane's mutex take whose record it looks for */
};

typedef int (*ready_fn)(const struct wait_for *);

/* What a sleeper's `sleeping` word says: whom it wants to be woken by. A leader waiting
 * for votes is not woken by each record a follower consumes meanwhile (on a shared CPU
 * each such wake-up is a pair of context switches for nothing). */
enum { AWAKE = 0, WAKE_ON_ANY = 1, WAKE_ON_VOTE = 2, WAKE_ON_COMMIT = 3 };

/* Spinning threads per process: one at a time. With a lane per thread, a server's idle
 * threads (an event loop each, waiting for the leader's next record while it blocks in
 * the kernel) would otherwise spin side by side and take the CPUs from the ones at work. */
static int lf_spinner;

/* How long a lane spins adapts to how its waits end: one that ended while spinning keeps
 * (or doubles) the budget, one that had to sleep halves it, down to a floor that still
 * catches a record that comes within a few microseconds. */
#define SPIN_FLOOR 256
#ifndef LF_MAX_SPINNERS
#define LF_MAX_SPINNERS 1
#endif

/* How much the process's ring calls come from more than one lane lately: up on each call
 * from another lane than the last one, down on each call from the same. Several busy
 * threads (a thread pool) share the CPUs with the monitor and the other replicas: there,
 * a spinning waiter takes a CPU from a thread with work (measured: memcached with four
 * workers served three times as many requests without spinning), while one busy thread
 * (an event loop) gains from it. */
static uint32_t lf_lane_mix, lf_last_lane;
#define LANE_MIX_MAX 512
#define LANE_MIX_STEP 64

static void note_lane(uint32_t lane)
{
    uint32_t mix = __atomic_load_n(&lf_lane_mix, __ATOMIC_RELAXED);
    if (__atomic_exchange_n(&lf_last_lane, lane, __ATOMIC_RELAXED) != lane)
        mix = mix + LANE_MIX_STEP > LANE_MIX_MAX ? LANE_MIX_MAX : mix + LANE_MIX_STEP;
    else if (mix > 0)
        mix--;
    __atomic_store_n(&lf_lane_mix, mix, __ATOMIC_RELAXED);
}

/* Whether a waiting thread may spin at all: spinning is on, and few lanes are busy. */
static int may_spin(const struct lf_state *st)
{
    return st->spin != 0 && __atomic_load_n(&lf_lane_mix, __ATOMIC_RELAXED) < LANE_MIX_STEP;
}

static int published(const struct wait_for *w);
static int take_known(const struct wait_for *w);

/* Whether the replica waited on stands in a call that waits for the outside world (a
 * client, a timer): its next record is as far away as the next request, and a spin
 * would only take a CPU from the work that brings it (measured: redis -r 2 on two CPUs,
 * a third of all CPU time in a follower's spin for the leader's epoll_wait). */
static int waits_outside(const struct wait_for *w)
{
    return __atomic_load_n(&w->st->regions[w->who]->h.waiting_outside, __ATOMIC_RELAXED) != 0;
}

static int spin_for(const struct wait_for *w, ready_fn ready)
{
    struct lf_state *st = w->st;
    if (!may_spin(st) || (ready == published && waits_outside(w)))
        return NOT_YET;
    if (__atomic_fetch_add(&lf_spinner, 1, __ATOMIC_ACQUIRE) >= LF_MAX_SPINNERS) {
        __atomic_fetch_sub(&lf_spinner, 1, __ATOMIC_RELEASE);
        return NOT_YET;
    }
    uint32_t budget = st->spin_budget < SPIN_FLOOR ? SPIN_FLOOR : st->spin_budget;
    if (budget > st->spin)
        budget = st->spin;
    /* A follower that caught up with its leader sleeps soon: the leader wakes it for a
     * batch of records (wake_followers), and a long spin for each record took a whole
     * CPU (measured: redis -r 2, a third of all CPU time). */
    int for_record = ready == published || ready == take_known;
    if (for_record && budget > SPIN_FLOOR)
        budget = SPIN_FLOOR;
    int r = NOT_YET;
    int outside = 0;
    for (uint32_t i = 0; i < budget && r == NOT_YET; i++) {
        r = ready(w);
        if (r == NOT_YET && ready == published && (outside = waits_outside(w)) != 0)
            break;
        if (r == NOT_YET)
            cpu_relax();
    }
    __atomic_fetch_sub(&lf_spinner, 1, __ATOMIC_RELEASE);
    if (!outside) /* a wait for the outside world says nothing of how long records take */
        st->spin_budget = r != NOT_YET ? budget * 2 : budget / 2;
    return r;
}

/* Spins (see spin_for), then sleeps on `word` (in the other replica's region) with a
 * timeout, so that a lost wake-up costs only latency and `off` is always seen. */
static int wait_until(ready_fn ready, const struct wait_for *w, volatile uint32_t *word, uint32_t wake_on)
{
    struct lf_state *st = w->st;
    int spun = checked_answer(spin_for(w, ready));
    if (spun != NOT_YET)
        return spun;
    volatile uint32_t *sleeping = &st->regions[st->me]->h.sleeping;
    for (;;) {
        uint32_t seen = load32(word);
        __atomic_exchange_n(sleeping, wake_on, __ATOMIC_SEQ_CST);
        int r = checked_answer(ready(w));
        int timed_out = r == NOT_YET && futex_wait(word, seen);
        __atomic_store_n(sleeping, AWAKE, __ATOMIC_RELEASE);
        if (r != NOT_YET)
            return r;
        if (timed_out && ready(w) == READY)
            late_wake(st);
    }
}

/* Bumps a futex word of our own region and wakes `other` if it sleeps waiting for this
 * kind of progress (`vote`: a vote, or news that the leader must not wait for one). */
static void signal_progress(struct lf_state *st, volatile uint32_t *word, uint32_t other, int vote)
{
    __atomic_fetch_add(word, 1, __ATOMIC_SEQ_CST);
    uint32_t wake_on = load32(&st->regions[other]->h.sleeping);
    if (wake_on == WAKE_ON_ANY || (vote && wake_on == WAKE_ON_VOTE))
        wake_replica(st, word);
}

static void wake_sleeping_followers(struct lf_state *st)
{
    for (uint32_t r = 0; r < st->replicas; r++)
        if (r != st->me && load32(&st->regions[r]->h.sleeping)) {
            wake_replica(st, &st->regions[st->me]->h.published_word);
            return;
        }
}

static void flush_wakes(struct lf_state *st)
{
    st->posted_unwoken = 0;
    if (st->wake_pending) {
        st->wake_pending = 0;
        wake_sleeping_followers(st);
    }
}

/* The leader published. It does not wake a sleeping follower for each record: one that
 * shares its CPU would preempt it for one record and sleep again, and one on a CPU of its
 * own would sleep and be woken (a futex call on each side) once per record. It wakes
 * followers when it is about to wait for them, to block, or to meet the monitor
 * (flush_wakes), and after WAKE_BATCH records on a CPU of its own, so that they catch up
 * before the leader runs out of slots; a wake-up missed otherwise costs at most the
 * sleep's timeout. */
#define WAKE_BATCH (LF_SLOTS / 2)
static void wake_followers(struct lf_state *st)
{
    __atomic_fetch_add(&st->regions[st->me]->h.published_word, 1, __ATOMIC_SEQ_CST);
    /* Except where several threads take turns (a thread pool, see may_spin): there a
     * follower's thread that sleeps through its lane's records holds up its siblings'
     * turns in the order (measured: memcached -t 4, half the throughput). */
    if (st->spin != 0 && !may_spin(st)) {
        wake_sleeping_followers(st);
        return;
    }
    if (++st->wake_pending >= WAKE_BATCH && st->spin != 0)
        flush_wakes(st);
}

static int is_off(const struct lf_state *st) { return __atomic_load_n(&st->hdr->off, __ATOMIC_SEQ_CST) != 0; }

/* A follower that is in a call the monitor handles cannot take part until the leader gets
 * there too. A follower still on its way out of a call the leader made too (the monitor
 * released them both) is not: it has made no more such calls than the leader. */
static int follower_in_slow_call(const struct wait_for *w)
{
    const struct lf_region_head *f = &w->st->regions[w->who]->h;
    return load(&f->slow_seq) != 0 && load(&f->slow_calls) > w->st->regions[w->st->me]->h.slow_calls;
}

/* Whether replica region `r` was removed from the ring (see the header's `lost`). */
static int region_lost(const struct lf_state *st, uint32_t r) { return (load32(&st->hdr->lost) >> r) & 1; }

/* Where a leader waiting for follower `w->who` stands, once the follower has or has not
 * `reached` what the leader waits for (a removed follower counts as there). */
static int follower_state(const struct wait_for *w, int reached)
{
    if (reached || region_lost(w->st, w->who))
        return READY;
    if (is_off(w->st))
        return GIVE_UP_OFF;
    return follower_in_slow_call(w) ? GIVE_UP_SLOW : NOT_YET;
}

static int slot_free(const struct wait_for *w)
{
    return follower_state(w, load(&w->st->regions[w->who]->h.consumed) + LF_SLOTS >= w->target);
}

static int voted(const struct wait_for *w)
{
    const struct lf_region_head *f = &w->st->regions[w->who]->h;
    if (load(&f->vote_seq) >= w->target || region_lost(w->st, w->who))
        return READY;
    /* The follower waits for our record of this call without having voted on it: it is at
     * another call than this output. Neither would move; the monitor compares them. */
    if (load(&f->awaiting) == w->target && load(&f->vote_seq) < w->target)
        return GIVE_UP_SLOW;
    return follower_state(w, 0);
}

/* A follower gives up on a record only where the leader does too, so that every replica
 * of the lane meets the monitor at the same call: once the ring is off, a call the leader
 * had already entered (it marks `in_flight` before it looks at `off` a last time) is still
 * published, unless the monitor removed the leader (`leader_lost`). */
static int published(const struct wait_for *w)
{
    const struct lf_region_head *l = &w->st->regions[w->who]->h;
    if (load(&l->published) >= w->target)
        return READY;
    if (__atomic_load_n(&w->st->hdr->leader, __ATOMIC_SEQ_CST) != w->who)
        return MOVED; /* it never will: a follower took its place (see "a new leader in place") */
    if (!is_off(w->st))
        return NOT_YET;
    if (!__atomic_load_n(&w->st->hdr->leader_lost, __ATOMIC_SEQ_CST) &&
        __atomic_load_n(&l->in_flight, __ATOMIC_SEQ_CST) >= w->target)
        return NOT_YET;
    return load(&l->published) >= w->target ? READY : GIVE_UP_OFF;
}

/* Waits for every follower; the first reason to give up, or READY. Wakes the followers
 * it owes a wake-up (wake_followers) only when it has to wait: a leader whose followers
 * are where it needs them does not wake them for each record (measured: memcached -t 1
 * under -r 2, 6.6 futex wakes per request before, when this woke them every record). */
static int wait_followers(struct lf_state *st, ready_fn ready, uint64_t target)
{
    uint32_t wake_on = ready == voted ? WAKE_ON_VOTE : WAKE_ON_ANY;
    for (uint32_t r = 0; r < st->replicas; r++) {
        if (r == st->me || region_lost(st, r))
            continue;
        struct wait_for w = {st, r, target, 0};
        int got = checked_answer(ready(&w));
        if (got == NOT_YET) {
            flush_wakes(st);
            got = wait_until(ready, &w, &st->regions[r]->h.progress, wake_on);
        }
        if (got != READY)
            return got;
    }
    return READY;
}

/* --- the order of events across lanes (see struct lf_order) ---------------------------- */

static struct lf_state *lane_state(struct lf_state *lanes, uint32_t lane);

/* When a follower's thread takes its record out of turn anyway: the thread whose turn it is
 * still waits in a futex call after one of futex_wait's 10 ms sleeps (a lock the program
 * took without a record, such as stdio's, is held here by a thread that came first in this
 * replica only; a lock the order hands on is free within microseconds), or nothing moved
 * for ORDER_PATIENCE such sleeps. Either is counted. */
#define ORDER_PATIENCE 20

/* How long a follower's thread spins for its turn before it sleeps (when it may_spin). */
#define TURN_SPIN (SPIN_FLOOR * 4)

/* The leader: the next index of its order for record `s` of this lane. Waits while the
 * slowest follower is ORDER_SLOTS behind (only a follower whose threads took turns out of
 * order can be: each lane is at most SLOTS records ahead). */
static uint64_t claim_turn(struct lf_state *st, uint64_t s)
{
    struct lf_order *o = st->orders[st->me];
    uint64_t idx = __atomic_fetch_add(&o->h.claimed, 1, __ATOMIC_SEQ_CST);
    for (uint32_t r = 0; r < st->replicas; r++) {
        if (r == st->me)
            continue;
        volatile struct lf_order_head *f = &st->orders[r]->h;
        while (idx >= load(&f->consumed) + LF_ORDER_SLOTS && !is_off(st) && !region_lost(st, r))
            futex_wait(&f->turn_word, load32(&f->turn_word));
    }
    struct lf_order_entry *e = &o->entries[idx % LF_ORDER_SLOTS];
    store(&e->what, ((uint64_t)st->lane << ORDER_LANE_SHIFT) | s);
    store(&e->index, idx + 1);
    return idx;
}

/* Progress on a futex word of this replica's order head: bumped, and its sleepers (counted
 * in `sleepers`, see wait_for_turn) woken. */
static void bump_and_wake(volatile uint32_t *word, volatile uint32_t *sleepers)
{
    __atomic_fetch_add(word, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(sleepers, __ATOMIC_SEQ_CST) != 0)
        futex_wake(word);
}

/* A follower: index `idx` is done here; `consumed` moves over every index done in a row. */
static void turn_done(struct lf_state *st, uint64_t idx)
{
    struct lf_order *o = st->orders[st->me];
    __atomic_store_n(&o->done[idx % LF_ORDER_SLOTS], idx + 1, __ATOMIC_SEQ_CST);
    uint64_t c = __atomic_load_n(&o->h.consumed, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&o->done[c % LF_ORDER_SLOTS], __ATOMIC_SEQ_CST) == c + 1)
        if (__atomic_compare_exchange_n(&o->h.consumed, &c, c + 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            c++;
    bump_and_wake(&o->h.turn_word, &o->h.sleepers);
}

/* --- the serial order (SYNC_ORDER_SERIAL, `--sync-order serial`) -----------------------
 * Each replica runs its threads' code one at a time, switching only at events, so that
 * what a thread reads between two events, even another thread's data without a lock (a
 * race), is what it read in the leader (Kendo and DMP serialise the same way).
 * The leader's threads take turns with a token, a ticket lock in its order head: a thread
 * holds it while it runs the program's code, gives it up before anything that can block
 * (a call's entry into the kernel, a call through the monitor, a futex wait or
 * sched_yield of its own, a native lock, condition, semaphore, barrier or once wait), and
 * takes it again before it claims its next place; so the order's places follow the
 * token's segments one after the other. A call after which the thread claims no place of
 * its own (through the monitor, a futex wait, sched_yield) is followed by a RESUME record
 * in every replica, and so is a new thread's start. A follower's thread holds the place
 * of its last record until it reaches its next event, blocks or exits: no other thread of
 * its replica runs meanwhile, so it replays the leader's segment whole. A leader's thread
 * that published SERIAL_QUANTUM events in one turn passes the token to a waiting thread
 * (a trylock loop would otherwise never let the lock's holder run). The limit: a thread
 * that spins on memory without any event (a spinlock, a flag) keeps the token for ever. */
#define SERIAL_QUANTUM 16

static int serial_order(const struct lf_state *st)
{
    return st != NULL && st->hdr != NULL && load32(&st->hdr->sync_order) == SYNC_ORDER_SERIAL;
}

static void token_give(struct lf_state *st)
{
    volatile struct lf_order_head *h = &st->orders[st->me]->h;
    st->serial_token = 0;
    uint32_t serving = __atomic_add_fetch(&h->token_serving, 1, __ATOMIC_SEQ_CST);
    if (load32(&h->token_next) != serving)
        futex_wake(&h->token_serving);
}

static void token_take(struct lf_state *st)
{
    volatile struct lf_order_head *h = &st->orders[st->me]->h;
    uint32_t ticket = __atomic_fetch_add(&h->token_next, 1, __ATOMIC_SEQ_CST);
    for (uint32_t now; (now = load32(&h->token_serving)) != ticket;)
        futex_wait(&h->token_serving, now);
    st->serial_token = 1;
    st->serial_events = 0;
}

/* Gives up what the thread holds in the serial order: the token, or its place. */
static void serial_leave(struct lf_state *st)
{
    if (st == NULL)
        return;
    if (st->serial_token)
        token_give(st);
    if (st->serial_place != 0) {
        uint64_t idx = st->serial_place - 1;
        st->serial_place = 0;
        turn_done(st, idx);
    }
}

/* The leader's thread before it claims a place: it holds the token, after a turn of
 * another thread's if it had its quantum and one waits. */
static void serial_claim(struct lf_state *st)
{
    if (!serial_order(st))
        return;
    if (st->serial_token && ++st->serial_events >= SERIAL_QUANTUM) {
        volatile struct lf_order_head *h = &st->orders[st->me]->h;
        if (load32(&h->token_next) != load32(&h->token_serving) + 1)
            token_give(st);
        else
            st->serial_events = 0;
    }
    if (!st->serial_token)
        token_take(st);
}

/* Whether the thread whose turn it is in this replica (the leader's entry at `consumed`)
 * waits in a futex call (a turn_wait's holder_blocked; the order of every event has no
 * slot). */
static int turn_holder_blocked(struct lf_state *st, uint64_t unused_slot, uint64_t consumed)
{
    (void)unused_slot;
    uint32_t former = load32(&st->hdr->former), owner = st->leader;
    if (former != 0 && former - 1 < st->replicas && consumed < load(&st->orders[owner]->h.first_claim))
        owner = former - 1; /* an index of the order before a new leader's (see record_source) */
    const struct lf_order_entry *e = &st->orders[owner]->entries[consumed % LF_ORDER_SLOTS];
    if (load(&e->index) != consumed + 1 || lf_lanes == NULL)
        return 0;
    uint64_t lane = load(&e->what) >> ORDER_LANE_SHIFT;
    if (lane >= LF_LANES || lane == st->lane)
        return 0;
    return load(&lane_state(lf_lanes, (uint32_t)lane)->regions[st->me]->h.in_futex) != 0;
}

/* A follower's thread's wait for its place: until `*count` reaches `target` (every earlier
 * place or ticket done in this replica), sleeping on `word` (bumped with `sleepers`
 * counted, as turn_done and take_object_turn do). It takes its place out of turn, counted,
 * when nothing moved for ORDER_PATIENCE sleeps' time, or for one when `holder_blocked`
 * says the thread whose place comes next waits in a futex call (see ORDER_PATIENCE). */
struct turn_wait {
    volatile uint64_t *count;
    uint64_t target;
    volatile uint32_t *word, *sleepers;
    int (*holder_blocked)(struct lf_state *, uint64_t slot, uint64_t count);
    uint64_t slot; /* for holder_blocked: the object's slot */
};

static void wait_for_turn(struct lf_state *st, const struct turn_wait *t)
{
    uint64_t c = load(t->count);
    if (c >= t->target)
        return;
    uint32_t budget = may_spin(st) ? TURN_SPIN : 0;
    /* In the serial order the thread whose turn it is may compute for long: no patience. */
    int serial = serial_order(st);
    for (uint32_t i = 0; i < budget && (c = load(t->count)) < t->target; i++)
        cpu_relax();
    /* Patience is time since the count last moved, not wake-ups: the object order's word
     * is bumped by every object's progress. One clock read per sleep. */
    uint64_t moved_at = 0, last = c;
    while (c < t->target) {
        if (is_off(st))
            return;
        uint64_t now_ms = monotonic_ms();
        if (moved_at == 0 || c != last)
            moved_at = now_ms, last = c;
        uint64_t still_ms = now_ms - moved_at;
        if (!serial && (still_ms >= ORDER_PATIENCE * FUTEX_WAIT_MS ||
                        (still_ms >= FUTEX_WAIT_MS && t->holder_blocked(st, t->slot, c)))) {
            __atomic_fetch_add(&st->orders[st->me]->h.skipped, 1, __ATOMIC_RELAXED);
            return;
        }
        uint32_t seen = load32(t->word);
        __atomic_fetch_add(t->sleepers, 1, __ATOMIC_SEQ_CST);
        int timed_out = load(t->count) == c && futex_wait(t->word, seen);
        __atomic_fetch_sub(t->sleepers, 1, __ATOMIC_SEQ_CST);
        c = load(t->count);
        if (timed_out && c >= t->target)
            late_wake(st);
    }
}

/* A follower's thread before it takes the record at index `idx` of the leader's order:
 * waits until every earlier index is done in this replica, then marks it done; or holds
 * it (`hold`: until the operation that takes something has run natively, see
 * take_done; in the serial order: until its next event). */
static void take_turn(struct lf_state *st, uint64_t idx, int hold)
{
    struct lf_order *o = st->orders[st->me];
    struct turn_wait t = {&o->h.consumed, idx, &o->h.turn_word, &o->h.sleepers, turn_holder_blocked, 0};
    serial_leave(st);
    wait_for_turn(st, &t);
    if (serial_order(st) || hold)
        st->serial_place = idx + 1;
    else
        turn_done(st, idx);
}

/* The leader: the next ticket of the object at `addr` for record `s` of this lane, or (the
 * object table crowded around its slot) the next index of the order of every event. */
static uint64_t claim_object_turn(struct lf_state *st, uint64_t s, uint64_t addr)
{
    struct lf_order *o = st->orders[st->me];
    uint64_t home = (addr * 0x9E3779B97F4A7C15ULL) >> 40;
    for (uint32_t probe = 0; probe < OBJECT_PROBES; probe++) {
        uint64_t slot = (home + probe) % LF_OBJECTS;
        struct lf_object *ob = &o->objects[slot];
        uint64_t owner = load(&ob->addr);
        if (owner == 0 &&
            __atomic_compare_exchange_n(&ob->addr, &owner, addr, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            owner = addr;
        if (owner != addr)
            continue;
        uint64_t ticket = __atomic_fetch_add(&ob->count, 1, __ATOMIC_SEQ_CST);
        return ORDER_OBJECT | slot << ORDER_SLOT_SHIFT | (ticket & ORDER_TICKET_MASK);
    }
    return claim_turn(st, s);
}

/* Whether the thread that holds ticket `ticket` of object `slot` in the leader's records
 * (a record a follower's sibling has yet to take) waits in a futex call here. */
static int object_holder_blocked(struct lf_state *st, uint64_t slot, uint64_t ticket)
{
    uint64_t wanted = ORDER_OBJECT | slot << ORDER_SLOT_SHIFT | ticket;
    if (lf_lanes == NULL)
        return 0;
    for (uint32_t lane = 0; lane < LF_LANES; lane++) {
        if (lane == st->lane)
            continue;
        struct lf_state *other = lane_state(lf_lanes, lane);
        if (other->hdr == NULL)
            continue;
        const struct lf_region *leader = other->regions[st->leader];
        for (uint32_t i = 0; i < LF_SLOTS; i++)
            if (load(&leader->records[i].order) == wanted)
                return load(&other->regions[st->me]->h.in_futex) != 0;
    }
    return 0;
}

/* A follower's thread before it takes a record with ticket `order` of an object: waits
 * until the object's earlier tickets are done in this replica (or, as in take_turn, the
 * thread that holds the next one waits in a futex call, or nothing moved for
 * ORDER_PATIENCE sleeps), then marks its own done. */
static void take_object_turn(struct lf_state *st, uint64_t order)
{
    struct lf_order *o = st->orders[st->me];
    uint64_t slot = (order >> ORDER_SLOT_SHIFT) % LF_OBJECTS;
    uint64_t ticket = order & ORDER_TICKET_MASK;
    uint64_t *count = &o->objects[slot].count;
    struct turn_wait t = {count, ticket, &o->h.object_word, &o->h.object_sleepers, object_holder_blocked, slot};
    wait_for_turn(st, &t);
    /* Tickets done in a row; one taken out of turn moves the count past the skipped ones. */
    uint64_t c = load(count);
    while (c < ticket + 1 && !__atomic_compare_exchange_n(count, &c, ticket + 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        ;
    bump_and_wake(&o->h.object_word, &o->h.object_sleepers);
}

/* A follower: the record's place, in the order of every event or in its object's. */
static void take_place(struct lf_state *st, uint64_t order, int hold)
{
    if (order & ORDER_OBJECT)
        take_object_turn(st, order);
    else
        take_turn(st, order, hold);
}

/* --- a new leader in place ---------------------------------------------------------------
 * A leader that fails is replaced by a follower without switching the ring off (the
 * monitor's `promote`; ring off, a threaded program's survivors would run unordered). The monitor stops the old leader's threads, writes into the new leader's
 * region of each lane the `cut` (the old leader's last published record there), sets the
 * new leader's first index to the old one's next (`first_claim`), marks the indices the
 * old leader claimed but never published done in every survivor, and names the old leader
 * `former` before it names the new one `leader`. Records up to a lane's cut are then read
 * from the former leader's region, later ones from the new leader's, whose threads lead
 * from there on: each once every earlier index of the order is done in its own replica
 * (else a native lock of its could come before one of the old order's there; a
 * follower's operation that takes something holds its index until it has, see takes). A
 * follower's thread waiting for a record past the cut gets MOVED and looks again;
 * one in the new leader returns to its wrapper as the leader (SYNC_PROMOTED). Only the
 * order of every event is kept across a failover (not the object or serial orders). */

/* The region that holds record `s` of this lane (the leader's, or the former leader's up
 * to the cut); notes the leader in `st->leader` for the followers' wake-ups. The header's
 * `former` is written before its `leader`: a new leader read here comes with its former. */
static uint32_t record_source(struct lf_state *st, uint64_t s)
{
    uint32_t leader = __atomic_load_n(&st->hdr->leader, __ATOMIC_SEQ_CST);
    uint32_t former = __atomic_load_n(&st->hdr->former, __ATOMIC_SEQ_CST);
    st->leader = leader;
    if (former != 0 && former - 1 != leader && former - 1 < st->replicas && s <= load(&st->regions[leader]->h.cut))
        return former - 1;
    return leader;
}

/* A lane of a leader promoted in place, before it leads for the first time: every index
 * of the former leader's order done in this replica, and the last signal request the
 * former leader took is this one's too (the monitor copied it; 0: it took none). */
static void settle_promotion(struct lf_state *st)
{
    if (st->promoted || __atomic_load_n(&st->hdr->former, __ATOMIC_SEQ_CST) == 0)
        return;
    struct lf_order *o = st->orders[st->me];
    uint64_t first = load(&o->h.first_claim);
    for (uint64_t c; (c = load(&o->h.consumed)) < first && !is_off(st);) {
        uint32_t seen = load32(&o->h.turn_word);
        __atomic_fetch_add(&o->h.sleepers, 1, __ATOMIC_SEQ_CST);
        if (load(&o->h.consumed) == c)
            futex_wait(&o->h.turn_word, seen);
        __atomic_fetch_sub(&o->h.sleepers, 1, __ATOMIC_SEQ_CST);
    }
    uint64_t taken = load(&st->regions[st->me]->h.signal_seen);
    if (taken != 0)
        st->signal_seen = (uint32_t)taken;
    st->promoted = 1;
}

/* record_source, with this lane made ready to lead when the record is its replica's own. */
static uint32_t source_to_take(struct lf_state *st, uint64_t s)
{
    uint32_t src = record_source(st, s);
    if (src == st->me)
        settle_promotion(st);
    return src;
}

/* --- clocks ---------------------------------------------------------------------------- */

/* The i-th read of a clock returns the i-th value in every replica, produced by whichever
 * replica got there first (as the monitor's clock.rs does). */
/* The i-th value of `clock` into `out`; -1 when the kernel does not give one (the call
 * then goes to the monitor in every replica alike). */
static int clock_value(struct lf_state *st, int clock, struct lf_time *out)
{
    struct lf_clock *c = &st->clocks[clock];
    uint64_t i = st->clock_next[clock]++;
    if (load(&c->produced) <= i) {
        /* Produce under the clock's lock; a holder that died leaves it after a long spin. */
        for (uint64_t spins = 0; __atomic_exchange_n(&c->lock, 1, __ATOMIC_ACQUIRE); spins++) {
            if (spins > (1u << 26))
                break;
            cpu_relax();
        }
        uint64_t p = load(&c->produced);
        for (int attempts = 0; p <= i; attempts++) {
            /* Every replica takes this value: it goes out only as the kernel gave it (a
             * fault in the copy, or a read that wrote elsewhere, is read or copied again). */
            struct lf_time t = {0, -1};
            struct lf_time *slot = &c->values[p % LF_CLOCK_RING];
            if (attempts == 3) {
                __atomic_store_n(&c->lock, 0, __ATOMIC_RELEASE);
                return -1;
            }
            if (lf_fast(SYS_clock_gettime, clock, (long)&t, 0, 0, 0, 0) != 0 || t.nsec < 0 || t.nsec >= 1000000000)
                continue;
            copy_bytes(slot, &t, sizeof t);
            if (!same_bytes((const unsigned char *)slot, (const volatile unsigned char *)&t, sizeof t))
                continue;
            store(&c->produced, ++p);
            attempts = -1;
        }
        __atomic_store_n(&c->lock, 0, __ATOMIC_RELEASE);
    }
    for (;;) {
        uint64_t p = load(&c->produced);
        if (p - i > LF_CLOCK_RING) /* overwritten: far behind, take the newest */
            i = p - 1, st->clock_next[clock] = p;
        copy_bytes(out, &c->values[i % LF_CLOCK_RING], sizeof *out);
        if (load(&c->produced) - i <= LF_CLOCK_RING)
            return 0;
    }
}

static void clock_snapshot(struct lf_state *st, uint64_t *sync)
{
    for (unsigned c = 0; c < LF_CLOCKS; c++)
        sync[c] = load(&st->clocks[c].produced);
}

static void clock_align(struct lf_state *st, const uint64_t *sync)
{
    for (unsigned c = 0; c < LF_CLOCKS; c++)
        if (sync[c] > st->clock_next[c])
            st->clock_next[c] = sync[c];
}

/* --- the replicated call ------------------------------------------------------------------ */

/* Whether a call never meets the other replicas in the monitor (passthrough, a private
 * munmap, a clock read the monitor answers alone): it says nothing about where the
 * replicas are. */
static int local_call(long nr, const long *a)
{
    if (nr < 0 || nr >= MAX_NR)
        return 0;
    if (lf_table[nr].fast == F_LOCAL)
        return 1;
    return lf_table[nr].fast == F_CLOCK && (nr != SYS_clock_gettime || (a[0] >= 0 && a[0] < (long)LF_CLOCKS));
}

static void serial_resume(struct lf_state *st);
/* Nonzero while the thread is in a native synchronisation operation of the program's (a
 * mutex lock the leader's order decides): a futex wait there is the operation's, whose own
 * record follows, not a wait of the program's code that needs a RESUME. */
static __thread int lf_in_native __attribute__((tls_model("initial-exec")));

/* A call the monitor handles. A follower's calls that meet the leader there are counted
 * and marked (slow_seq), so that a leader waiting for it can tell a follower held in the
 * monitor from one still on its way. */
/* A futex call that can wait for another thread of this replica. */
static int futex_waits(long nr, const long *a)
{
    if (nr == SYS_futex_waitv)
        return 1;
    if (nr != SYS_futex)
        return 0;
    long cmd = a[1] & FUTEX_CMD_MASK;
    return cmd == FUTEX_WAIT || cmd == FUTEX_WAIT_BITSET || cmd == FUTEX_LOCK_PI || cmd == FUTEX_LOCK_PI2 ||
           cmd == FUTEX_WAIT_REQUEUE_PI;
}

/* A local call that can wait for another thread of this replica, or never returns: the
 * serial order's token (or place) is given up for it. */
static int local_yields(long nr) { return nr == SYS_sched_yield || nr == SYS_exit; }

/* The call itself, then (in the serial order) a place for the thread to go on from. */
static long raw_then_resume(struct lf_state *st, long nr, const long *a)
{
    long ret = lf_raw(nr, a[0], a[1], a[2], a[3], a[4], a[5]);
    serial_resume(st);
    return ret;
}

static void fd_hints_forget(long nr, const long *a);
static void commit_nudge(struct lf_state *st, uint64_t s);
static void exit_in_turn(struct lf_state *st);
static pthread_key_t lf_end_key;
static int lf_end_key_ok;
static volatile pid_t *glibc_tid_word(long tid);
static void take_done(void);

static void owe_doorbell(struct lf_state *st, int caught_up);

static long slow_call(struct lf_state *st, long nr, const long *a)
{
    fd_hints_forget(nr, a);
    if (st != NULL && st->hdr != NULL)
        owe_doorbell(st, 1);
    if (st != NULL && st->hdr != NULL && futex_waits(nr, a)) {
        /* Seen by a sibling thread waiting for its turn behind this one (take_turn). */
        volatile uint64_t *in_futex = &st->regions[st->me]->h.in_futex;
        /* The followers may wait for this lane's last record (a wait's start, an unlock)
         * while we sleep: wake them now, not at our next record. */
        if (st->me == st->leader)
            flush_wakes(st);
        int own_wait = lf_in_native == 0; /* not a native operation's, whose record follows */
        if (own_wait)
            serial_leave(st);
        store(in_futex, 1);
        long ret = lf_raw(nr, a[0], a[1], a[2], a[3], a[4], a[5]);
        store(in_futex, 0);
        if (own_wait)
            serial_resume(st);
        return after_slow_call(ret);
    }
    if (st == NULL || st->hdr == NULL)
        return after_slow_call(lf_raw(nr, a[0], a[1], a[2], a[3], a[4], a[5]));
    if (local_call(nr, a)) {
        if (!local_yields(nr))
            return after_slow_call(lf_raw(nr, a[0], a[1], a[2], a[3], a[4], a[5]));
        if (nr == SYS_exit)
            exit_in_turn(st);
        serial_leave(st);
        return after_slow_call(raw_then_resume(st, nr, a));
    }
    serial_leave(st);
    struct lf_region *own = st->regions[st->me];
    store(&own->h.slow_calls, own->h.slow_calls + 1);
    if (st->me == st->leader) {
        flush_wakes(st);
        return after_slow_call(raw_then_resume(st, nr, a));
    }
    store(&own->h.slow_seq, st->seq + 1);
    commit_nudge(st, st->seq + 1);
    signal_progress(st, &own->h.progress, st->leader, 1);
    long ret = lf_raw(nr, a[0], a[1], a[2], a[3], a[4], a[5]);
    if (st->hdr == NULL)
        return after_slow_call(ret); /* a fork of the replica that made the call (re-integration) */
    store(&own->h.slow_seq, 0);
    serial_resume(st);
    return after_slow_call(ret);
}

static void report_divergence(uint64_t s, long nr, uint64_t digest, uint64_t leader_nr, uint64_t leader_digest);
static void publish_on(struct lf_state *st, struct lf_record *rec, uint64_t s, const struct lf_desc *d, const long *a,
                       long ret, uint64_t object);

/* Publishes record `s`, in the order of every event. */
static void publish(struct lf_state *st, struct lf_record *rec, uint64_t s, const struct lf_desc *d, const long *a,
                    long ret)
{
    publish_on(st, rec, s, d, a, ret, 0);
}

/* Publishes record `s` once it matches what the call gave (`d`, `a`, the result as the
 * gate stored it); otherwise nobody can know that result, and the leader reports it. */
static void publish_on(struct lf_state *st, struct lf_record *rec, uint64_t s, const struct lf_desc *d, const long *a,
                       long ret, uint64_t object)
{
    struct lf_region *own = st->regions[st->me];
    if (!record_matches(rec, d, a, ret)) {
        report_divergence(s, rec->nr, rec->digest, DIVERGED_LEADER, 0);
        return;
    }
    if (!st->posting) {
        rec->post_len = 0;
        rec->post_handle = 0;
        rec->post_base = 0;
    }
    if (object == 0)
        serial_claim(st);
    rec->order = object != 0 ? claim_object_turn(st, s, object) : claim_turn(st, s);
    rec->crc = record_crc(rec, s);
    if (s == lf_test_corrupt)
        rec->ret ^= 1;
    store(&rec->seq, s);
    __atomic_store_n(&own->h.waiting_outside, 0, __ATOMIC_RELAXED);
    store(&own->h.published, s);
    wake_followers(st);
}

/* Publishes ESCALATE for call `s` and makes the call through the monitor. `d` is given
 * when the call was interrupted in the leader: what the kernel wrote into its in-out
 * buffers meanwhile (poll's revents) goes to the followers too, as the monitor does for
 * an interrupted call, so that all replicas bring the same buffers to the monitor. */
static long escalate(struct lf_state *st, struct lf_record *rec, uint64_t s, long nr, uint64_t digest, const long *a,
                     const struct lf_desc *d)
{
    rec->nr = (uint32_t)nr;
    rec->kind = KIND_ESCALATE;
    rec->digest = digest;
    rec->ret = 0;
    rec->len = d != NULL ? pack(d, a, 0, rec->payload) : 0;
    clock_snapshot(st, rec->clock_sync);
    publish(st, rec, s, d, a, 0);
    return slow_call(st, nr, a);
}

/* --- signals as records ----------------------------------------------------------------
 * The monitor sees every signal first (the replicas are traced). One the leader's thread is
 * to take goes into this lane's mailbox; the leader takes it at its next replicated call
 * (or right away if the monitor interrupted that call for it), publishes a SIGNAL record in
 * place of the call, and raises the signal on itself with tgkill from the fast gate; each
 * follower does the same when it reaches the record. The monitor lets those raises through
 * with the leader's siginfo, so the kernel runs the program's handler, with its own mask,
 * flags and stack, at the same call in every replica. Then the call is made again as a new
 * record, or returns EINTR where the kernel would not have restarted it. */

/* Signals whose handler was installed with SA_RESTART (bit N-1 for signal N), as the
 * program's rt_sigaction calls left them: the same in every replica. */
static volatile uint64_t lf_sa_restart;

static void note_sigaction(long nr, const long *a, const struct kernel_sigaction *act, long ret)
{
    if (nr != SYS_rt_sigaction || ret != 0 || a[1] == 0 || a[0] < 1 || a[0] > 64)
        return;
    uint64_t bit = 1ULL << (a[0] - 1);
    int restarts = (act->flags & SA_RESTART) && act->handler != SIG_DFL && act->handler != SIG_IGN;
    __atomic_store_n(&lf_sa_restart, restarts ? lf_sa_restart | bit : lf_sa_restart & ~bit, __ATOMIC_RELAXED);
}

/* The mailbox's signal, if the monitor posted one since we last looked (0: none). With
 * `interrupted`, only one the monitor interrupted a call for (it wrote the restart code
 * before it let the call return). A signal the thread blocks now (it arrived before a
 * handler or a sigprocmask blocked it) stays in the mailbox until it is unblocked, as it
 * would stay pending in the kernel. */
static int take_signal(struct lf_state *st, int64_t *code, int interrupted)
{
    uint32_t request = __atomic_load_n(&st->mailbox->request, __ATOMIC_SEQ_CST);
    if (request == st->signal_seen || (interrupted && st->mailbox->code == 0))
        return 0;
    uint32_t sig = st->mailbox->sig;
    int valid = sig >= 1 && sig <= 64 && sig != SIGSYS;
    uint64_t blocked = 0;
    if (valid && lf_fast(SYS_rt_sigprocmask, SIG_BLOCK, 0, (long)&blocked, sizeof blocked, 0, 0) == 0 &&
        (blocked >> (sig - 1)) & 1)
        return 0;
    st->signal_seen = request;
    *code = st->mailbox->code;
    store(&st->regions[st->me]->h.signal_seen, request);
    return valid ? (int)sig : 0;
}

/* The kernel delivers `sig` here, as it would have where the leader took it: unblocked for
 * the moment (it was not blocked where it arrived), raised, and the mask restored. */
static void raise_in_place(int sig)
{
    uint64_t bit = 1ULL << (sig - 1), old = 0;
    lf_fast(SYS_rt_sigprocmask, SIG_UNBLOCK, (long)&bit, (long)&old, sizeof bit, 0, 0);
    lf_fast(SYS_tgkill, lf_fast(SYS_getpid, 0, 0, 0, 0, 0, 0), lf_fast(SYS_gettid, 0, 0, 0, 0, 0, 0), sig, 0, 0, 0);
    lf_fast(SYS_rt_sigprocmask, SIG_SETMASK, (long)&old, 0, sizeof old, 0, 0);
}

/* What becomes of a call a signal interrupted, as the kernel decides it natively. */
static int restarts(int sig, int64_t code)
{
    return code == -ERESTARTNOINTR || (code == -ERESTARTSYS && ((lf_sa_restart >> (sig - 1)) & 1));
}

/* The leader: SIGNAL for call `s` in place of its result, then the handler. `d` is given
 * when the call was interrupted: what the kernel wrote into its in-out buffers meanwhile
 * goes to the followers too (as for ESCALATE). */
static long deliver_signal(struct lf_state *st, struct lf_record *rec, uint64_t s, long nr, uint64_t digest,
                           const long *a, const struct lf_desc *d, int sig, int64_t code)
{
    uint64_t word = (uint64_t)sig | ((uint64_t)(-code) << SIGNAL_CODE_SHIFT);
    if (d != NULL)
        word |= SIGNAL_INTERRUPTED;
    if (d == NULL || restarts(sig, code))
        word |= SIGNAL_RESTART;
    rec->nr = (uint32_t)nr;
    rec->kind = KIND_SIGNAL;
    rec->digest = digest;
    rec->ret = 0;
    rec->signal = word;
    rec->len = d != NULL ? pack(d, a, 0, rec->payload) : 0;
    for (unsigned c = 0; c < LF_CLOCKS; c++)
        rec->clock_sync[c] = 0;
    publish(st, rec, s, d, a, 0);
    raise_in_place(sig);
    return (word & SIGNAL_RESTART) ? LF_AGAIN : -EINTR;
}

/* A follower at a SIGNAL record that matches its call: the same signal, the same outcome.
 * 0 when the record is not one this replica can follow. */
static long follow_signal(struct lf_state *st, const struct lf_record *rec, uint64_t s, const struct lf_desc *d,
                          const long *a)
{
    uint64_t word = rec->signal;
    int sig = (int)(word & SIGNAL_NUMBER);
    int64_t code = -(int64_t)(word >> SIGNAL_CODE_SHIFT);
    int interrupted = (word & SIGNAL_INTERRUPTED) != 0;
    int restart = !interrupted || restarts(sig, code);
    if (sig < 1 || sig > 64 || sig == SIGSYS || restart != ((word & SIGNAL_RESTART) != 0) ||
        (rec->len > 0 && !unpack(d, a, rec->payload, rec->len)))
        return 0;
    struct lf_region *own = st->regions[st->me];
    store(&own->h.consumed, s);
    signal_progress(st, &own->h.progress, st->leader, 0);
    raise_in_place(sig);
    return restart ? LF_AGAIN : -EINTR;
}

/* An event loop's waiting point: a poll or an epoll wait with a timeout. */
static int may_wait_long(long nr, const long *a)
{
    return ((nr == SYS_epoll_wait || nr == SYS_epoll_pwait) && a[3] != 0) || (nr == SYS_poll && a[2] != 0);
}

/* Test: the first leader's process dies at record `at` of a thread the program started
 * (`die`: a call or a synchronisation operation), or at its first call from record `at`
 * on (`die-call`, before the call runs; which records are synchronisation operations
 * depends on who owned a mutex, see "owned mutexes"), while its other threads are
 * anywhere, as after a fault's crash. */
static void test_die_at(struct lf_state *st, uint64_t s, uint64_t at, int from)
{
    if (at != 0 && (s == at || (from && s > at)) && lf_ring_epoch == 0 && st->lane != 0 && st->me == 0)
        lf_fast(SYS_kill, lf_fast(SYS_getpid, 0, 0, 0, 0, 0, 0), SIGKILL, 0, 0, 0, 0);
}

/* --- the output commit -------------------------------------------------------------------
 * With strict output checks the leader does not make an output itself: it posts the call
 * (number and arguments) in its region and waits; the committer, a thread of the monitor
 * (crates/run/src/commit.rs), copies the buffers out of the leader's memory, digests the
 * copy as `inspect` does, writes it through its own duplicate of the leader's descriptor
 * once every follower voted that digest for this call, and answers in the header page
 * (struct lf_commit_answer). No ptrace stop, no rendezvous. Whoever completes a request
 * last (the leader posting, or the last follower voting) rings the committer's doorbell.
 * A descriptor the committer does not write (pipes, ttys: COMMIT_OWN) is remembered per
 * process until it is closed, and its outputs take the older path: the leader waits for
 * the votes, makes the call from the fast gate, and the monitor checks it at that stop. */

/* Descriptors whose outputs the committer left to the leader (COMMIT_OWN), until closed.
 * Only a hint: a wrong one costs a round trip or a stop, never a check. */
#define FD_HINTS 4096
static unsigned char lf_fd_own[FD_HINTS];

/* Descriptors that take posted outputs: the committer's handle of each (0: none), valid
 * while the header's post_epoch is the one seen when it was given. */
static uint32_t lf_fd_post[FD_HINTS];
static uint32_t lf_post_epoch_seen;

static int fd_is_own(long fd) { return fd >= 0 && fd < FD_HINTS && lf_fd_own[fd]; }

static void fd_set_own(long fd)
{
    if (fd >= 0 && fd < FD_HINTS)
        lf_fd_own[fd] = 1;
}

static void fd_forget(long fd)
{
    if (fd >= 0 && fd < FD_HINTS) {
        lf_fd_own[fd] = 0;
        lf_fd_post[fd] = 0;
    }
}

/* The handle under which output on `fd` may be posted (0: it may not). */
static uint32_t fd_post_handle(const struct lf_state *st, long fd)
{
    uint32_t epoch = __atomic_load_n(&st->hdr->post_epoch, __ATOMIC_ACQUIRE);
    if (epoch != lf_post_epoch_seen) {
        for (long f = 0; f < FD_HINTS; f++)
            lf_fd_post[f] = 0;
        lf_post_epoch_seen = epoch;
    }
    return fd >= 0 && fd < FD_HINTS ? lf_fd_post[fd] : 0;
}

/* A read of a descriptor that takes posted outputs: a non-blocking socket (the handle
 * is withdrawn when the program makes it blocking), so the call does not wait. Only a
 * hint: a descriptor made blocking behind our back (through another process sharing it)
 * costs a follower's sleep timeout in latency, never a check. */
/* Replies a leader posts between wake-ups of its followers while its calls return at once. */
#define POSTS_PER_WAKE 8
static int returns_at_once(const struct lf_state *st, long nr, const long *a)
{
    int reads = nr == SYS_read || nr == SYS_readv || nr == SYS_recvfrom || nr == SYS_recvmsg;
    return reads && fd_post_handle(st, a[0]) != 0;
}

/* A call that frees or replaces descriptors, or may make one block, forgets their hints. */
static void fd_hints_forget(long nr, const long *a)
{
    if (nr == SYS_close || (nr == SYS_fcntl && a[1] == F_SETFL) || (nr == SYS_ioctl && a[1] == FIONBIO))
        fd_forget(a[0]);
    else if (nr == SYS_dup2 || nr == SYS_dup3)
        fd_forget(a[1]);
    else if (nr == SYS_close_range)
        for (long fd = 0; fd < FD_HINTS; fd++)
            fd_forget(fd);
}

static void ring_doorbell(struct lf_state *st)
{
    __atomic_fetch_add(st->doorbell, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&st->hdr->committer_sleeping, __ATOMIC_SEQ_CST))
        futex_wake(st->doorbell);
}

/* Whether every follower has voted on call `s` or stands still at it (the committer then
 * has all it needs to answer): the leader rings the doorbell only then. */
static int followers_at(const struct lf_state *st, uint64_t s)
{
    for (uint32_t r = 0; r < st->replicas; r++) {
        if (r == st->me || region_lost(st, r))
            continue;
        const struct lf_region_head *f = &st->regions[r]->h;
        if (load(&f->vote_seq) < s && load(&f->awaiting) < s && load(&f->slow_seq) == 0)
            return 0;
    }
    return 1;
}

/* A follower that reached call `s` (voted, or waits for its record, or went to the monitor)
 * rings the doorbell if the leader's commit request for it waits. */
static void commit_nudge(struct lf_state *st, uint64_t s)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (st->hdr->commit && load(&st->regions[st->leader]->h.commit_seq) == s)
        ring_doorbell(st);
}

/* Posts output `s` to the committer and waits for its answer: COMMIT_* (`*ret` with
 * COMMIT_DONE). An answer for a later call than ours cannot be: taken as no go-ahead. */
static int commit_output(struct lf_state *st, uint64_t s, long nr, const long *a, long *ret)
{
    struct lf_region_head *h = &st->regions[st->me]->h;
    h->commit_nr = (uint64_t)nr;
    for (int i = 0; i < 6; i++)
        h->commit_args[i] = (uint64_t)a[i];
    store(&h->vote_wanted, s);
    __atomic_store_n(&h->commit_seq, s, __ATOMIC_SEQ_CST);
    if (followers_at(st, s))
        ring_doorbell(st);
    flush_wakes(st); /* the followers catch up while we wait */
    volatile struct lf_commit_answer *ans = st->answer;
    volatile uint32_t *sleeping = &h->sleeping;
    uint64_t got;
    for (;;) {
        uint32_t seen = load32(&ans->word);
        __atomic_exchange_n(sleeping, WAKE_ON_COMMIT, __ATOMIC_SEQ_CST);
        got = load(&ans->seq);
        if (got < s)
            futex_wait(&ans->word, seen);
        __atomic_store_n(sleeping, AWAKE, __ATOMIC_RELEASE);
        if (got >= s)
            break;
    }
    store(&h->vote_wanted, 0);
    uint32_t verdict = __atomic_load_n(&ans->verdict, __ATOMIC_ACQUIRE);
    *ret = ans->ret;
    uint32_t handle = __atomic_load_n(&ans->handle, __ATOMIC_ACQUIRE);
    if (got != s || load(&ans->seq) != s)
        return COMMIT_ESCALATE;
    if (verdict == COMMIT_DONE && a[0] >= 0 && a[0] < FD_HINTS) {
        fd_post_handle(st, a[0]); /* a newer epoch first: this handle belongs to it */
        lf_fd_post[a[0]] = handle;
    }
    return verdict == COMMIT_DONE || verdict == COMMIT_OWN ? (int)verdict : COMMIT_ESCALATE;
}

/* The leader's in-process check of an output: every follower voted our digest. */
static int outputs_agree(struct lf_state *st, uint64_t s, uint64_t digest)
{
    struct lf_region *own = st->regions[st->me];
    store(&own->h.vote_wanted, s);
    int got = wait_followers(st, voted, s);
    store(&own->h.vote_wanted, 0);
    if (got == READY)
        for (uint32_t r = 0; r < st->replicas; r++)
            if (r != st->me && !region_lost(st, r) && load(&st->regions[r]->h.vote_digest) != digest)
                got = GIVE_UP_SLOW;
    return got;
}

/* --- posted outputs ------------------------------------------------------------------
 * On a descriptor the committer named with a handle (a non-blocking stream socket whose
 * last output it wrote whole), the leader does not wait for an output at all: it copies
 * the output (its buffers, and the iovecs and msghdr that describe them, at the same
 * offsets the committer reads them from) into the record's payload, digests that copy,
 * and publishes the record with every byte as the call's result. Each follower compares
 * the record with its own call as for any output and, when they match, votes the digest
 * into the record. The committer writes the copy once every live follower voted it,
 * after digesting the copy again (a copy changed after the leader's digest is a detected
 * fault, the run stops), and marks it taken; the leader reuses that record's slot only
 * then. Bytes the socket does not take at once the committer keeps and writes as it
 * drains; the descriptor then loses its handle (post_epoch), and the next output on it
 * goes the synchronous way, which answers EAGAIN until the kept bytes are out. */

/* Copies output `nr` (arguments `a`) into `rec`'s payload, with `pa` the same call over
 * the copy; the copy's length, or 0 when it does not fit (the call then commits as usual). */
static uint32_t post_copy(struct lf_record *rec, long nr, const long *a, long *pa)
{
    unsigned char *p = rec->payload, *end = rec->payload + LF_PAYLOAD_MAX;
    const struct iovec *iov = NULL;
    long count = 0;
    for (int i = 0; i < 6; i++)
        pa[i] = a[i];
    pa[1] = (long)p;
    if (nr == SYS_write || nr == SYS_sendto) {
        if ((uint64_t)a[2] > LF_PAYLOAD_MAX || (a[2] > 0 && a[1] == 0))
            return 0;
        copy_bytes(p, (const void *)a[1], (uint64_t)a[2]);
        return (uint32_t)a[2];
    }
    if (nr == SYS_sendmsg) {
        const struct msghdr *m = (const struct msghdr *)a[1];
        if (m == NULL || m->msg_name != NULL || m->msg_controllen != 0)
            return 0;
        struct msghdr *copy = (struct msghdr *)p;
        copy_bytes(copy, m, sizeof *m);
        iov = m->msg_iov;
        count = (long)m->msg_iovlen;
        p += sizeof *m;
        copy->msg_iov = (struct iovec *)p;
    } else if (nr == SYS_writev) {
        iov = (const struct iovec *)a[1];
        count = a[2];
    } else {
        return 0;
    }
    if (count < 0 || (uint64_t)count > LF_MAX_IOVECS || (count > 0 && iov == NULL) ||
        (uint64_t)(end - p) < (uint64_t)count * sizeof(struct iovec))
        return 0;
    struct iovec *to = (struct iovec *)p;
    p += count * sizeof(struct iovec);
    for (long k = 0; k < count; k++) {
        uint64_t n = iov[k].iov_len;
        if (n > (uint64_t)(end - p) || (n > 0 && iov[k].iov_base == NULL))
            return 0;
        copy_bytes(p, iov[k].iov_base, n);
        to[k].iov_base = p;
        to[k].iov_len = n;
        p += n;
    }
    return (uint32_t)(p - rec->payload);
}

/* Publishes output `s` as posted under `handle`; its result (every byte), or LONG_MIN
 * when it cannot be posted (too large with its iovecs). */
static long post_output(struct lf_state *st, struct lf_record *rec, uint64_t s, long nr, const struct lf_desc *d,
                        const long *a, uint32_t handle)
{
    long pa[6];
    uint32_t len = post_copy(rec, nr, a, pa);
    uint64_t digest;
    if (len == 0 || inspect(nr, d, pa, &digest) < 0)
        return LONG_MIN;
    long total = 0;
    if (nr == SYS_write || nr == SYS_sendto) {
        total = a[2];
    } else {
        int count;
        const struct iovec *iov = iovecs(&d->args[1], pa, 1, &count);
        for (int k = 0; k < count; k++)
            total += (long)iov[k].iov_len;
    }
    if (s == lf_test_post_corrupt && len > 0)
        rec->payload[len - 1] ^= 1; /* test: the copy changes after its digest */
    rec->nr = (uint32_t)nr;
    rec->kind = KIND_RESULT;
    rec->digest = digest;
    rec->ret = total;
    rec->len = 0;
    rec->post_len = len;
    rec->post_handle = handle;
    rec->post_base = (uint64_t)rec->payload;
    /* What the committer needs to rebuild the call over the copy: its flags (sendto's,
     * sendmsg's; low half) and writev's iovec count (high half). */
    uint64_t flags = nr == SYS_sendto ? (uint64_t)(uint32_t)a[3] : nr == SYS_sendmsg ? (uint64_t)(uint32_t)a[2] : 0;
    rec->post_flags = flags | (nr == SYS_writev ? (uint64_t)a[2] << 32 : 0);
    st->last_posted = s;
    clock_snapshot(st, rec->clock_sync);
    clock_align(st, rec->clock_sync);
    st->posting = 1;
    publish(st, rec, s, d, pa, total);
    st->posting = 0;
    st->posted_unwoken++;
    st->regions[st->me]->h.fast_calls++;
    return total;
}

/* Waits until the committer took posted record `old` of this lane (its slot is reused
 * next); 0 when the ring went off meanwhile. */
static int wait_taken(struct lf_state *st, uint64_t old)
{
    volatile struct lf_commit_answer *ans = st->answer;
    volatile uint32_t *sleeping = &st->regions[st->me]->h.sleeping;
    while (load(&ans->taken) < old) {
        if (is_off(st))
            return 0;
        uint32_t seen = load32(&ans->word);
        __atomic_exchange_n(sleeping, WAKE_ON_COMMIT, __ATOMIC_SEQ_CST);
        ring_doorbell(st);
        if (load(&ans->taken) < old)
            futex_wait(&ans->word, seen);
        __atomic_store_n(sleeping, AWAKE, __ATOMIC_RELEASE);
    }
    return 1;
}

/* The leader is about to write a new record into `rec`, whose old one every follower
 * consumed (and the committer took, if it was posted). The slot stops naming the old
 * record first: the committer walks records it has not looked at yet by number, up to
 * LF_SLOTS behind the leader, and would otherwise read the new record's fields (a posted
 * output's length, digest, copy) under the old record's number while they are written.
 * publish_on names the slot again once the record is whole. */
static void open_slot(struct lf_record *rec)
{
    __atomic_store_n(&rec->seq, 0, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

/* Every follower consumed the record `rec` held: once the committer took it too (if it
 * was a posted output), the slot is opened for record `s`. 0 when the ring went off. */
static int reuse_slot(struct lf_state *st, struct lf_record *rec, uint64_t s)
{
    uint64_t old = load(&rec->seq);
    if (rec->post_len != 0 && old + LF_SLOTS == s && !wait_taken(st, old))
        return 0;
    open_slot(rec);
    return 1;
}

/* The slot of record `s` is free and open for it (see reuse_slot). */
static int slot_ready(struct lf_state *st, struct lf_record *rec, uint64_t s)
{
    return wait_followers(st, slot_free, s) == READY && reuse_slot(st, rec, s);
}

/* A follower's vote on posted output `s` goes where its vote on `s - LF_SLOTS` was: only
 * once the committer took that one (a leader promoted in place does not wait for the
 * committer before reusing a slot its former filled). 0 when the ring went off. */
static int vote_slot_free(struct lf_state *st, uint64_t s)
{
    uint64_t old = load(&st->regions[st->me]->h.post_vote_seq[s % LF_SLOTS]);
    return old == 0 || old >= s || wait_taken(st, old);
}

/* Whether every live follower is done with record `s` (voted, or went to the monitor). */
static int followers_passed(const struct lf_state *st, uint64_t s)
{
    for (uint32_t r = 0; r < st->replicas; r++)
        if (r != st->me && !region_lost(st, r) && load(&st->regions[r]->h.passed) < s)
            return 0;
    return 1;
}

/* The leader is about to wait in the kernel (`in_flight` stored): its batch of posted
 * outputs is complete. If the followers voted on all of it, the leader rings; otherwise
 * the last follower to catch up does, as it sees the leader inside a call (both look at
 * the other after their own SeqCst store, so one of them rings). */
static void posted_batch_done(struct lf_state *st)
{
    uint64_t last = st->last_posted;
    if (last == 0)
        return;
    st->last_posted = 0;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (followers_passed(st, last))
        ring_doorbell(st);
}

/* Whether the leader of region `src` is inside a call or asleep in the ring: it posts no
 * more outputs of this batch, so a follower that caught up with it rings the committer. */
static int leader_stands(const struct lf_state *st, uint32_t src)
{
    const struct lf_region_head *l = &st->regions[src]->h;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return __atomic_load_n(&l->in_flight, __ATOMIC_SEQ_CST) > load(&l->published) || load32(&l->sleeping) != 0 ||
           __atomic_load_n(&st->hdr->leader, __ATOMIC_SEQ_CST) != src;
}

/* A follower voted on posted outputs: the committer hears of it when the follower caught
 * up with the leader (or goes to the monitor), once per batch, not per output. */
static void owe_doorbell(struct lf_state *st, int caught_up)
{
    if (st->owed_votes != 0 && (caught_up || st->owed_votes >= LF_SLOTS / 2)) {
        st->owed_votes = 0;
        ring_doorbell(st);
    }
}

static long lead(struct lf_state *st, uint64_t s, long nr, const struct lf_desc *d, const long *a, uint64_t digest, long bound)
{
    struct lf_region *own = st->regions[st->me];
    struct lf_record *rec = &own->records[s % LF_SLOTS];
    if (is_off(st) || !slot_ready(st, rec, s)) {
        own->h.unrecorded++;
        return slow_call(st, nr, a); /* no record: the monitor finds out why */
    }
    if (s == lf_test_hang && lf_ring_epoch == 0) {
        /* test: the leader waits for a lock word nobody will change, as a fault can make a
         * thread do (a lock taken twice), through the monitor as the program's futex is */
        static int never;
        long wait[6] = {(long)&never, FUTEX_WAIT_PRIVATE, 0, 0, 0, 0};
        slow_call(st, SYS_futex, wait);
    }
    if (s == lf_test_flap && lf_ring_epoch == 0) {
        /* test: the leader spins and sleeps on ring memory in turn, for ever, as a thread
         * whose pointer into the ring a fault corrupted did (a campaign's hang) */
        for (;;) {
            for (unsigned i = 0; i < (1u << 20); i++)
                cpu_relax();
            futex_wait(&own->h.progress, load32(&own->h.progress));
        }
    }
    test_die_at(st, s, lf_test_die, 0);
    test_die_at(st, s, lf_test_die_call, 1);
    /* the first leader only, at its first call from record lf_test_signal on */
    if (lf_test_signal != 0 && s >= lf_test_signal && lf_ring_epoch == 0 && st->me == 0 &&
        !__atomic_exchange_n(&lf_test_signal_sent, 1, __ATOMIC_SEQ_CST))
        return deliver_signal(st, rec, s, nr, digest, a, NULL, SIGUSR1, 0);
    int64_t code = 0;
    int sig = take_signal(st, &code, 0);
    if (sig != 0)
        return deliver_signal(st, rec, s, nr, digest, a, NULL, sig, 0);
    if (bound > (long)LF_PAYLOAD_MAX)
        return escalate(st, rec, s, nr, digest, a, NULL);
    /* test: the leader makes one byte less than it compared (and than it digested) */
    long lie[6] = {a[0], a[1], s == lf_test_lie && a[2] > 0 ? a[2] - 1 : a[2], a[3], a[4], a[5]};
    int commit = d->fast == F_OUTPUT && st->hdr->commit && !fd_is_own(a[0]);
    uint32_t handle = commit ? fd_post_handle(st, a[0]) : 0;
    if (handle != 0 && (nr == SYS_write || nr == SYS_writev || (nr == SYS_sendto && a[5] == 0) || nr == SYS_sendmsg)) {
        long posted = post_output(st, rec, s, nr, d, lie, handle);
        if (posted != LONG_MIN)
            return posted;
    }
    /* A leader on a CPU of its own waits for the votes here, spinning, as without the
     * committer: the committer (on the leader's CPU) is then woken by the leader, not
     * across CPUs by the last follower to vote. */
    if (d->fast == F_OUTPUT && (!commit || may_spin(st))) {
        int got = outputs_agree(st, s, digest);
        if (got == GIVE_UP_OFF)
            return slow_call(st, nr, a);
        if (got == READY && !st->hdr->strict) {
            /* Without the monitor's check, check again, over the buffers as they are now:
             * memory corrupted while the leader waited for the votes is caught here. */
            uint64_t again;
            if (inspect(nr, d, a, &again) < 0 || again != digest)
                got = GIVE_UP_SLOW;
        }
        if (got != READY) /* a different output: the monitor votes */
            return escalate(st, rec, s, nr, digest, a, NULL);
    }
    /* The followers catch up while we wait; and before a call after a posted output,
     * which waits for their votes, if the call may block (a read on a blocking descriptor,
     * a select) where no rule above would wake them. A read of a socket that takes posted
     * outputs (non-blocking) returns at once: the wake-up waits for the next call that
     * may wait, or for POSTS_PER_WAKE replies, so that a server's loop over its ready
     * connections wakes the followers once, not once per reply, and a reply waits for at
     * most that many more requests' work. */
    int waits_long = may_wait_long(nr, a);
    if (waits_long || (st->posted_unwoken != 0 && (st->posted_unwoken >= POSTS_PER_WAKE || !returns_at_once(st, nr, a))))
        flush_wakes(st);
    own->h.in_flight_nr = (uint64_t)nr;
    __atomic_store_n(&own->h.in_flight, s, __ATOMIC_SEQ_CST);
    if (waits_long) {
        __atomic_store_n(&own->h.waiting_outside, 1, __ATOMIC_RELAXED);
        posted_batch_done(st);
    }
    if (is_off(st)) /* a follower may have given up on this call already: all meet the monitor */
        return escalate(st, rec, s, nr, digest, a, NULL);
    /* A signal posted meanwhile: the monitor, which looks at in_flight after posting, may
     * not interrupt this call, so it is taken now. */
    if ((sig = take_signal(st, &code, 0)) != 0)
        return deliver_signal(st, rec, s, nr, digest, a, NULL, sig, 0);
    serial_leave(st); /* the call's result takes a place of its own afterwards */
    long ret_copy = 0;
    long ret = 0;
    int verdict = commit ? commit_output(st, s, nr, lie, &ret) : COMMIT_OWN;
    if (verdict == COMMIT_OWN && commit) {
        fd_set_own(a[0]);
        if (outputs_agree(st, s, digest) != READY)
            return escalate(st, rec, s, nr, digest, lie, NULL);
    }
    if (verdict == COMMIT_ESCALATE)
        return escalate(st, rec, s, nr, digest, lie, NULL);
    if (verdict == COMMIT_OWN)
        ret = lf_fast_dup(nr, lie[0], lie[1], lie[2], lie[3], lie[4], lie[5], &ret_copy);
    else
        ret_copy = st->answer->ret; /* read again: the record is checked against it */
    if (s == lf_test_result)
        ret ^= 1; /* test: the result changed on its way from rax into the record */
    if (s == lf_test_crash)
        __asm__ volatile("movb $1, 0x10" ::: "memory"); /* test: the leader faults after the call ran (page 0 is read-only) */
    if (s == lf_test_wild_result)
        ret = ret_copy = ret_copy ^ (1L << 40); /* test: the result register changed first */
    if (ret == -EINTR && (sig = take_signal(st, &code, 1)) != 0) {
        /* The monitor interrupted the call to deliver a signal: the kernel's verdict on it
         * (restart or EINTR) comes after the handler, as natively. */
        return deliver_signal(st, rec, s, nr, digest, a, d, sig, code);
    }
    rec->nr = (uint32_t)nr;
    rec->kind = KIND_RESULT;
    rec->digest = digest;
    rec->ret = ret;
    rec->len = ret >= 0 ? pack(d, a, ret, rec->payload) : 0;
    if (d->fast == F_OUTPUT) {
        clock_snapshot(st, rec->clock_sync);
        clock_align(st, rec->clock_sync);
    } else {
        for (unsigned c = 0; c < LF_CLOCKS; c++)
            rec->clock_sync[c] = 0;
    }
    publish(st, rec, s, d, a, ret_copy);
    own->h.fast_calls++;
    return ret;
}

static void report_divergence(uint64_t s, long nr, uint64_t digest, uint64_t leader_nr, uint64_t leader_digest)
{
    lf_raw(LF_SYS_FAST, OP_DIVERGED, (long)s, nr, (long)digest, (long)leader_nr, (long)leader_digest);
}

static int vote_slot_free(struct lf_state *st, uint64_t s);

static long follow(struct lf_state *st, uint64_t s, uint32_t src, long nr, const struct lf_desc *d, const long *a,
                   uint64_t digest)
{
    struct lf_region *own = st->regions[st->me];
    struct lf_region *leader = st->regions[src];
    struct lf_record *rec = &leader->records[s % LF_SLOTS];
    serial_leave(st); /* this thread's segment ends here, as the leader's did */
    if (d->fast == F_OUTPUT) {
        own->h.vote_digest = digest;
        store(&own->h.vote_seq, s);
    }
    /* A leader waiting for votes on this call looks at both (see voted()). */
    store(&own->h.awaiting, s);
    commit_nudge(st, s);
    if (d->fast == F_OUTPUT || load(&leader->h.vote_wanted) == s)
        signal_progress(st, &own->h.progress, st->leader, 1);
    struct wait_for w = {st, src, s, 0};
    int got = wait_until(published, &w, &leader->h.published_word, WAKE_ON_ANY);
    store(&own->h.awaiting, 0);
    if (got == MOVED) {
        st->seq = s - 1; /* the call again, with the new leader's record (or as it) */
        return LF_AGAIN;
    }
    if (lf_test_bad_wait != 0 && s >= lf_test_bad_wait && lf_ring_epoch == 0 && st->me == st->replicas - 1)
        got = checked_answer(got | 8); /* test: in one follower, the answer changed on its way */
    if (got == CORRUPT)
        report_divergence(s, nr, digest, DIVERGED_STATE, 0);
    if (got != READY)
        return slow_call(st, nr, a); /* off, and the leader never published this call */
    if (load(&rec->seq) != s || rec->crc != record_crc(rec, s)) {
        report_divergence(s, nr, digest, DIVERGED_CRC, 0);
        return slow_call(st, nr, a);
    }
    take_place(st, rec->order, 0);
    long ret;
    if (rec->kind == KIND_ESCALATE) {
        int same = rec->nr == (uint32_t)nr && rec->digest == digest;
        if (same && rec->len > 0 && !unpack(d, a, rec->payload, rec->len)) {
            report_divergence(s, nr, digest, rec->nr, rec->digest);
            return slow_call(st, nr, a);
        }
        store(&own->h.consumed, s);
        signal_progress(st, &own->h.progress, st->leader, 0);
        return slow_call(st, nr, a);
    }
    if (rec->kind == KIND_SIGNAL) {
        long after = rec->nr == (uint32_t)nr && rec->digest == digest ? follow_signal(st, rec, s, d, a) : 0;
        if (after == 0) {
            report_divergence(s, nr, digest, rec->nr, rec->digest);
            return slow_call(st, nr, a);
        }
        return after;
    }
    if (rec->nr != (uint32_t)nr || rec->digest != digest ||
        (rec->ret >= 0 && !unpack(d, a, rec->payload, rec->len))) {
        /* A posted output that differs from ours: our own digest is our vote, which the
         * monitor weighs against the leader's and the other followers' (see "posted
         * outputs"); the committer writes none of them meanwhile. */
        if (rec->post_len != 0 && d->fast == F_OUTPUT && vote_slot_free(st, s)) {
            own->h.post_vote_digest[s % LF_SLOTS] = digest;
            __atomic_store_n(&own->h.post_vote_seq[s % LF_SLOTS], s, __ATOMIC_SEQ_CST);
        }
        /* Done with record `s`: the monitor makes this call (a slow call before a record
         * takes no sequence number, so only here does going to the monitor pass one). */
        __atomic_store_n(&own->h.passed, s, __ATOMIC_SEQ_CST);
        report_divergence(s, nr, digest, rec->nr, rec->digest);
        return slow_call(st, nr, a);
    }
    ret = rec->ret;
    if (d->fast == F_OUTPUT)
        clock_align(st, rec->clock_sync);
    if (rec->post_len != 0 && vote_slot_free(st, s)) {
        own->h.post_vote_digest[s % LF_SLOTS] = digest;
        __atomic_store_n(&own->h.post_vote_seq[s % LF_SLOTS], s, __ATOMIC_SEQ_CST);
        st->owed_votes++;
    }
    store(&own->h.consumed, s);
    store(&own->h.passed, s);
    signal_progress(st, &own->h.progress, st->leader, 0);
    owe_doorbell(st, load(&leader->h.published) <= s && leader_stands(st, src));
    own->h.fast_calls++;
    return ret;
}

static long clock_call(struct lf_state *st, long nr, const long *a)
{
    struct lf_time t;
    long clock = nr == SYS_clock_gettime ? a[0] : CLOCK_REALTIME;
    if (clock < 0 || clock >= (long)LF_CLOCKS || (nr == SYS_clock_gettime && a[1] == 0) ||
        (nr == SYS_gettimeofday && a[1] != 0) || is_off(st))
        return slow_call(st, nr, a);
    if (clock_value(st, (int)clock, &t) != 0)
        return slow_call(st, nr, a);
    if (nr == SYS_clock_gettime) {
        copy_bytes((void *)a[1], &t, sizeof t);
        return 0;
    }
    if (nr == SYS_gettimeofday) {
        if (a[0] != 0) {
            int64_t tv[2] = {t.sec, t.nsec / 1000};
            copy_bytes((void *)a[0], tv, sizeof tv);
        }
        return 0;
    }
    if (a[0] != 0) /* time */
        copy_bytes((void *)a[0], &t.sec, sizeof t.sec);
    return t.sec;
}

static int never_rewritten(long nr)
{
    return nr == SYS_rt_sigreturn || nr == SYS_clone || nr == SYS_clone3 || nr == SYS_fork ||
           nr == SYS_vfork || nr == SYS_execve || nr == SYS_execveat;
}

struct ring_call {
    struct lf_state *st;
    long nr;
    const long *a;
};

/* --- synchronisation ---------------------------------------------------------------------
 * The program's pthread mutex, condition variable, read-write lock and barrier operations
 * and its POSIX semaphore operations are records of the lane,
 * in the leader's order (struct lf_order). The leader runs each operation as it comes and
 * records it: an operation that hands something on (unlock, wait's release, signal) before
 * it runs, one that takes something (lock, wait's return) after, with its result. A
 * follower's thread runs it in its turn: a lock then finds the mutex free, as the leader's
 * thread did. A follower never waits on a condition variable: it releases the mutex, and
 * takes it again when the leader's order says the wait returned, with the leader's result
 * (0, or ETIMEDOUT for a timed wait that timed out). Locks glibc takes inside its own code
 * (stdio's, malloc's) are not seen; see take_turn for what happens when one of them is
 * taken in another order in a follower. */
enum {
    SYNC_LOCK = 1,
    SYNC_TRYLOCK,
    SYNC_UNLOCK,
    SYNC_WAIT_ENTER,
    SYNC_WAIT_RETURN,
    SYNC_WAKE,
    SYNC_SEM_WAIT,
    SYNC_SEM_POST,
    SYNC_RDLOCK,
    SYNC_WRLOCK,
    SYNC_RW_UNLOCK,
    SYNC_BARRIER_ARRIVE,
    SYNC_BARRIER_DEPART,
    SYNC_ONCE,
    SYNC_RESUME, /* the serial order: a thread goes on after it blocked, or starts */
    SYNC_CREATE, /* pthread_create, before the real one */
    SYNC_EXIT,   /* a thread's exit */
    SYNC_END,    /* a thread's end, before glibc caches its stack */
    SYNC_OPS
};
/* An operation that takes something (a lock, a semaphore's count): a follower's thread
 * takes it natively after its turn, and holds its place of the order until it has (see
 * take_done). Otherwise a thread whose place comes next could take the same thing first:
 * a new leader's thread, which runs its operations as they come once every place of the
 * old order is done (seen: a deadlock across replicas after a failover). */
static int takes(uint32_t op)
{
    return op == SYNC_LOCK || op == SYNC_TRYLOCK || op == SYNC_RDLOCK || op == SYNC_WRLOCK || op == SYNC_SEM_WAIT ||
           op == SYNC_WAIT_RETURN || op == SYNC_BARRIER_DEPART || op == SYNC_CREATE || op == SYNC_EXIT;
}

#define SYNC_NONE LONG_MIN /* no record: the operation runs natively (no ring, or it is off) */
#define SYNC_MOVED (LONG_MIN + 1) /* the record comes from a new leader (follow_sync's alone) */
/* To a follower's operation: its replica became the leader before the record came (see "a
 * new leader in place"); the wrapper does what the leader does, and records it. */
#define SYNC_PROMOTED (LONG_MIN + 2)

/* --- owned mutexes (the order of every event) --------------------------------------------
 * Most mutex takes of a server are by the thread that took the mutex last (memcached with
 * one worker: nearly all of its 17 ordered events per request). Such a take orders nothing
 * between threads, so in the order of every event it gets no record: each replica notes
 * per mutex which lane took it last (its owner, lf_owners, read and written under the
 * mutex itself), and a take by the owner is only counted (the lane's `takes`). A take by
 * any other lane, and a condition wait's return, is recorded with the lane's take number
 * and `after`: the previous owner and its count of takes at that moment. A follower's
 * thread waits for the previous owner's thread to have made that many takes in its own
 * replica before it takes the mutex, so the owner's unrecorded takes come first there as
 * they did in the leader. A follower learns whether its lane's take y had a record from
 * the leader: once the leader's count passed y, or its next record is out, that record is
 * take y's (it names y) or take y had none. Unlocks have no record: a follower's thread
 * whose turn has come takes the mutex natively, and so waits for the holder's own unlock.
 * Followers keep the owner table too, so that one promoted to leader decides as the old
 * leader would have (the table's contents follow from the order of takes of each mutex,
 * which is the leader's everywhere). The object and serial orders record every operation. */
#define TAKE_LANE_SHIFT 56
#define TAKE_COUNT_MASK ((1ULL << TAKE_LANE_SHIFT) - 1)

static int owned_order(const struct lf_state *st)
{
    return st != NULL && st->hdr != NULL && load32(&st->hdr->sync_order) == SYNC_ORDER_GLOBAL;
}

/* The owner slot of mutex `m`, found or made; NULL when the table has none near its hash. */
static struct lf_owner *owner_of(const void *m)
{
    struct lf_owner *table = lf_owners;
    if (table == NULL)
        return NULL;
    uint64_t addr = (uint64_t)m, home = (addr * 0x9E3779B97F4A7C15ULL) >> 40;
    for (uint32_t probe = 0; probe < OWNER_PROBES; probe++) {
        struct lf_owner *o = &table[(home + probe) % LF_OWNERS];
        uint64_t held = __atomic_load_n(&o->addr, __ATOMIC_ACQUIRE);
        if (held == 0 && __atomic_compare_exchange_n(&o->addr, &held, addr, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            held = addr;
        if (held == addr)
            return o;
    }
    return NULL;
}

/* This lane as an owner in the table (see struct lf_owner). */
static uint64_t owner_tag(const struct lf_state *st) { return ((uint64_t)lf_ring_epoch + 1) << 32 | (st->lane + 1); }

/* A take by this lane of the mutex whose owner slot is `o` (owner_of; NULL: none), done
 * natively (in either role, the mutex held): its owner becomes this lane; returns what a record of it names as `after` (the previous owner and
 * its takes so far; 0: none, or this lane). */
static uint64_t take_ownership(struct lf_state *st, struct lf_owner *o)
{
    if (o == NULL)
        return 0;
    uint64_t tag = owner_tag(st), was = __atomic_load_n(&o->owner, __ATOMIC_RELAXED);
    __atomic_store_n(&o->owner, tag, __ATOMIC_RELAXED);
    uint64_t before = (was >> 32) == (tag >> 32) ? was & 0xffffffffULL : 0; /* lane + 1 */
    if (before == 0 || before - 1 == st->lane || before - 1 >= LF_LANES || lf_lanes == NULL)
        return 0;
    uint64_t count = load(&lane_state(lf_lanes, (uint32_t)(before - 1))->regions[st->me]->h.takes);
    return before << TAKE_LANE_SHIFT | (count & TAKE_COUNT_MASK);
}

/* Whether owner slot `o` names this lane (a take that needs no record). */
static int owns(const struct lf_state *st, const struct lf_owner *o)
{
    return o != NULL && __atomic_load_n(&o->owner, __ATOMIC_RELAXED) == owner_tag(st);
}

/* The lane's take `take` is done (decided, as the leader; made natively, as a follower). */
static void count_take(struct lf_state *st, uint64_t take)
{
    store(&st->regions[st->me]->h.takes, take);
    if (st->me == st->leader)
        return;
    /* A sibling may wait for this count (take_after) */
    struct lf_order *o = st->orders[st->me];
    bump_and_wake(&o->h.object_word, &o->h.object_sleepers);
}

static void wake_followers(struct lf_state *st);

/* The leader's take of a mutex it owns: counted, and followers waiting for it woken as
 * for a record. */
static void lead_owned_take(struct lf_state *st)
{
    struct lf_region_head *h = &st->regions[st->me]->h;
    count_take(st, h->takes + 1);
    store(&h->takes_unrecorded, h->takes_unrecorded + 1);
    wake_followers(st);
}

/* Whether lane `lane`'s thread waits in a futex call in this replica (take_after's
 * holder_blocked). */
static int lane_blocked(struct lf_state *st, uint64_t lane, uint64_t unused_count)
{
    (void)unused_count;
    return lane < LF_LANES && lf_lanes != NULL &&
           load(&lane_state(lf_lanes, (uint32_t)lane)->regions[st->me]->h.in_futex) != 0;
}

/* A follower's thread before a recorded take: until the previous owner's thread made the
 * takes the record's `after` names in this replica (its unrecorded ones among them). */
static void take_after(struct lf_state *st, uint64_t after)
{
    uint64_t lane = (after >> TAKE_LANE_SHIFT) - 1;
    if (after == 0 || lane >= LF_LANES || lane == st->lane || lf_lanes == NULL)
        return;
    struct lf_order *o = st->orders[st->me];
    struct turn_wait t = {&lane_state(lf_lanes, (uint32_t)lane)->regions[st->me]->h.takes, after & TAKE_COUNT_MASK,
                          &o->h.object_word, &o->h.object_sleepers, lane_blocked, lane};
    wait_for_turn(st, &t);
}

/* Whether the leader decided the lane's take `w->take` (its count passed it) or published
 * record `w->target`, which then says whether the take had a record. */
static int take_known(const struct wait_for *w)
{
    if (load(&w->st->regions[w->who]->h.takes) >= w->take)
        return READY;
    return published(w);
}

enum { TAKE_OWNED, TAKE_RECORDED, TAKE_LEADS };

/* A follower's take of a mutex: whether the leader recorded it (TAKE_RECORDED: the
 * record follows, or the ring is off and the caller goes on as without one), took it as
 * the owner (TAKE_OWNED), or this replica leads now (TAKE_LEADS). */
static int follow_take(struct lf_state *st)
{
    uint64_t s = st->seq + 1, take = st->regions[st->me]->h.takes + 1;
    for (;;) {
        uint32_t src = source_to_take(st, s);
        if (src == st->me)
            return TAKE_LEADS;
        struct lf_region *leader = st->regions[src];
        struct wait_for w = {st, src, s, take};
        int got = checked_answer(take_known(&w)); /* mostly: the leader is ahead */
        if (got == NOT_YET)
            got = wait_until(take_known, &w, &leader->h.published_word, WAKE_ON_ANY);
        if (got == MOVED)
            continue;
        if (got != READY)
            return TAKE_RECORDED;
        const struct lf_record *rec = &leader->records[s % LF_SLOTS];
        if (load(&leader->h.published) >= s && load(&rec->seq) == s && rec->kind == KIND_SYNC && rec->sync.take == take)
            return TAKE_RECORDED;
        return load(&leader->h.takes) >= take ? TAKE_OWNED : TAKE_RECORDED;
    }
}

/* `take` and `after`: a mutex take's number and previous owner (see "owned mutexes"). */
static long lead_sync(struct lf_state *st, uint64_t s, uint32_t nr, long ret, uint64_t site, uint64_t object,
                      uint64_t take, uint64_t after)
{
    struct lf_region *own = st->regions[st->me];
    struct lf_record *rec = &own->records[s % LF_SLOTS];
    int got;
    /* A follower in a call the monitor handles comes back (or the monitor switches the
     * ring off): a synchronisation record never goes to the monitor. */
    while ((got = wait_followers(st, slot_free, s)) == GIVE_UP_SLOW)
        futex_wait(&st->regions[st->me]->h.published_word, load32(&st->regions[st->me]->h.published_word));
    if (got != READY || !reuse_slot(st, rec, s))
        return SYNC_NONE;
    test_die_at(st, s, lf_test_die, 0);
    rec->nr = nr;
    rec->kind = KIND_SYNC;
    rec->digest = site;
    rec->ret = ret;
    rec->len = 0;
    rec->signal = 0;
    for (unsigned c = 0; c < LF_CLOCKS; c++)
        rec->clock_sync[c] = 0;
    rec->sync.take = take;
    rec->sync.after = after;
    publish_on(st, rec, s, NULL, NULL, ret, load32(&st->hdr->sync_order) == SYNC_ORDER_OBJECT ? object : 0);
    return ret;
}

static long follow_sync(struct lf_state *st, uint64_t s, uint32_t src, uint32_t nr, uint64_t site)
{
    struct lf_region *own = st->regions[st->me];
    struct lf_region *leader = st->regions[src];
    struct lf_record *rec = &leader->records[s % LF_SLOTS];
    serial_leave(st);
    store(&own->h.awaiting, s);
    struct wait_for w = {st, src, s, 0};
    int got = wait_until(published, &w, &leader->h.published_word, WAKE_ON_ANY);
    store(&own->h.awaiting, 0);
    if (got == MOVED)
        return SYNC_MOVED;
    if (got == CORRUPT)
        report_divergence(s, nr, site, DIVERGED_STATE, 0);
    if (got != READY)
        return SYNC_NONE;
    if (load(&rec->seq) != s || rec->crc != record_crc(rec, s)) {
        report_divergence(s, nr, site, DIVERGED_CRC, 0);
        return SYNC_NONE;
    }
    /* The same operation from the same place in the program (replicas share one layout). */
    if (rec->kind != KIND_SYNC || rec->nr != nr || rec->digest != site) {
        report_divergence(s, nr, site, rec->nr, rec->digest);
        return SYNC_NONE;
    }
    int taking = takes(nr - LF_SYNC_NR_BASE);
    if (taking)
        take_after(st, rec->sync.after);
    take_place(st, rec->order, taking);
    long ret = rec->ret;
    store(&own->h.consumed, s);
    signal_progress(st, &own->h.progress, st->leader, 0);
    return ret;
}

/* A synchronisation record (`nr`: LF_SYNC_NR_BASE + SYNC_*) on the ring stack: the
 * leader's result `a[0]` recorded, or the leader's result taken. `a[1]`: the role the
 * caller took (1: leader); SYNC_PROMOTED (no record taken) when this replica has become
 * the leader for it since. `a[2]`: the program's call site, the record's digest. `a[3]`:
 * the object whose order it takes. `a[4]`, `a[5]`: a mutex take's number and `after`. */
static long sync_call(struct lf_state *st, uint32_t nr, const long *a)
{
    uint64_t s = ++st->seq; /* in every replica, as for a call: the lanes stay aligned */
    note_lane(st->lane);
    for (;;) {
        uint32_t src = source_to_take(st, s);
        int lead_role = src == st->me;
        if (lead_role && a[1] != 1) {
            st->seq = s - 1; /* the wrapper's leader branch records it */
            return SYNC_PROMOTED;
        }
        if (lead_role != (a[1] == 1))
            return SYNC_NONE;
        if (lead_role)
            return lead_sync(st, s, nr, a[0], (uint64_t)a[2], (uint64_t)a[3], (uint64_t)a[4], (uint64_t)a[5]);
        long ret = follow_sync(st, s, src, nr, (uint64_t)a[2]);
        if (ret != SYNC_MOVED)
            return ret;
    }
}

/* The serial order: a place for the thread to go on from, after it blocked without a
 * record of its own or as it starts (a RESUME record, in every replica). */
static void serial_resume(struct lf_state *st)
{
    if (!serial_order(st))
        return;
    long a[6] = {0, st->me == st->leader, 0, 0, 0, 0};
    sync_call(st, LF_SYNC_NR_BASE + SYNC_RESUME, a);
}

/* --- the ring thread's call ------------------------------------------------------------- */

/* The ring thread's call: replicated through the ring, or passed to the monitor. */
static long ring_call(struct ring_call *c)
{
    struct lf_state *st = c->st;
    long nr = c->nr;
    const long *a = c->a;
    if (nr >= (long)LF_SYNC_NR_BASE && nr < (long)LF_SYNC_NR_BASE + SYNC_OPS)
        return sync_call(st, (uint32_t)nr, a);
    if (nr < 0 || nr >= MAX_NR || lf_table[nr].fast == F_SLOW || lf_table[nr].fast == F_LOCAL)
        return slow_call(st, nr, a);
    const struct lf_desc *d = &lf_table[nr];
    note_lane(st->lane);
    if (d->fast == F_CLOCK)
        return clock_call(st, nr, a);
    for (;;) { /* again after a signal's handler (its buffers may have changed) */
        if (st->hdr == NULL) /* the handler ran in a fork of the replica (re-integration) */
            return after_slow_call(lf_raw(nr, a[0], a[1], a[2], a[3], a[4], a[5]));
        uint64_t digest;
        long bound = inspect(nr, d, a, &digest);
        if (bound < 0)
            return slow_call(st, nr, a);
        uint64_t s = ++st->seq;
        uint32_t src = source_to_take(st, s);
        long ret = src == st->me ? lead(st, s, nr, d, a, digest, bound) : follow(st, s, src, nr, d, a, digest);
        if (ret != LF_AGAIN)
            return ret;
    }
}

/* The leader and a follower run different code for the same call. On the program's stack
 * that would leave different bytes below its stack pointer, which a program may pass on
 * uninitialised (glibc's nscd client sends a sockaddr_un with such a tail), so the ring
 * thread's calls run on a stack of the shim's own. A signal handler that runs inside one
 * of them (delivered at a call made through the monitor, or raised for a SIGNAL record)
 * stays on it; so does one on an alternate signal stack (SA_ONSTACK): switching to the
 * top of the ring stack would overwrite the frames the handler interrupted. */
#define RING_STACK (256 * 1024)
long lf_switch_stack(void *p, long (*fn)(void *), void *top);
__asm__(".text\n"
        ".globl lf_switch_stack\n.type lf_switch_stack,@function\nlf_switch_stack:\n"
        "  push %rbp\n  mov %rsp, %rbp\n"
        "  mov %rdx, %rsp\n"
        "  call *%rsi\n"
        "  mov %rbp, %rsp\n  pop %rbp\n"
        "  ret\n");

/* fn(p) on lane `st`'s ring stack, unless the thread is on it already or it is in use
 * further up (see above). */
static long on_stack_of(struct lf_state *st, long (*fn)(void *), void *p)
{
    uintptr_t here = (uintptr_t)__builtin_frame_address(0);
    uintptr_t low = (uintptr_t)st->stack, high = low + RING_STACK;
    if ((here >= low && here < high) || st->stack_busy)
        return fn(p);
    st->stack_busy = 1;
    long ret = lf_switch_stack(p, fn, (void *)high);
    st->stack_busy = 0;
    return ret;
}

static long ring_call_of(void *c) { return ring_call(c); }

static long on_ring_stack(struct ring_call *c) { return on_stack_of(c->st, ring_call_of, c); }

/* Copies of the program's signal masks and actions, edited before the kernel sees them. */
struct mask_copies {
    uint64_t set;
    struct kernel_sigaction act;
    struct {
        uint64_t set, size;
    } pselect;
};

#define SIGSYS_BIT (1ULL << (SIGSYS - 1))

static long sigsys_unblocked(long set_ptr, uint64_t *copy)
{
    if (set_ptr == 0)
        return 0;
    copy_bytes(copy, (const void *)set_ptr, sizeof *copy);
    *copy &= ~SIGSYS_BIT;
    return (long)copy;
}

/* SUD raises SIGSYS at unrewritten sites, and a blocked SIGSYS from SUD is fatal: a mask
 * the program installs (sigprocmask, a handler's sa_mask, the temporary mask of
 * sigsuspend, ppoll, pselect6 and epoll_pwait) never blocks SIGSYS. A handler's return
 * goes through the shim's restorer on page 0, not through libc's `rt_sigreturn` site, and
 * the program cannot replace the shim's SIGSYS handler (the call only reads the action). */
static void keep_sigsys_deliverable(long nr, long *a, struct mask_copies *c)
{
    switch (nr) {
    case SYS_rt_sigprocmask:
        if (a[0] == SIG_BLOCK || a[0] == SIG_SETMASK)
            a[1] = sigsys_unblocked(a[1], &c->set);
        break;
    case SYS_rt_sigaction:
        if (a[1] == 0)
            break;
        if (a[0] == SIGSYS) {
            a[1] = 0;
            break;
        }
        copy_bytes(&c->act, (const void *)a[1], sizeof c->act);
        c->act.mask &= ~SIGSYS_BIT;
        if (c->act.flags & KSA_RESTORER)
            c->act.restorer = (void *)RESTORER;
        a[1] = (long)&c->act;
        break;
    case SYS_rt_sigsuspend:
        a[0] = sigsys_unblocked(a[0], &c->set);
        break;
    case SYS_ppoll:
        a[3] = sigsys_unblocked(a[3], &c->set);
        break;
    case SYS_epoll_pwait:
    case SYS_epoll_pwait2:
        a[4] = sigsys_unblocked(a[4], &c->set);
        break;
    case SYS_pselect6:
        if (a[5] == 0)
            break;
        copy_bytes(&c->pselect, (const void *)a[5], sizeof c->pselect);
        c->pselect.set = (uint64_t)sigsys_unblocked((long)c->pselect.set, &c->set);
        a[5] = (long)&c->pselect;
        break;
    default:
        break;
    }
}

long lf_dispatch(long nr, long a1, long a2, long a3, long a4, long a5, long a6)
{
    lf_selector = lf_test_selector_allow ? SELECTOR_ALLOW : SELECTOR_BLOCK; /* closes an ALLOW window */
    long a[6] = {a1, a2, a3, a4, a5, a6};
    struct mask_copies masks;
    keep_sigsys_deliverable(nr, a, &masks);
    if (nr >= 0 && nr < MAX_NR)
        lf_counts[nr]++;
    struct lf_state *st = lf_my;
    if (st == NULL || st->hdr == NULL) {
        long ret = after_slow_call(lf_raw(nr, a[0], a[1], a[2], a[3], a[4], a[5]));
        note_sigaction(nr, a, &masks.act, ret);
        return ret;
    }
    if (lf_vfork_seen) {
        if (lf_fast(SYS_gettid, 0, 0, 0, 0, 0, 0) != st->owner_tid) {
            st->regions[st->me]->h.bypassed++;
            return lf_raw(nr, a[0], a[1], a[2], a[3], a[4], a[5]); /* a vfork child */
        }
        lf_vfork_seen = 0;
    }
    struct ring_call call = {st, nr, a};
    long ret = on_ring_stack(&call);
    note_sigaction(nr, a, &masks.act, ret);
    return ret;
}

/* Code edits (site rewrites, stubs) happen one at a time: two threads that make the same
 * page writable and read-only again in turn would fault. The holder blocks every signal
 * but SIGSYS meanwhile, so that no handler of the program can interrupt it and wait for
 * the lock on the same thread. */
static int lf_code_lock;

static uint64_t lock_code(void)
{
    uint64_t all = ~SIGSYS_BIT, old = 0;
    lf_fast(SYS_rt_sigprocmask, SIG_BLOCK, (long)&all, (long)&old, sizeof all, 0, 0);
    while (__atomic_exchange_n(&lf_code_lock, 1, __ATOMIC_ACQUIRE))
        cpu_relax();
    return old;
}

static void unlock_code(uint64_t old)
{
    __atomic_store_n(&lf_code_lock, 0, __ATOMIC_RELEASE);
    lf_fast(SYS_rt_sigprocmask, SIG_SETMASK, (long)&old, 0, sizeof old, 0, 0);
}

/* Rewrites the `syscall` that ends at `after` into `call *%rax`. Returns 0 when the site is
 * rewritten, by this call or, meanwhile, by another thread that trapped there too (its
 * call must not run unreplicated from a stub). */
static int rewrite_site(unsigned char *after)
{
    unsigned char *site = after - 2;
    uint64_t mask = lock_code();
    int rewritten = site[0] == 0xff && site[1] == 0xd0;
    if (!rewritten && site[0] == 0x0f && site[1] == 0x05) {
        uintptr_t page = (uintptr_t)site & ~(uintptr_t)4095;
        size_t len = ((uintptr_t)site + 2 > page + 4096) ? 8192 : 4096;
        if (lf_raw(SYS_mprotect, (long)page, (long)len, PROT_READ | PROT_WRITE | PROT_EXEC, 0, 0, 0) == 0) {
            site[0] = 0xff;
            site[1] = 0xd0;
            lf_raw(SYS_mprotect, (long)page, (long)len, PROT_READ | PROT_EXEC, 0, 0, 0);
            lf_sites++;
            rewritten = 1;
        }
    }
    unlock_code(mask);
    return rewritten ? 0 : -1;
}

/* Calls that are never rewritten run from a stub of their own site on page 1 (inside
 * SUD's allowed range): `syscall; movabs $site_end, %r11; jmp *%r11`. The stub returns
 * without the stack, so a clone's child on its new stack and a vfork's child sharing ours
 * come back right. Every such call passes through on_sigsys, which is how a vfork is
 * seen. More sites than stubs: an ALLOW window on the selector, as a fallback. */
#define STUB_PAGE 0x1000UL
#define STUB_SIZE 16
#define MAX_STUBS (4096 / STUB_SIZE)
static uintptr_t lf_stub_sites[MAX_STUBS];
static unsigned lf_stub_count;

static uintptr_t stub_for(uintptr_t site_end)
{
    uintptr_t stub = 0;
    uint64_t mask = lock_code();
    for (unsigned i = 0; i < lf_stub_count && stub == 0; i++)
        if (lf_stub_sites[i] == site_end)
            stub = STUB_PAGE + i * STUB_SIZE;
    if (stub == 0 && lf_stub_count < MAX_STUBS &&
        lf_raw(SYS_mprotect, STUB_PAGE, 4096, PROT_READ | PROT_WRITE, 0, 0, 0) == 0) {
        unsigned char *p = (unsigned char *)(uintptr_t)(STUB_PAGE + lf_stub_count * STUB_SIZE);
        unsigned char code[STUB_SIZE] = {0x0f, 0x05, 0x49, 0xbb, 0, 0, 0, 0, 0, 0, 0, 0, 0x41, 0xff, 0xe3, 0xf4};
        copy_bytes(code + 4, &site_end, 8);
        copy_bytes(p, code, STUB_SIZE);
        lf_raw(SYS_mprotect, STUB_PAGE, 4096, PROT_READ | PROT_EXEC, 0, 0, 0);
        lf_stub_sites[lf_stub_count] = site_end;
        stub = STUB_PAGE + lf_stub_count * STUB_SIZE;
        lf_stub_count++;
    }
    unlock_code(mask);
    return stub;
}

static int vfork_like(long nr, const greg_t *g)
{
    if (nr == SYS_vfork)
        return 1;
    uint64_t flags = 0;
    if (nr == SYS_clone)
        flags = (uint64_t)g[REG_RDI];
    else if (nr == SYS_clone3 && g[REG_RDI] != 0)
        copy_bytes(&flags, (const void *)g[REG_RDI], sizeof flags);
    else
        return 0;
    /* A thread without a TLS of its own would run with this thread's lane as well. */
    return (flags & CLONE_VM) && (!(flags & CLONE_THREAD) || !(flags & CLONE_SETTLS));
}

static void on_sigsys(int sig, siginfo_t *info, void *context)
{
    (void)sig;
    ucontext_t *uc = context;
    greg_t *g = uc->uc_mcontext.gregs;
    if (info->si_code != SI_SYS_USER_DISPATCH)
        return;
    long nr = info->si_syscall;
    unsigned char *after = (unsigned char *)g[REG_RIP];
    if (never_rewritten(nr) || nr < 0 || nr >= MAX_NR || rewrite_site(after) != 0) {
        if (vfork_like(nr, g))
            lf_vfork_seen = 1;
        uintptr_t stub = stub_for((uintptr_t)after);
        g[REG_RAX] = nr;
        if (stub != 0) {
            g[REG_RIP] = (greg_t)stub;
            return;
        }
        /* Run the original instruction again, with SUD letting it through. */
        lf_unrewritable += !never_rewritten(nr);
        lf_windows++;
        lf_selector = SELECTOR_ALLOW;
        g[REG_RIP] -= 2;
        return;
    }
    g[REG_RAX] = lf_dispatch(nr, g[REG_RDI], g[REG_RSI], g[REG_RDX], g[REG_R10], g[REG_R8], g[REG_R9]);
    if (nr == SYS_rt_sigprocmask && g[REG_RAX] == 0) {
        /* The call ran inside this handler, whose return restores the mask saved in its
         * frame: the program's new mask goes into the frame instead. */
        uint64_t now = 0;
        lf_raw(SYS_rt_sigprocmask, SIG_BLOCK, 0, (long)&now, sizeof now, 0, 0);
        copy_bytes(&uc->uc_sigmask, &now, sizeof now);
    }
}

static void report(void)
{
    if (!lf_report)
        return;
    lf_selector = SELECTOR_ALLOW;
    unsigned long total = 0;
    for (int i = 0; i < MAX_NR; i++)
        total += lf_counts[i];
    char line[200];
    int n = snprintf(line, sizeof line,
                     "lockstep-fast: %lu calls through rewritten sites, %lu sites, %lu windows (%lu unrewritable)\n",
                     total, lf_sites, lf_windows, lf_unrewritable);
    if (n > 0)
        lf_raw(SYS_write, 2, (long)line, n < (int)sizeof line ? n : (int)sizeof line - 1, 0, 0, 0);
}

/* Page 0: a nop sled for every syscall number, a jump to lf_entry, the two gates and the
 * signal restorer. Returns 0 when it is mapped (needs CAP_SYS_RAWIO or mmap_min_addr 0). */
static int map_page_zero(void)
{
    unsigned char *zero = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (zero != NULL) {
        if (zero != MAP_FAILED)
            munmap(zero, 4096);
        return -1;
    }
    __asm__("" : "+r"(zero)); /* page 0 is a real mapping here, not a null pointer */
    memset(zero, 0x90, SLED_LEN);
    unsigned char *p = zero + SLED_LEN;
    uint64_t target = (uint64_t)(uintptr_t)lf_entry;
    static const unsigned char gate[] = {0x0f, 0x05, 0xc3};                                 /* syscall; ret */
    static const unsigned char restorer[] = {0xb8, 0x0f, 0x00, 0x00, 0x00, 0x0f, 0x05, 0xf4}; /* rt_sigreturn */
    *p++ = 0x49; /* movabs $lf_entry, %r11; jmp *%r11 */
    *p++ = 0xbb;
    memcpy(p, &target, 8);
    p += 8;
    *p++ = 0x41;
    *p++ = 0xff;
    *p++ = 0xe3;
    memcpy(zero + LF_GATE_FAST, gate, sizeof gate);
    memcpy(zero + GATE_SLOW, gate, sizeof gate);
    memcpy(zero + RESTORER, restorer, sizeof restorer);
    if (mprotect(zero, 4096, PROT_READ | PROT_EXEC) != 0)
        return -1;
    void *stubs = mmap((void *)STUB_PAGE, 4096, PROT_READ | PROT_EXEC, MAP_FIXED_NOREPLACE | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return stubs == (void *)STUB_PAGE ? 0 : -1;
}

static void *map_shared(int fd, uint64_t offset, uint64_t len, int prot)
{
    long addr = lf_fast(SYS_mmap, 0, (long)len, prot, MAP_SHARED, fd, (long)offset);
    if (addr < 0 && addr > -4096)
        return NULL;
    lf_fast(SYS_madvise, addr, (long)len, MADV_DONTFORK, 0, 0, 0); /* a child never writes it */
    lf_fast(SYS_MSEAL, addr, (long)len, 0, 0, 0, 0);               /* nor can a wild mprotect */
    return (void *)addr;
}

/* Each lane's state has a page of its own. */
static struct lf_state *lane_state(struct lf_state *lanes, uint32_t lane)
{
    _Static_assert(sizeof(struct lf_state) <= 4096, "a lane's state fits its page");
    return (struct lf_state *)((unsigned char *)lanes + lane * 4096);
}

static long hello(long op, long last)
{
    return lf_raw(LF_SYS_FAST, op, LF_VERSION, sizeof(struct lf_header), sizeof(struct lf_record), sizeof(struct lf_region),
                  last);
}

/* The lanes' ring stacks, made once per process (kept across epochs). */
static int make_ring_stacks(void)
{
    if (lf_ring_stacks != NULL)
        return 0;
    const long one = RING_STACK + 4096;
    long stacks = lf_fast(SYS_mmap, 0, one * LF_LANES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (stacks < 0 && stacks > -4096)
        return -1;
    for (unsigned lane = 0; lane < LF_LANES; lane++)
        lf_fast(SYS_mprotect, stacks + lane * one, 4096, PROT_NONE, 0, 0, 0);
    lf_ring_stacks = (unsigned char *)stacks;
    return 0;
}

/* Attaches ring `epoch` of the list through lane 0, and lays out every lane of it. Every
 * call here goes through the fast gate, so the replicas do it on their own (same fds, same
 * addresses), except the hello, which meets the monitor and returns this replica's number
 * in that ring. */
/* Lane `lane`'s signal mailbox in the ring's header page. */
static const volatile struct lf_mailbox *mailbox_of(const struct lf_header *hdr, uint32_t lane)
{
    return (const volatile struct lf_mailbox *)((const unsigned char *)hdr + LF_MAILBOX_OFFSET) + lane;
}

static void attach_ring(uint32_t epoch)
{
    if (epoch >= lf_ring_count)
        return;
    lf_ring_epoch = epoch;
    long fd = lf_fast(SYS_openat, AT_FDCWD, (long)lf_ring_paths[epoch], O_RDWR | O_CLOEXEC, 0, 0, 0);
    if (fd < 0)
        return;
    struct lf_header *hdr = map_shared((int)fd, 0, LF_HEADER_SIZE, PROT_READ);
    long me = -1;
    uint32_t seen[LF_LANES]; /* before the hello: a signal posted after it is new */
    if (hdr != NULL && hdr->magic == RING_MAGIC && hdr->version == LF_VERSION && hdr->replicas <= LF_MAX_REPLICAS &&
        hdr->region_size >= sizeof(struct lf_region) && hdr->epoch == epoch && hdr->lanes == LF_LANES &&
        hdr->orders_offset >= hdr->regions_offset + LF_MAX_REPLICAS * LF_LANES * hdr->region_size) {
        for (uint32_t lane = 0; lane < LF_LANES; lane++)
            seen[lane] = __atomic_load_n(&mailbox_of(hdr, lane)->request, __ATOMIC_ACQUIRE);
        me = hello(OP_HELLO, (long)&lf_reattach_to);
    }
    const long states_len = LF_LANES * 4096;
    long states = lf_fast(SYS_mmap, 0, states_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (me < 0 || (me >> LF_HELLO_LANE_SHIFT) != 0 || (me & 0xff) >= (long)hdr->replicas ||
        (states < 0 && states > -4096) || make_ring_stacks() != 0) {
        lf_fast(SYS_close, fd, 0, 0, 0, 0, 0);
        return;
    }
    lf_fast(SYS_madvise, states, states_len, MADV_WIPEONFORK, 0, 0, 0);
    long owners = (long)lf_owners;
    if (owners == 0) {
        const long owners_len = LF_OWNERS * sizeof(struct lf_owner);
        owners = lf_fast(SYS_mmap, 0, owners_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (owners < 0 && owners > -4096)
            owners = 0; /* every take recorded: as correct, slower */
        else
            lf_fast(SYS_madvise, owners, owners_len, MADV_WIPEONFORK, 0, 0, 0);
    }
    struct lf_clock *clocks =
        map_shared((int)fd, hdr->clocks_offset, hdr->regions_offset - hdr->clocks_offset, PROT_READ | PROT_WRITE);
    unsigned char *regions[LF_MAX_REPLICAS];
    struct lf_order *orders[LF_MAX_REPLICAS];
    int ok = clocks != NULL && hdr->doorbell_offset >= hdr->clocks_offset + LF_LANES * hdr->clocks_size &&
             hdr->doorbell_offset + sizeof(uint32_t) <= hdr->regions_offset;
    const uint64_t replica_len = LF_LANES * hdr->region_size;
    for (uint32_t r = 0; r < hdr->replicas; r++) {
        int prot = r == (uint32_t)me ? PROT_READ | PROT_WRITE : PROT_READ;
        regions[r] = map_shared((int)fd, hdr->regions_offset + r * replica_len, replica_len, prot);
        orders[r] = map_shared((int)fd, hdr->orders_offset + r * LF_ORDER_SIZE, LF_ORDER_SIZE, prot);
        ok = ok && regions[r] != NULL && orders[r] != NULL;
    }
    lf_fast(SYS_close, fd, 0, 0, 0, 0, 0);
    if (!ok)
        return;
    struct lf_state *lanes = (struct lf_state *)states;
    for (uint32_t lane = 0; lane < LF_LANES; lane++) {
        struct lf_state *st = lane_state(lanes, lane);
        st->lane = lane;
        st->stack = lf_ring_stacks + lane * (RING_STACK + 4096) + 4096;
        st->me = (uint32_t)me;
        st->leader = hdr->leader;
        st->replicas = hdr->replicas;
        /* A replica that shares its CPU with another never spins: the one it waits for (or
         * the one that waits for it) may need that CPU. */
        st->spin = hdr->spin;
        st->spin_budget = hdr->spin;
        for (uint32_t r = 0; r < st->replicas; r++)
            if (r != st->me && hdr->cpu[st->me] >= 0 && hdr->cpu[r] == hdr->cpu[st->me])
                st->spin = 0;
        st->mailbox = mailbox_of(hdr, lane);
        st->answer = (volatile struct lf_commit_answer *)((unsigned char *)hdr + LF_COMMIT_OFFSET) + lane;
        st->doorbell = (volatile uint32_t *)((unsigned char *)clocks + (hdr->doorbell_offset - hdr->clocks_offset));
        st->signal_seen = seen[lane];
        st->clocks = (struct lf_clock *)((unsigned char *)clocks + lane * hdr->clocks_size);
        for (uint32_t r = 0; r < st->replicas; r++) {
            st->regions[r] = (struct lf_region *)(regions[r] + lane * hdr->region_size);
            st->orders[r] = orders[r];
        }
        st->hdr = hdr;
    }
    lanes[0].owner_tid = lf_fast(SYS_gettid, 0, 0, 0, 0, 0, 0);
    if (serial_order(&lanes[0]) && lanes[0].me == lanes[0].leader)
        token_take(&lanes[0]); /* the ring thread runs the program's code from here */
    lf_lanes = lanes;
    lf_owners = (struct lf_owner *)owners;
    lf_my = &lanes[0];
    lf_ring_thread = 1;
    /* A replica forked by re-integration does not inherit Syscall User Dispatch: turn it on
     * again (a no-op in the others), or its calls from sites not rewritten yet would go to
     * the monitor while the others' take the ring. */
    if (epoch > 0 && lf_active)
        lf_fast(SYS_prctl, PR_SET_SYSCALL_USER_DISPATCH, PR_SYS_DISPATCH_ON, 0, STUB_PAGE + 4096, (long)&lf_selector, 0);
}

/* A thread the program started, before its own start routine: it asks the monitor for a
 * lane of the ring in use (the monitor matches threads across replicas by creation order,
 * so each replica's copy gets the same lane) and turns Syscall User Dispatch on for itself
 * (a new thread does not inherit it), so that every call it makes comes through the shim.
 * Without a lane it goes to the monitor for every call, as before. */
static void attach_thread(void)
{
    struct lf_state *lanes = lf_lanes;
    /* Without a ring ever attached, the same in every replica: nothing to ask. A process
     * whose ring a fork wiped asks too: a replica forked by re-integration is one, and
     * the replicas it joins ask (their ring is off: no lane for anyone). */
    if (!lf_active || lanes == NULL)
        return;
    /* Before the hello: a signal the monitor posts for this lane after it is new. */
    uint32_t seen[LF_LANES];
    for (uint32_t k = 0; k < LF_LANES; k++)
        seen[k] = lanes[0].hdr == NULL ? 0 : __atomic_load_n(&lane_state(lanes, k)->mailbox->request, __ATOMIC_ACQUIRE);
    long ret = hello(OP_HELLO_THREAD, lf_ring_epoch);
    long lane = ret >> LF_HELLO_LANE_SHIFT;
    if (ret < 0 || lane <= 0 || lane >= (long)LF_LANES || (uint32_t)(ret & 0xff) != lanes[0].me || lanes[0].hdr == NULL)
        return;
    struct lf_state *st = lane_state(lanes, (uint32_t)lane);
    st->owner_tid = lf_fast(SYS_gettid, 0, 0, 0, 0, 0, 0);
    st->tid_word = glibc_tid_word(st->owner_tid);
    st->exiting = 0; /* a lane is free again once its last thread is gone everywhere */
    st->end = 0;
    if (lf_end_key_ok)
        pthread_setspecific(lf_end_key, st); /* a key below 32: no allocation */
    st->signal_seen = seen[lane];
    lf_my = st;
    if (lf_fast(SYS_prctl, PR_SET_SYSCALL_USER_DISPATCH, PR_SYS_DISPATCH_ON, 0, STUB_PAGE + 4096, (long)&lf_selector, 0) ==
        0)
        lf_selector = lf_test_selector_allow ? SELECTOR_ALLOW : SELECTOR_BLOCK;
}

/* pthread_create, so that each new thread attaches to the ring before the program's code
 * runs in it (a deterministic point, the same in every replica). Threads made with a bare
 * clone go to the monitor.
 *
 * The start routine and its argument travel in a slot of a fixed table, not on the heap:
 * a free() in the new thread would make glibc set up that thread's malloc arena there,
 * whose first-time `openat` of /sys/devices/system/cpu/online lands in whichever thread
 * gets there first, which differs between replicas. A parent that finds every slot taken
 * (that many threads created and not started yet) waits for one. */
#define START_SLOTS 64
struct thread_start {
    void *(*routine)(void *);
    void *arg;
    int taken;
};
static struct thread_start lf_starts[START_SLOTS];

static struct thread_start *take_start_slot(void)
{
    for (;;) {
        for (unsigned i = 0; i < START_SLOTS; i++)
            if (!__atomic_load_n(&lf_starts[i].taken, __ATOMIC_RELAXED) &&
                !__atomic_exchange_n(&lf_starts[i].taken, 1, __ATOMIC_ACQUIRE))
                return &lf_starts[i];
        lf_fast(SYS_sched_yield, 0, 0, 0, 0, 0, 0);
    }
}

/* --- thread exits and glibc's stack cache -----------------------------------------------
 * glibc keeps the stacks of detached threads that ended in a list (its stack cache), in
 * the order they came, and pthread_create takes the first one in it whose thread the
 * kernel has marked gone (its tid word cleared, after the thread's last instruction); an
 * ending thread also unmaps cached stacks of threads gone when the cache is over its
 * limit. Which stack a new thread got, and which mmap and munmap calls were made, thus
 * depended on timing and differed between replicas (seen: a follower's mmap where the
 * leader made none; with CPython's threads under the serial order the follower then
 * waited for a record the leader never made, 7 runs of 70). So:
 * - the monitor lifts the cache's limit (GLIBC_TUNABLES, FastPath::environment): no stack
 *   is unmapped as a thread ends;
 * - a thread's end (SYNC_END, end_thread) takes a number in the order, and its thread
 *   caches its stack after the thread of the end before has: the list's order is the same
 *   everywhere;
 * - a thread's exit (SYNC_EXIT, its last event) marks its lane `exiting` in its turn, and
 *   a pthread_create (SYNC_CREATE) waits, in every replica, until the thread of every lane
 *   so marked is gone. A follower's create holds its place until the real call has chosen
 *   a stack (as an operation that takes something does), so that an exit later in the
 *   order cannot come first there; the leader, which runs its operations as they come,
 *   holds lf_create_lock from a create's record to the real call's return, and an exit
 *   takes it for its record. An exit has no event after it: the create waits for nothing
 *   that needs a place.
 * Not covered: threads without a lane, and stacks cached by pthread_join (in the joiner). */
static volatile uint32_t lf_create_lock;

static void create_unlock(void)
{
    __atomic_store_n(&lf_create_lock, 0, __ATOMIC_RELEASE);
    futex_wake(&lf_create_lock);
}

/* glibc's tid word of the calling thread (struct pthread's `tid`, at GLIBC_TID_OFFSET
 * from the thread pointer in glibc 2.x on x86-64), or NULL when `tid` is not there. */
#define GLIBC_TID_OFFSET 0x2d0
static volatile pid_t *glibc_tid_word(long tid)
{
    char *self;
    __asm__("mov %%fs:0x10, %0" : "=r"(self));
    volatile pid_t *word = (volatile pid_t *)(self + GLIBC_TID_OFFSET);
    return self != NULL && *word == tid ? word : NULL;
}

/* Event `op` (no object, result 0) of the calling thread, on its ring stack, in its
 * replica's role: as the leader with lf_create_lock taken first (returns 1: the caller
 * gives it back), as a follower holding its place (returns 0). */
struct lane_event {
    struct lf_state *st;
    uint32_t op;
    const void *site;
};

static long lane_event_body(void *v)
{
    struct lane_event *e = v;
    struct lf_state *st = e->st;
    long a[6] = {0, 0, (long)e->site, 0, 0, 0};
    serial_leave(st); /* not while it waits for the lock (an exit needs the token) */
    if (source_to_take(st, st->seq + 1) != st->me && sync_call(st, LF_SYNC_NR_BASE + e->op, a) != SYNC_PROMOTED)
        return 0;
    while (__atomic_exchange_n(&lf_create_lock, 1, __ATOMIC_ACQUIRE) != 0)
        futex_wait(&lf_create_lock, 1);
    a[1] = 1;
    sync_call(st, LF_SYNC_NR_BASE + e->op, a);
    return 1;
}

static int lane_event(struct lf_state *st, uint32_t op, const void *site)
{
    struct lane_event e = {st, op, site};
    return (int)(st->stack == NULL ? lane_event_body(&e) : on_stack_of(st, lane_event_body, &e));
}

/* After lane_event's event: lf_create_lock, or the follower's place, given back. */
static void lane_event_done(int led)
{
    if (led)
        create_unlock();
    else
        take_done();
}

/* The last thread end whose thread has cached its stack (see end_thread). */
static volatile uint32_t lf_ends_cached;

/* The calling thread's exit, in its turn (its last event): from there on its lane is
 * `exiting` here. Its stack is cached: the next end's thread may cache its own. */
static void exit_in_turn(struct lf_state *st)
{
    if (st->hdr == NULL)
        return;
    if (st->end != 0) {
        __atomic_store_n(&lf_ends_cached, (uint32_t)st->end, __ATOMIC_RELEASE);
        futex_wake(&lf_ends_cached);
    }
    int led = lane_event(st, SYNC_EXIT, NULL);
    __atomic_store_n(&st->exiting, 1, __ATOMIC_RELEASE);
    lane_event_done(led);
}

/* Until the thread of every lane marked `exiting` is gone from this replica: its tid word
 * no longer holds its tid (cleared, or the stack reused or unmapped: futex says EAGAIN or
 * EFAULT, where a plain read could fault). */
static void await_exited_threads(void)
{
    for (uint32_t lane = 1; lane < LF_LANES; lane++) {
        struct lf_state *t = lane_state(lf_lanes, lane);
        if (!__atomic_load_n(&t->exiting, __ATOMIC_ACQUIRE))
            continue;
        long r = 0;
        while (t->tid_word != NULL && r != -EAGAIN && r != -EFAULT)
            r = futex_wait_result((volatile uint32_t *)t->tid_word, (uint32_t)t->owner_tid);
        __atomic_store_n(&t->exiting, 0, __ATOMIC_RELAXED); /* gone: not looked at again */
    }
}

/* A pthread_create's event, then every thread whose exit came before it gone; returns
 * whether it led (lf_create_lock taken) or holds its place as a follower, which the
 * caller gives back after the real call. */
static int create_in_turn(struct lf_state *st, const void *site)
{
    int led = lane_event(st, SYNC_CREATE, site);
    await_exited_threads();
    return led;
}

static long resume_body(void *st) { return serial_resume(st), 0; }
static long leave_body(void *st) { return serial_leave(st), 0; }

/* serial_leave or serial_resume for the calling thread, on its lane's stack (the leader
 * and a follower run different code there). */
static void serial_step(long (*body)(void *))
{
    struct lf_state *st = lf_my;
    if (serial_order(st) && st->stack != NULL)
        on_stack_of(st, body, st);
}

/* A thread's end, from its thread-specific value's destructor, which glibc runs before it
 * puts a detached thread's stack into its cache: that cache is a list, in the order the
 * stacks came, and pthread_create takes the first free stack in it, so the stacks must come
 * in the same order everywhere. The end takes the next number in its turn, and the thread
 * goes on once the thread of the end before has cached its stack and is at its exit call
 * (exit_in_turn), without holding a place meanwhile. */
static uint64_t lf_ends;

static void end_thread(void *v)
{
    struct lf_state *st = v;
    if (st != lf_my || st->hdr == NULL || st->end != 0)
        return;
    int led = lane_event(st, SYNC_END, NULL);
    st->end = ++lf_ends; /* in the order: under lf_create_lock, or in the follower's place */
    lane_event_done(led);
    serial_step(leave_body);
    /* (past 2^32 ends the numbers no longer fit the futex word: no wait) */
    for (uint32_t now; st->end <= UINT32_MAX && (now = __atomic_load_n(&lf_ends_cached, __ATOMIC_ACQUIRE)) < st->end - 1;)
        futex_wait(&lf_ends_cached, now);
    serial_step(resume_body); /* the program's other destructors may follow */
}

static void *start_thread_with_lane(void *p)
{
    struct thread_start *slot = p;
    void *(*routine)(void *) = slot->routine;
    void *arg = slot->arg;
    __atomic_store_n(&slot->taken, 0, __ATOMIC_RELEASE);
    lf_attach_tried = 1;
    attach_thread();
    struct lf_state *st = lf_my;
    if (serial_order(st))
        on_stack_of(st, resume_body, st); /* its first place, before any of the program's code */
    return routine(arg);
}

typedef int (*pthread_create_fn)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);

int pthread_create(pthread_t *thread, const pthread_attr_t *attr, void *(*routine)(void *), void *arg)
{
    static pthread_create_fn real;
    if (real == NULL)
        real = (pthread_create_fn)dlsym(RTLD_NEXT, "pthread_create");
    if (real == NULL)
        return EAGAIN;
    if (!lf_active || lf_lanes == NULL || lf_lanes[0].hdr == NULL)
        return real(thread, attr, routine, arg);
    struct thread_start *slot = take_start_slot();
    slot->routine = routine;
    slot->arg = arg;
    struct lf_state *st = lf_my;
    int ordered = st != NULL && st->hdr != NULL;
    int led = ordered && create_in_turn(st, __builtin_return_address(0));
    int err = real(thread, attr, start_thread_with_lane, slot);
    if (err != 0)
        __atomic_store_n(&slot->taken, 0, __ATOMIC_RELEASE);
    if (ordered)
        lane_event_done(led);
    return err;
}

/* --- the program's synchronisation operations (see "synchronisation" above) ------------- */

enum { ROLE_NONE, ROLE_LEAD, ROLE_FOLLOW };

/* Whether the calling thread records its operations, and as which. Independent of `off`,
 * which every replica may see at a different moment: the record (or its absence) decides. */
static int sync_role(void)
{
    if (!lf_active)
        return ROLE_NONE;
    if (lf_my == NULL && !lf_attach_tried) {
        /* A thread started without our pthread_create (a library that found the real one
         * with dlsym(RTLD_NEXT), as jemalloc does for its background threads): its
         * operations would race with the ordered ones of every other thread, so it asks
         * for a lane at its first operation, a point as deterministic as its start. */
        lf_attach_tried = 1;
        attach_thread();
    }
    struct lf_state *st = lf_my;
    if (st == NULL || st->hdr == NULL)
        return ROLE_NONE;
    if (lf_vfork_seen && lf_fast(SYS_gettid, 0, 0, 0, 0, 0, 0) != st->owner_tid)
        return ROLE_NONE; /* a vfork child */
    return source_to_take(st, st->seq + 1) == st->me ? ROLE_LEAD : ROLE_FOLLOW;
}

/* One operation's arguments. The operations run on the lane's ring stack: the leader and
 * a follower run different code for the same operation, which on the program's stack would
 * leave different bytes below its stack pointer (see RING_STACK). */
struct sync_args {
    void *obj;  /* the mutex, condition variable or semaphore */
    void *obj2; /* a condition variable's mutex */
    const void *arg;
    int (*native_sem)(sem_t *, const void *);
    void *volatile *slot; /* the real function, for signal and broadcast */
    const char *name;
    const void *site; /* where the program called the operation (its return address) */
    int variant;      /* read-write locks: RW_BLOCKING, RW_TRY, RW_TIMED or RW_CLOCK */
    clockid_t clock;  /* RW_CLOCK's clock */
};

/* Operation `op` as a record of the thread's lane: the leader's result `ret` recorded, or
 * (a follower) the leader's result once it is this thread's turn; SYNC_NONE without one.
 * `take`, `after`: a mutex take's, as the leader records it (see "owned mutexes"). */
static long take_event(const struct sync_args *p, int op, long ret, int role, uint64_t take, uint64_t after)
{
    /* A condition variable's wait hands on and takes back its mutex. */
    const void *object = op == SYNC_WAIT_ENTER || op == SYNC_WAIT_RETURN ? p->obj2 : p->obj;
    long a[6] = {ret, role == ROLE_LEAD, (long)p->site, (long)object, (long)take, (long)after};
    struct ring_call call = {lf_my, (long)LF_SYNC_NR_BASE + op, a};
    return on_ring_stack(&call);
}

static long sync_event(const struct sync_args *p, int op, long ret, int role)
{
    return take_event(p, op, ret, role, 0, 0);
}



/* A follower's operation that takes something ran natively: its place is done (in the
 * serial order the thread keeps it to its next event). */
static void take_done(void)
{
    struct lf_state *st = lf_my;
    if (st != NULL && !serial_order(st))
        serial_leave(st);
}

/* An operation that hands something on: its record (result 0 in either role) before the
 * native call, as the leader's if this replica became the leader meanwhile. */
static void hand_on(const struct sync_args *p, int op, int role)
{
    if (role != ROLE_NONE && sync_event(p, op, 0, role) == SYNC_PROMOTED)
        sync_event(p, op, 0, ROLE_LEAD);
}

/* The next definition of a libc function (`version`: NULL for the default one). */
static void *real_fn(void *volatile *slot, const char *name, const char *version)
{
    void *fn = *slot;
    if (fn == NULL) {
        fn = version != NULL ? dlvsym(RTLD_NEXT, name, version) : dlsym(RTLD_NEXT, name);
        if (fn == NULL)
            fn = dlsym(RTLD_NEXT, name);
        *slot = fn;
    }
    return fn;
}

typedef int (*mutex_fn)(pthread_mutex_t *);
typedef int (*cond_fn)(pthread_cond_t *);
typedef int (*cond_wait_fn)(pthread_cond_t *, pthread_mutex_t *);
typedef int (*cond_timedwait_fn)(pthread_cond_t *, pthread_mutex_t *, const struct timespec *);
typedef int (*sem_fn)(sem_t *);
typedef int (*sem_timed_fn)(sem_t *, const struct timespec *);
typedef int (*sem_clock_fn)(sem_t *, clockid_t, const struct timespec *);
static void *volatile lf_real_lock, *volatile lf_real_trylock, *volatile lf_real_unlock;
static void *volatile lf_real_wait, *volatile lf_real_timedwait, *volatile lf_real_signal, *volatile lf_real_broadcast;
static void *volatile lf_real_sem_wait, *volatile lf_real_sem_trywait, *volatile lf_real_sem_timedwait,
    *volatile lf_real_sem_clockwait, *volatile lf_real_sem_post;
#define REAL_LOCK ((mutex_fn)real_fn(&lf_real_lock, "pthread_mutex_lock", NULL))
#define REAL_TRYLOCK ((mutex_fn)real_fn(&lf_real_trylock, "pthread_mutex_trylock", NULL))
#define REAL_UNLOCK ((mutex_fn)real_fn(&lf_real_unlock, "pthread_mutex_unlock", NULL))
#define REAL_SEM_WAIT ((sem_fn)real_fn(&lf_real_sem_wait, "sem_wait", NULL))
#define COND_VERSION "GLIBC_2.3.2" /* the condition variables of today's glibc, not 2.2.5's */


static long on_lane_stack(long (*body)(void *), struct sync_args *p)
{
    struct lf_state *st = lf_my;
    lf_in_native++;
    long ret = st == NULL || st->stack == NULL ? body(p) : on_stack_of(st, body, p);
    lf_in_native--;
    return ret;
}

/* A lock the leader's thread took (result 0, or EOWNERDEAD for a robust mutex whose owner
 * died): the follower's thread takes it too, in its turn, where it is free. */
static int lock_taken(long ret) { return ret == 0 || ret == EOWNERDEAD; }

/* The leader's record of a mutex take (lock, trylock, a wait's return; `ret` its result,
 * `taken` whether it holds `m` now): none when this lane owns the mutex already (see
 * "owned mutexes"), else one that names the previous owner; counted once it is out. */
static void lead_take(const struct sync_args *p, int op, long ret, pthread_mutex_t *m, int taken)
{
    struct lf_state *st = lf_my;
    if (!owned_order(st)) {
        sync_event(p, op, ret, ROLE_LEAD);
        return;
    }
    uint64_t take = st->regions[st->me]->h.takes + 1;
    if (!taken) { /* a trylock that failed, an error */
        take_event(p, op, ret, ROLE_LEAD, take, 0);
        return;
    }
    struct lf_owner *o = owner_of(m);
    if (ret == 0 && op == SYNC_LOCK && owns(st, o)) {
        lead_owned_take(st);
        return;
    }
    take_event(p, op, ret, ROLE_LEAD, take, take_ownership(st, o));
    count_take(st, take);
}

/* A follower's thread took `m` natively for its lane's next take. */
static void follower_took(pthread_mutex_t *m)
{
    struct lf_state *st = lf_my;
    if (!owned_order(st))
        return;
    take_ownership(st, owner_of(m));
    count_take(st, st->regions[st->me]->h.takes + 1);
}

/* lock and trylock: `op` SYNC_LOCK or SYNC_TRYLOCK. */
static long lock_op(struct sync_args *p, int op, mutex_fn native)
{
    pthread_mutex_t *m = p->obj;
    int role = sync_role();
    if (role == ROLE_FOLLOW && op == SYNC_LOCK && owned_order(lf_my)) {
        int take = follow_take(lf_my);
        if (take == TAKE_OWNED) {
            REAL_LOCK(m); /* nobody else took it in the leader since this thread did */
            follower_took(m);
            return 0;
        }
        if (take == TAKE_LEADS)
            role = ROLE_LEAD;
    }
    if (role == ROLE_FOLLOW) {
        long ret = sync_event(p, op, 0, role);
        if (ret == SYNC_NONE)
            return native(m);
        if (ret != SYNC_PROMOTED) {
            if (lock_taken(ret)) {
                REAL_LOCK(m); /* free in its turn, or about to be */
                follower_took(m);
            }
            take_done();
            return ret;
        }
        role = ROLE_LEAD;
    }
    if (role == ROLE_LEAD && op == SYNC_LOCK)
        serial_leave(lf_my);
    int ret = native(m);
    if (role == ROLE_LEAD)
        lead_take(p, op, ret, m, lock_taken(ret));
    return ret;
}

static long lock_body(void *p) { return lock_op(p, SYNC_LOCK, REAL_LOCK); }
static long trylock_body(void *p) { return lock_op(p, SYNC_TRYLOCK, REAL_TRYLOCK); }

static long unlock_body(void *v)
{
    struct sync_args *p = v;
    if (!owned_order(lf_my)) /* see "owned mutexes": the next taker's native lock waits for it */
        hand_on(p, SYNC_UNLOCK, sync_role());
    return REAL_UNLOCK(p->obj);
}

static int native_wait(pthread_cond_t *c, pthread_mutex_t *m, const struct timespec *abstime)
{
    if (abstime == NULL)
        return ((cond_wait_fn)real_fn(&lf_real_wait, "pthread_cond_wait", COND_VERSION))(c, m);
    return ((cond_timedwait_fn)real_fn(&lf_real_timedwait, "pthread_cond_timedwait", COND_VERSION))(c, m, abstime);
}

/* Two records: the release of the mutex as the wait starts, and the wait's return. A
 * follower waits for nothing but the second: the leader's order says when the wait
 * returned, and how. */
static long cond_wait_body(void *v)
{
    struct sync_args *p = v;
    pthread_cond_t *c = p->obj;
    pthread_mutex_t *m = p->obj2;
    int role = sync_role();
    if (role == ROLE_NONE)
        return native_wait(c, m, p->arg);
    long entered = sync_event(p, SYNC_WAIT_ENTER, 0, role);
    if (entered == SYNC_PROMOTED) {
        role = ROLE_LEAD;
        entered = sync_event(p, SYNC_WAIT_ENTER, 0, role);
    }
    if (role == ROLE_FOLLOW && entered != SYNC_NONE) {
        REAL_UNLOCK(m);
        long ret = sync_event(p, SYNC_WAIT_RETURN, 0, role);
        REAL_LOCK(m);
        if (ret == SYNC_PROMOTED) { /* this replica leads now: a spurious wake-up, recorded */
            take_done();
            lead_take(p, SYNC_WAIT_RETURN, 0, m, 1);
            return 0;
        }
        if (ret != SYNC_NONE)
            follower_took(m);
        take_done();
        return ret == SYNC_NONE ? 0 : ret; /* without the leader's word: a spurious wake-up */
    }
    serial_leave(lf_my);
    int ret = native_wait(c, m, p->arg);
    if (role == ROLE_LEAD)
        lead_take(p, SYNC_WAIT_RETURN, ret, m, 1);
    else
        sync_event(p, SYNC_WAIT_RETURN, ret, role);
    return ret;
}

static long wake_body(void *v)
{
    struct sync_args *p = v;
    cond_fn real = (cond_fn)real_fn(p->slot, p->name, COND_VERSION);
    hand_on(p, SYNC_WAKE, sync_role());
    return real(p->obj);
}

/* Read-write locks: as mutexes. A try or timed variant (`p->variant`) succeeds or fails
 * (EBUSY, ETIMEDOUT) as the leader's did; a follower that is to succeed takes the lock
 * with the blocking call, in its turn. */
enum { RW_BLOCKING, RW_TRY, RW_TIMED, RW_CLOCK, RW_VARIANTS };
typedef int (*rwlock_fn)(pthread_rwlock_t *);
typedef int (*rwlock_timed_fn)(pthread_rwlock_t *, const struct timespec *);
typedef int (*rwlock_clock_fn)(pthread_rwlock_t *, clockid_t, const struct timespec *);
static void *volatile lf_real_rw[2][RW_VARIANTS];
static const char *const lf_rw_names[2][RW_VARIANTS] = {
    {"pthread_rwlock_rdlock", "pthread_rwlock_tryrdlock", "pthread_rwlock_timedrdlock", "pthread_rwlock_clockrdlock"},
    {"pthread_rwlock_wrlock", "pthread_rwlock_trywrlock", "pthread_rwlock_timedwrlock", "pthread_rwlock_clockwrlock"},
};
static void *volatile lf_real_rw_unlock, *volatile lf_real_barrier_wait;

static void *rw_real(int write, int variant) { return real_fn(&lf_real_rw[write][variant], lf_rw_names[write][variant], NULL); }

/* The program's own call, as it made it. */
static int rw_native(const struct sync_args *p, int write)
{
    pthread_rwlock_t *l = p->obj;
    switch (p->variant) {
    case RW_TIMED:
        return ((rwlock_timed_fn)rw_real(write, RW_TIMED))(l, p->arg);
    case RW_CLOCK:
        return ((rwlock_clock_fn)rw_real(write, RW_CLOCK))(l, p->clock, p->arg);
    default:
        return ((rwlock_fn)rw_real(write, p->variant == RW_TRY ? RW_TRY : RW_BLOCKING))(l);
    }
}

static long rw_op(struct sync_args *p, int write)
{
    int op = write ? SYNC_WRLOCK : SYNC_RDLOCK;
    int role = sync_role();
    if (role == ROLE_FOLLOW) {
        long ret = sync_event(p, op, 0, role);
        if (ret == SYNC_NONE)
            return rw_native(p, write);
        if (ret != SYNC_PROMOTED) {
            if (ret == 0)
                ((rwlock_fn)rw_real(write, RW_BLOCKING))(p->obj); /* free for us in its turn, or about to be */
            take_done();
            return ret;
        }
        role = ROLE_LEAD;
    }
    if (role == ROLE_LEAD && p->variant != RW_TRY)
        serial_leave(lf_my);
    int ret = rw_native(p, write);
    if (role == ROLE_LEAD)
        sync_event(p, op, ret, role);
    return ret;
}

static long rdlock_body(void *v) { return rw_op(v, 0); }
static long wrlock_body(void *v) { return rw_op(v, 1); }

static long rw_unlock_body(void *v)
{
    struct sync_args *p = v;
    hand_on(p, SYNC_RW_UNLOCK, sync_role());
    return ((rwlock_fn)real_fn(&lf_real_rw_unlock, "pthread_rwlock_unlock", NULL))(p->obj);
}

/* Barriers: the arrival hands on what the thread did before it, the departure (with the
 * leader's result: PTHREAD_BARRIER_SERIAL_THREAD in one thread) takes what the others did.
 * A follower's thread waits at the barrier itself too, after its arrival's turn (all of a
 * round's arrivals come before its departures in the leader's order, so every thread of
 * the round gets there), and returns the leader's result: the barrier's own state then
 * follows the order in every replica, as a follower that becomes the leader needs it.
 *
 * A round that a failover splits: some of its departures are the old leader's records,
 * the others the new leader's own, and the two leaders' barriers chose their serial thread
 * each. Each replica counts, per barrier, the serial results its threads took from records
 * less those its own barrier gave them (`serials`: 0 after every whole round); a new
 * leader's departures of the split round (every old record is taken before it leads) then
 * give out the serial result exactly once: not again if a record gave it (count 1), to the
 * first of them if its barrier gave it to a thread that followed a record (count -1). */
#define LF_BARRIERS 64 /* barriers noted per process; past that a split round is not mended */
struct barrier_note {
    void *volatile addr;
    volatile long serials;
};
static struct barrier_note lf_barrier_notes[LF_BARRIERS];

/* Barrier `b`'s count of serial results (NULL: the table is full). */
static volatile long *barrier_serials(void *b)
{
    uintptr_t home = ((uintptr_t)b >> 4) % LF_BARRIERS;
    for (unsigned i = 0; i < LF_BARRIERS; i++) {
        struct barrier_note *n = &lf_barrier_notes[(home + i) % LF_BARRIERS];
        void *owner = __atomic_load_n(&n->addr, __ATOMIC_ACQUIRE);
        if (owner == NULL && __atomic_compare_exchange_n(&n->addr, &owner, b, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            owner = b;
        if (owner == b)
            return &n->serials;
    }
    return NULL;
}

/* A follower's departure: the leader's result `recorded`, its own barrier's `native`. */
static void note_serials(void *b, long recorded, int native)
{
    volatile long *count = barrier_serials(b);
    long change = (recorded == PTHREAD_BARRIER_SERIAL_THREAD) - (native == PTHREAD_BARRIER_SERIAL_THREAD);
    if (count != NULL && change != 0)
        __atomic_add_fetch(count, change, __ATOMIC_SEQ_CST);
}

/* The result a leader promoted in place records for a departure its barrier gave `native`. */
static int serial_once(void *b, int native)
{
    struct lf_state *st = lf_my;
    if (st == NULL || st->hdr == NULL || load32(&st->hdr->former) == 0)
        return native;
    volatile long *count = barrier_serials(b);
    if (count == NULL)
        return native;
    int serial = native == PTHREAD_BARRIER_SERIAL_THREAD;
    long v = __atomic_load_n(count, __ATOMIC_SEQ_CST);
    /* Given by a record already (1): not again. Given to a follower of a record (-1): here. */
    while ((serial ? v > 0 : v < 0) &&
           !__atomic_compare_exchange_n(count, &v, serial ? v - 1 : v + 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        ;
    if (serial ? v > 0 : v < 0)
        return serial ? 0 : PTHREAD_BARRIER_SERIAL_THREAD;
    return native;
}

static long barrier_body(void *v)
{
    struct sync_args *p = v;
    typedef int (*barrier_fn)(pthread_barrier_t *);
    barrier_fn real = (barrier_fn)real_fn(&lf_real_barrier_wait, "pthread_barrier_wait", NULL);
    int role = sync_role();
    if (role == ROLE_NONE)
        return real(p->obj);
    if (sync_event(p, SYNC_BARRIER_ARRIVE, 0, role) == SYNC_PROMOTED) {
        role = ROLE_LEAD;
        sync_event(p, SYNC_BARRIER_ARRIVE, 0, role);
    }
    serial_leave(lf_my);
    int native = real(p->obj);
    int ret = role == ROLE_LEAD ? serial_once(p->obj, native) : native;
    long departed = sync_event(p, SYNC_BARRIER_DEPART, ret, role);
    if (role == ROLE_LEAD || departed == SYNC_NONE)
        return ret;
    if (departed == SYNC_PROMOTED) { /* this replica leads now: its own result, recorded */
        ret = serial_once(p->obj, native);
        sync_event(p, SYNC_BARRIER_DEPART, ret, ROLE_LEAD);
        return ret;
    }
    note_serials(p->obj, departed, native);
    take_done();
    return departed;
}

/* pthread_once: the thread that runs the initialiser is the leader's. The leader's thread
 * that runs it takes its place (result 1) as the initialiser starts, from inside the real
 * pthread_once, so before any thread that waited for it or found it done (result 0, after
 * the real call returns). A follower's thread learns its part in its turn: the runner
 * calls the real pthread_once, which runs the initialiser, since no other thread of its
 * replica can have reached its own turn; any other thread waits until the runner has
 * entered the real call (glibc's control word is no longer 0), and then calls it too, to
 * return once the initialiser is done. The initialiser runs on the program's stack. */
static __thread void (*lf_once_init)(void);
static __thread const struct sync_args *lf_once_lead; /* the leader's operation in progress */
static __thread int lf_once_ran;
static void *volatile lf_real_once;
typedef int (*once_fn)(pthread_once_t *, void (*)(void));
#define REAL_ONCE ((once_fn)real_fn(&lf_real_once, "pthread_once", NULL))

static void once_trampoline(void)
{
    void (*init)(void) = lf_once_init;
    const struct sync_args *p = lf_once_lead;
    lf_once_ran = 1;
    if (p != NULL)
        sync_event(p, SYNC_ONCE, 1, ROLE_LEAD);
    lf_in_native = 0; /* the program's code; pthread_once restores it */
    init(); /* a tail call, as glibc's own call in a follower: the same return address */
}

/* A follower's thread that is not the runner: until the runner entered the real call. */
static long once_wait_started(void *v)
{
    volatile int *control = ((struct sync_args *)v)->obj;
    for (unsigned i = 0; __atomic_load_n(control, __ATOMIC_ACQUIRE) == 0; i++) {
        if (i < SPIN_FLOOR)
            cpu_relax();
        else
            lf_fast(SYS_sched_yield, 0, 0, 0, 0, 0, 0);
    }
    return 0;
}

/* The leader's thread that found the initialiser done, or waited for another's. */
static long once_done_body(void *v)
{
    int role = sync_role();
    if (role == ROLE_LEAD)
        sync_event(v, SYNC_ONCE, 0, role);
    return 0;
}

static long once_role_body(void *v)
{
    struct sync_args *p = v;
    int role = sync_role();
    if (role != ROLE_FOLLOW)
        return role == ROLE_LEAD ? -1 : SYNC_NONE;
    long part = sync_event(p, SYNC_ONCE, 0, role);
    return part == SYNC_PROMOTED ? -1 : part;
}

int pthread_once(pthread_once_t *control, void (*init)(void))
{
    struct sync_args p = {.obj = control, .site = __builtin_return_address(0)};
    long part = on_lane_stack(once_role_body, &p); /* -1: the leader's; SYNC_NONE; or 1 / 0 */
    if (part == SYNC_NONE || part == 1)
        return REAL_ONCE(control, init);
    if (part == 0) {
        on_lane_stack(once_wait_started, &p);
        lf_in_native++;
        int ret = REAL_ONCE(control, init);
        lf_in_native--;
        return ret;
    }
    /* The leader: whether this thread runs the initialiser decides its record's place. */
    void (*outer_init)(void) = lf_once_init;
    const struct sync_args *outer_lead = lf_once_lead;
    int outer_ran = lf_once_ran;
    lf_once_init = init;
    lf_once_lead = &p;
    lf_once_ran = 0;
    serial_step(leave_body); /* another thread may run the initialiser */
    int in_native = lf_in_native++;
    int ret = REAL_ONCE(control, once_trampoline);
    lf_in_native = in_native;
    int ran = lf_once_ran;
    lf_once_init = outer_init;
    lf_once_lead = outer_lead;
    lf_once_ran = outer_ran;
    if (!ran)
        on_lane_stack(once_done_body, &p);
    return ret;
}

/* pthread_join, in the serial order: whether it waits for the thread's exit in the kernel
 * (a futex wait on its id) depends on when that thread's exit went through, not on the
 * program's memory; so the thread gives up its turn for the whole join, and goes on from a
 * RESUME record in every replica. */
typedef int (*pthread_join_fn)(pthread_t, void **);
static void *volatile lf_real_join;

int pthread_join(pthread_t thread, void **result)
{
    pthread_join_fn real = (pthread_join_fn)real_fn(&lf_real_join, "pthread_join", NULL);
    struct lf_state *st = lf_my;
    if (!serial_order(st) || (lf_vfork_seen && lf_fast(SYS_gettid, 0, 0, 0, 0, 0, 0) != st->owner_tid))
        return real(thread, result);
    serial_step(leave_body);
    int in_native = lf_in_native++;
    int ret = real(thread, result);
    lf_in_native = in_native;
    serial_step(resume_body);
    return ret;
}

/* Semaphores: a wait (blocking, try or timed) takes the leader's outcome (0, or -errno:
 * EAGAIN, ETIMEDOUT, EINTR) in its turn, and a follower then takes the count the leader's
 * thread took (posted in an earlier turn, so at hand); a post hands one on. The bodies
 * return 0 or -errno. */
static long sem_outcome(int ret) { return ret == 0 ? 0 : -(long)errno; }

static long sem_wait_body(void *v)
{
    struct sync_args *p = v;
    sem_t *sem = p->obj;
    int role = sync_role();
    if (role == ROLE_FOLLOW) {
        long outcome = sync_event(p, SYNC_SEM_WAIT, 0, role);
        if (outcome == SYNC_NONE)
            return sem_outcome(p->native_sem(sem, p->arg));
        if (outcome != SYNC_PROMOTED) {
            if (outcome == 0)
                while (REAL_SEM_WAIT(sem) != 0 && errno == EINTR)
                    ;
            take_done();
            return outcome;
        }
        role = ROLE_LEAD;
    }
    if (role == ROLE_LEAD)
        serial_leave(lf_my);
    long outcome = sem_outcome(p->native_sem(sem, p->arg));
    if (role == ROLE_LEAD)
        sync_event(p, SYNC_SEM_WAIT, outcome, role);
    return outcome;
}

static long sem_post_body(void *v)
{
    struct sync_args *p = v;
    sem_fn post = (sem_fn)real_fn(&lf_real_sem_post, "sem_post", NULL);
    hand_on(p, SYNC_SEM_POST, sync_role());
    return sem_outcome(post(p->obj));
}

static int sem_result(long outcome)
{
    if (outcome == 0)
        return 0;
    errno = (int)-outcome;
    return -1;
}

struct clock_wait {
    clockid_t clock;
    const struct timespec *abstime;
};
static int native_sem_wait(sem_t *sem, const void *arg) { return (void)arg, REAL_SEM_WAIT(sem); }
static int native_sem_trywait(sem_t *sem, const void *arg)
{
    return (void)arg, ((sem_fn)real_fn(&lf_real_sem_trywait, "sem_trywait", NULL))(sem);
}
static int native_sem_timedwait(sem_t *sem, const void *arg)
{
    return ((sem_timed_fn)real_fn(&lf_real_sem_timedwait, "sem_timedwait", NULL))(sem, arg);
}
static int native_sem_clockwait(sem_t *sem, const void *arg)
{
    const struct clock_wait *w = arg;
    return ((sem_clock_fn)real_fn(&lf_real_sem_clockwait, "sem_clockwait", NULL))(sem, w->clock, w->abstime);
}

/* The interposed functions: the same code in every replica up to on_lane_stack. */
#define CALLER __builtin_return_address(0) /* the program's call site, a record's digest */

/* An operation on one object, on the lane's stack. */
static int on_object(long (*body)(void *), void *obj, const void *site)
{
    struct sync_args p = {.obj = obj, .site = site};
    return (int)on_lane_stack(body, &p);
}

int pthread_mutex_lock(pthread_mutex_t *m) { return on_object(lock_body, m, CALLER); }

int pthread_mutex_trylock(pthread_mutex_t *m) { return on_object(trylock_body, m, CALLER); }

int pthread_mutex_unlock(pthread_mutex_t *m) { return on_object(unlock_body, m, CALLER); }

int pthread_cond_wait(pthread_cond_t *c, pthread_mutex_t *m)
{
    struct sync_args p = {.obj = c, .obj2 = m, .site = CALLER};
    return (int)on_lane_stack(cond_wait_body, &p);
}

int pthread_cond_timedwait(pthread_cond_t *c, pthread_mutex_t *m, const struct timespec *abstime)
{
    struct sync_args p = {.obj = c, .obj2 = m, .arg = abstime, .site = CALLER};
    return (int)on_lane_stack(cond_wait_body, &p);
}

int pthread_cond_signal(pthread_cond_t *c)
{
    struct sync_args p = {.obj = c, .slot = &lf_real_signal, .name = "pthread_cond_signal", .site = CALLER};
    return (int)on_lane_stack(wake_body, &p);
}

int pthread_cond_broadcast(pthread_cond_t *c)
{
    struct sync_args p = {.obj = c, .slot = &lf_real_broadcast, .name = "pthread_cond_broadcast", .site = CALLER};
    return (int)on_lane_stack(wake_body, &p);
}

static int rw_call(pthread_rwlock_t *l, int write, int variant, clockid_t clock, const struct timespec *abstime,
                   const void *site)
{
    struct sync_args p = {.obj = l, .arg = abstime, .site = site, .variant = variant, .clock = clock};
    return (int)on_lane_stack(write ? wrlock_body : rdlock_body, &p);
}

int pthread_rwlock_rdlock(pthread_rwlock_t *l) { return rw_call(l, 0, RW_BLOCKING, 0, NULL, CALLER); }
int pthread_rwlock_tryrdlock(pthread_rwlock_t *l) { return rw_call(l, 0, RW_TRY, 0, NULL, CALLER); }
int pthread_rwlock_timedrdlock(pthread_rwlock_t *l, const struct timespec *t) { return rw_call(l, 0, RW_TIMED, 0, t, CALLER); }
int pthread_rwlock_clockrdlock(pthread_rwlock_t *l, clockid_t c, const struct timespec *t)
{
    return rw_call(l, 0, RW_CLOCK, c, t, CALLER);
}
int pthread_rwlock_wrlock(pthread_rwlock_t *l) { return rw_call(l, 1, RW_BLOCKING, 0, NULL, CALLER); }
int pthread_rwlock_trywrlock(pthread_rwlock_t *l) { return rw_call(l, 1, RW_TRY, 0, NULL, CALLER); }
int pthread_rwlock_timedwrlock(pthread_rwlock_t *l, const struct timespec *t) { return rw_call(l, 1, RW_TIMED, 0, t, CALLER); }
int pthread_rwlock_clockwrlock(pthread_rwlock_t *l, clockid_t c, const struct timespec *t)
{
    return rw_call(l, 1, RW_CLOCK, c, t, CALLER);
}

int pthread_rwlock_unlock(pthread_rwlock_t *l) { return on_object(rw_unlock_body, l, CALLER); }

int pthread_barrier_wait(pthread_barrier_t *b) { return on_object(barrier_body, b, CALLER); }

static int sem_waits(sem_t *sem, int (*native)(sem_t *, const void *), const void *arg, const void *site)
{
    struct sync_args p = {.obj = sem, .arg = arg, .native_sem = native, .site = site};
    return sem_result(on_lane_stack(sem_wait_body, &p));
}

int sem_wait(sem_t *sem) { return sem_waits(sem, native_sem_wait, NULL, CALLER); }
int sem_trywait(sem_t *sem) { return sem_waits(sem, native_sem_trywait, NULL, CALLER); }
int sem_timedwait(sem_t *sem, const struct timespec *abstime) { return sem_waits(sem, native_sem_timedwait, abstime, CALLER); }
int sem_clockwait(sem_t *sem, clockid_t clock, const struct timespec *abstime)
{
    struct clock_wait w = {clock, abstime};
    return sem_waits(sem, native_sem_clockwait, &w, CALLER);
}

int sem_post(sem_t *sem)
{
    struct sync_args p = {.obj = sem, .site = CALLER};
    return sem_result(on_lane_stack(sem_post_body, &p));
}

/* After a call made through the monitor: the monitor may have asked for the next ring. */
static long after_slow_call(long ret)
{
    uint32_t next = lf_reattach_to;
    if (lf_ring_thread && next > lf_ring_epoch)
        attach_ring(next);
    return ret;
}

/* The variables the monitor set for us are not the program's. */
static void restore_environment(void)
{
    const char *preload = getenv("LOCKSTEP_FAST_PRELOAD");
    if (preload != NULL && preload[0] != '\0')
        setenv("LD_PRELOAD", preload, 1);
    else if (getenv("LOCKSTEP_FAST_RING") != NULL)
        unsetenv("LD_PRELOAD");
    const char *tunables = getenv("LOCKSTEP_FAST_TUNABLES");
    if (tunables != NULL && tunables[0] != '\0')
        setenv("GLIBC_TUNABLES", tunables, 1);
    else if (getenv("LOCKSTEP_FAST_RING") != NULL)
        unsetenv("GLIBC_TUNABLES");
    unsetenv("LOCKSTEP_FAST_TUNABLES");
    unsetenv("LOCKSTEP_FAST_PRELOAD");
    unsetenv("LOCKSTEP_FAST_RING");
    unsetenv("LOCKSTEP_FAST");
    unsetenv("LOCKSTEP_FAST_TEST");
}

__attribute__((constructor)) static void lf_init(void)
{
    const char *mode = getenv("LOCKSTEP_FAST");
    if (mode == NULL || mode[0] == '\0')
        return;
    int count = strcmp(mode, "count") == 0;
    /* LOCKSTEP_FAST_RING: the rings' paths, one per epoch, separated by ':'. */
    for (const char *ring = getenv("LOCKSTEP_FAST_RING"); ring != NULL && lf_ring_count < LF_RINGS;) {
        const char *end = strchr(ring, ':');
        size_t len = end != NULL ? (size_t)(end - ring) : strlen(ring);
        if (len == 0 || len >= sizeof lf_ring_paths[0])
            break;
        memcpy(lf_ring_paths[lf_ring_count++], ring, len);
        ring = end != NULL ? end + 1 : NULL;
    }
    const char *test = getenv("LOCKSTEP_FAST_TEST");
    if (test != NULL && strncmp(test, "corrupt:", 8) == 0)
        lf_test_corrupt = strtoull(test + 8, NULL, 10);
    if (test != NULL && strncmp(test, "lie:", 4) == 0)
        lf_test_lie = strtoull(test + 4, NULL, 10);
    if (test != NULL && strncmp(test, "post-corrupt:", 13) == 0)
        lf_test_post_corrupt = strtoull(test + 13, NULL, 10);
    if (test != NULL && strncmp(test, "result:", 7) == 0)
        lf_test_result = strtoull(test + 7, NULL, 10);
    if (test != NULL && strncmp(test, "wild-result:", 12) == 0)
        lf_test_wild_result = strtoull(test + 12, NULL, 10);
    if (test != NULL && strncmp(test, "crash:", 6) == 0)
        lf_test_crash = strtoull(test + 6, NULL, 10);
    if (test != NULL && strncmp(test, "signal:", 7) == 0)
        lf_test_signal = strtoull(test + 7, NULL, 10);
    if (test != NULL && strncmp(test, "hang:", 5) == 0)
        lf_test_hang = strtoull(test + 5, NULL, 10);
    if (test != NULL && strncmp(test, "flap:", 5) == 0)
        lf_test_flap = strtoull(test + 5, NULL, 10);
    if (test != NULL && strncmp(test, "die:", 4) == 0)
        lf_test_die = strtoull(test + 4, NULL, 10);
    if (test != NULL && strncmp(test, "die-call:", 9) == 0)
        lf_test_die_call = strtoull(test + 9, NULL, 10);
    if (test != NULL && strncmp(test, "bad-wait:", 9) == 0)
        lf_test_bad_wait = strtoull(test + 9, NULL, 10);
    lf_test_selector_allow = test != NULL && strcmp(test, "selector-allow") == 0;
    restore_environment();
    /* A key below 32 lives in the thread's own block: setting it allocates nothing. */
    if (pthread_key_create(&lf_end_key, end_thread) == 0 && !(lf_end_key_ok = lf_end_key < 32))
        pthread_key_delete(lf_end_key);
    if (map_page_zero() != 0)
        return; /* stay inert */
    struct kernel_sigaction sa = {
        .handler = (void *)on_sigsys,
        /* SA_NODEFER: a signal handler of the program that runs while this one does (a
         * signal delivered at a call made from here) reaches unrewritten sites too, and
         * a SUD SIGSYS that is blocked is fatal. */
        .flags = SA_SIGINFO | SA_NODEFER | KSA_RESTORER,
        .restorer = (void *)RESTORER,
        .mask = 0,
    };
    if (lf_raw(SYS_rt_sigaction, SIGSYS, (long)&sa, 0, 8, 0, 0) != 0)
        return;
    attach_ring(0);
    /* Only pages 0 and 1 (the gates, the restorer, the stubs) may make syscalls without SIGSYS. */
    if (prctl(PR_SET_SYSCALL_USER_DISPATCH, PR_SYS_DISPATCH_ON, 0, STUB_PAGE + 4096, &lf_selector) != 0)
        return;
    lf_report = count;
    atexit(report);
    lf_active = 1;
    lf_selector = lf_test_selector_allow ? SELECTOR_ALLOW : SELECTOR_BLOCK;
}
