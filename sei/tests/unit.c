/* libsei unit cases, one per command-line name; crates/cli/tests/sei.rs builds this file
 * with `lockstep cc` at several optimisation levels and checks each case's output and
 * exit status. A case prints "ok ..." lines; a detected error exits 86 inside libsei. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "sei.h"

/* Which execution is running, seen from outside the instrumentation. */
static int executions;
static SEI_PURE int execution_started(void) { return ++executions; }

#define CHECK(cond)                                                              \
    do {                                                                         \
        if (!(cond)) {                                                           \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
            exit(1);                                                             \
        }                                                                        \
    } while (0)

/* ---- every ABI barrier, called directly: the value must change once ---- */

typedef int m64 __attribute__((vector_size(8)));
typedef float m128 __attribute__((vector_size(16)));
typedef float m256 __attribute__((vector_size(32)));

#define DECLARE(N, T)                                 \
    T _ITM_R##N(const T *) SEI_PURE;                  \
    T _ITM_RaR##N(const T *) SEI_PURE;                \
    T _ITM_RaW##N(const T *) SEI_PURE;                \
    T _ITM_RfW##N(const T *) SEI_PURE;                \
    void _ITM_W##N(T *, T) SEI_PURE;                  \
    void _ITM_WaR##N(T *, T) SEI_PURE;                \
    void _ITM_WaW##N(T *, T) SEI_PURE;                \
    void _ITM_L##N(const T *) SEI_PURE;
DECLARE(U1, uint8_t)
DECLARE(U2, uint16_t)
DECLARE(U4, uint32_t)
DECLARE(U8, uint64_t)
DECLARE(F, float)
DECLARE(D, double)
DECLARE(E, long double)
DECLARE(M64, m64)
DECLARE(M128, m128)
DECLARE(CF, _Complex float)
DECLARE(CD, _Complex double)
DECLARE(CE, _Complex long double)
__attribute__((target("avx"))) DECLARE(M256, m256)
void _ITM_LB(const void *, size_t) SEI_PURE;
#define COPY_DECL(OP, S) void _ITM_##OP##S(void *, const void *, size_t) SEI_PURE;
#define COPY_DECLS(OP)                                                                                      \
    COPY_DECL(OP, RnWt) COPY_DECL(OP, RnWtaR) COPY_DECL(OP, RnWtaW) COPY_DECL(OP, RtWn) COPY_DECL(OP, RtaRWn) \
    COPY_DECL(OP, RtaWWn) COPY_DECL(OP, RtWt) COPY_DECL(OP, RtWtaR) COPY_DECL(OP, RtWtaW)                    \
    COPY_DECL(OP, RtaRWt) COPY_DECL(OP, RtaRWtaR) COPY_DECL(OP, RtaRWtaW) COPY_DECL(OP, RtaWWt)              \
    COPY_DECL(OP, RtaWWtaR) COPY_DECL(OP, RtaWWtaW)
COPY_DECLS(memcpy)
COPY_DECLS(memmove)
void _ITM_memsetW(void *, int, size_t) SEI_PURE;
void _ITM_memsetWaR(void *, int, size_t) SEI_PURE;
void _ITM_memsetWaW(void *, int, size_t) SEI_PURE;

static uint8_t g_u1;
static uint16_t g_u2;
static uint32_t g_u4;
static uint64_t g_u8;
static float g_f;
static double g_d;
static long double g_e;
static m64 g_m64;
static m128 g_m128;
static m256 g_m256;
static _Complex float g_cf;
static _Complex double g_cd;
static _Complex long double g_ce;
static char g_buf[64], g_src[64];

/* R then W of one variant pair; each handler adds one. */
/* g_touch++ keeps the transaction: GCC elides one whose body has only pure calls */
static int g_touch;
#define BUMP(N, var, R, W) \
    SEI_LOCAL_HANDLER() { _ITM_##W##N(&var, _ITM_##R##N(&var) + 1); g_touch++; }

#define BUMP_ALL(N, var)                   \
    BUMP(N, var, R, W)                     \
    BUMP(N, var, RaR, WaR)                 \
    BUMP(N, var, RaW, WaW)                 \
    BUMP(N, var, RfW, W)                   \
    SEI_LOCAL_HANDLER() { _ITM_L##N(&var); var += 1; }

__attribute__((target("avx"))) static void bump_m256(void) {
    BUMP_ALL(M256, g_m256)
    CHECK(g_m256[0] == 5 && g_m256[7] == 5);
}

static void case_abi(void) {
    BUMP_ALL(U1, g_u1)
    BUMP_ALL(U2, g_u2)
    BUMP_ALL(U4, g_u4)
    BUMP_ALL(U8, g_u8)
    BUMP_ALL(F, g_f)
    BUMP_ALL(D, g_d)
    BUMP_ALL(E, g_e)
    BUMP_ALL(M64, g_m64)
    BUMP_ALL(M128, g_m128)
    BUMP_ALL(CF, g_cf)
    BUMP_ALL(CD, g_cd)
    BUMP_ALL(CE, g_ce)
    CHECK(g_u1 == 5 && g_u2 == 5 && g_u4 == 5 && g_u8 == 5);
    CHECK(g_f == 5 && g_d == 5 && g_e == 5);
    CHECK(g_m64[0] == 5 && g_m64[1] == 5 && g_m128[0] == 5 && g_m128[3] == 5);
    CHECK(g_cf == 5 && g_cd == 5 && g_ce == 5);
    if (__builtin_cpu_supports("avx")) bump_m256();
    printf("ok barriers\n");

    /* bulk barriers: each copy or set lands once, and E2 starts from the old bytes */
    for (int i = 0; i < 64; i++) g_src[i] = (char)i;
#define COPY_ONE(OP, S)                                                  \
    memset(g_buf, 0x55, sizeof g_buf);                                   \
    SEI_LOCAL_HANDLER() {                                                \
        _ITM_##OP##S(g_buf + 3, g_src, 40);                              \
        g_buf[0]++;                                                      \
    }                                                                    \
    CHECK(g_buf[0] == 0x56 && g_buf[3] == 0 && g_buf[42] == 39 && g_buf[43] == 0x55);
#define COPY_ALL(OP)                                                                                   \
    COPY_ONE(OP, RnWt) COPY_ONE(OP, RnWtaR) COPY_ONE(OP, RnWtaW) COPY_ONE(OP, RtWt)                  \
    COPY_ONE(OP, RtWtaR) COPY_ONE(OP, RtWtaW) COPY_ONE(OP, RtaRWt) COPY_ONE(OP, RtaRWtaR)              \
    COPY_ONE(OP, RtaRWtaW) COPY_ONE(OP, RtaWWt) COPY_ONE(OP, RtaWWtaR) COPY_ONE(OP, RtaWWtaW)
    COPY_ALL(memcpy)
    COPY_ALL(memmove)
    /* Wn: the destination is not handler state, so it is written twice, unlogged */
    char local[64];
#define COPY_TO_LOCAL(OP, S)                                  \
    memset(local, 0, sizeof local);                           \
    SEI_LOCAL_HANDLER() { _ITM_##OP##S(local, g_src, 8); g_touch++; }    \
    CHECK(local[7] == 7);
    COPY_TO_LOCAL(memcpy, RtWn) COPY_TO_LOCAL(memcpy, RtaRWn) COPY_TO_LOCAL(memcpy, RtaWWn)
    COPY_TO_LOCAL(memmove, RtWn) COPY_TO_LOCAL(memmove, RtaRWn) COPY_TO_LOCAL(memmove, RtaWWn)
#define SET_ONE(S)                                                           \
    memset(g_buf, 1, sizeof g_buf);                                          \
    SEI_LOCAL_HANDLER() { _ITM_memset##S(g_buf + 1, 9, 30); g_buf[0]++; }    \
    CHECK(g_buf[0] == 2 && g_buf[1] == 9 && g_buf[30] == 9 && g_buf[31] == 1);
    SET_ONE(W) SET_ONE(WaR) SET_ONE(WaW)
    memset(g_buf, 0, sizeof g_buf);
    SEI_LOCAL_HANDLER() {
        _ITM_LB(g_buf + 5, 11);
        g_buf[0]++;
    }
    CHECK(g_buf[0] == 1);
    printf("ok bulk\n");
}

/* ---- state of every kind is reset between E1 and E2 ---- */

struct record {
    int counter;
    char name[24];
};
static struct record global_record;
static int seen_counter[3], seen_heap[3], seen_local[3], seen_array[3];

static SEI_PURE void observe(int *slot, int value) {
    slot[executions] = value;
}

/* a callee whose frame dies with the handler: its stack writes need no reset */
static SEI_SAFE int scratch_sum(int n) {
    int scratch[32];
    for (int i = 0; i < 32; i++) scratch[i] = i * n;
    int s = 0;
    for (int i = 0; i < 32; i++) s += scratch[i];
    return s;
}

static void case_reset(void) {
    int *heap = calloc(4, sizeof *heap);
    int local = 100;
    int array[8] = {0};
    volatile int *escape = array; /* address-taken local of the enclosing frame */
    (void)escape;
    for (int round = 1; round <= 3; round++) {
        executions = 0;
        SEI_LOCAL_HANDLER() {
            execution_started();
            observe(seen_counter, global_record.counter);
            observe(seen_heap, heap[1]);
            observe(seen_local, local);
            observe(seen_array, array[round % 8]);
            global_record.counter++;
            if (round == 2)
                memcpy(global_record.name, "second", 7);
            else
                memcpy(global_record.name, "other", 6);
            heap[1] += 10;
            local += scratch_sum(round);
            array[round % 8] += 7;
        }
        CHECK(executions == 2);
        CHECK(seen_counter[1] == seen_counter[2] && seen_heap[1] == seen_heap[2]);
        CHECK(seen_local[1] == seen_local[2] && seen_array[1] == seen_array[2]);
    }
    CHECK(global_record.counter == 3 && heap[1] == 30 && array[1] == 7 && array[3] == 7);
    CHECK(local == 100 + 496 * (1 + 2 + 3) && strcmp(global_record.name, "other") == 0);
    free(heap);
    printf("ok reset\n");
}

/* ---- allocations ---- */

struct node {
    int value;
    struct node *next;
};
static struct node *list;
static struct node *seen_ptr[3];
static SEI_PURE void observe_ptr(struct node *p) { seen_ptr[executions] = p; }

static void case_alloc(void) {
    for (int i = 0; i < 4; i++) {
        executions = 0;
        SEI_LOCAL_HANDLER() {
            execution_started();
            struct node *n = malloc(sizeof *n);
            observe_ptr(n);
            n->value = i;
            n->next = list;
            list = n;
            if (i == 3) {
                /* drop the oldest node: the free waits until after V */
                struct node *p = list;
                while (p->next->next) p = p->next;
                free(p->next);
                p->next = NULL;
            }
        }
        CHECK(seen_ptr[1] == seen_ptr[2]);
    }
    int n = 0;
    for (struct node *p = list; p; p = p->next) n++;
    CHECK(n == 3 && list->value == 3);
    printf("ok alloc\n");
}

/* ---- deferred external calls ---- */

static int pending_bytes(int fd) {
    char buf[64];
    ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT | MSG_PEEK);
    return n < 0 ? 0 : (int)n;
}
static int pending_in_handler;
static SEI_PURE void observe_pending(int fd) { pending_in_handler += pending_bytes(fd); }

static void case_send(void) {
    int sv[2], wv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, wv) == 0);
    int sent = 0;
    SEI_LOCAL_HANDLER() {
        char reply[8] = "hello";
        sent = (int)send(sv[0], reply, 5, 0);
        write(sv[0], "!", 1);
        close(wv[0]);
        observe_pending(sv[1]);
    }
    CHECK(sent == 5 && pending_in_handler == 0);
    char buf[64];
    ssize_t n = recv(sv[1], buf, sizeof buf, MSG_DONTWAIT);
    CHECK(n == 6 && memcmp(buf, "hello!", 6) == 0);
    CHECK(recv(sv[1], buf, sizeof buf, MSG_DONTWAIT) < 0 && errno == EAGAIN);
    CHECK(recv(wv[1], buf, sizeof buf, 0) == 0); /* closed exactly once: EOF */
    printf("ok send\n");
}

/* ---- outputs and their CRCs ---- */

static char reply[32];
static int reply_len;

static void case_output(void) {
    const char *msg = "get k";
    SEI_HANDLER(msg, 5, sei_crc32c(0, msg, 5)) {
        memcpy(reply, "VALUE k 0 1\r\n", 13);
        reply_len = 13;
        sei_output_append(reply, 8);
        sei_output_append(reply + 8, 5);
        sei_output_done();
    }
    CHECK(sei_crc_pop() == sei_crc32c(0, "VALUE k 0 1\r\n", 13));
    int ran = 0;
    SEI_HANDLER(msg, 5, sei_crc32c(0, msg, 5) ^ 1) { ran = 1; }
    CHECK(!ran);
    struct sei_stats st;
    sei_stats(&st);
    CHECK(st.discarded == 1 && st.handlers == 1);
    printf("ok output\n");
}

/* a handler with nothing to instrument: GCC emits no transaction, libsei runs it once */
static void case_pure_handler(void) {
    static const char ready[] = "READY";
    SEI_LOCAL_HANDLER() {
        sei_output_append(ready, 5);
        sei_output_done();
    }
    CHECK(sei_crc_pop() == sei_crc32c(0, "READY", 5));
    printf("ok pure handler\n");
}

/* ---- cancel ---- */

static int cancel_state;
static void case_cancel(void) {
    SEI_LOCAL_HANDLER() {
        cancel_state = 5;
        if (cancel_state > 1) __transaction_cancel;
    }
    CHECK(cancel_state == 0);
    struct sei_stats st;
    sei_stats(&st);
    CHECK(st.cancelled == 1);
    printf("ok cancel\n");
}

/* ---- locks ---- */

static pthread_mutex_t lock_a = PTHREAD_MUTEX_INITIALIZER, lock_b = PTHREAD_MUTEX_INITIALIZER;
static int busy_in_handler;
static SEI_PURE void observe_lock(pthread_mutex_t *m) {
    /* trylock on our own held (deferred) lock: EBUSY; not wrapped, this is pure code */
    if (pthread_mutex_trylock(m) == EBUSY)
        busy_in_handler++;
    else
        pthread_mutex_unlock(m);
}
static int shared_value;

static void case_locks(void) {
    SEI_LOCAL_HANDLER() {
        pthread_mutex_lock(&lock_a);
        shared_value++;
        pthread_mutex_unlock(&lock_a);
        observe_lock(&lock_a);
        pthread_mutex_lock(&lock_b);
        pthread_mutex_lock(&lock_a); /* re-taken after a deferred release */
        shared_value++;
        pthread_mutex_unlock(&lock_a);
        pthread_mutex_unlock(&lock_b);
    }
    CHECK(busy_in_handler == 2 && shared_value == 2);
    CHECK(pthread_mutex_trylock(&lock_a) == 0 && pthread_mutex_trylock(&lock_b) == 0); /* released after V */
    pthread_mutex_unlock(&lock_a);
    pthread_mutex_unlock(&lock_b);
    printf("ok locks\n");
}

/* ---- detections (each exits 86 inside libsei) ---- */

static int victim, selector, a_side, b_side;

static void case_flip_e1(void) {
    SEI_LOCAL_HANDLER() {
        victim += 3;
        sei_test_flip(&victim, 2, 1);
    }
    printf("not detected: %d\n", victim);
}

static void case_flip_e2(void) {
    SEI_LOCAL_HANDLER() {
        victim += 3;
        sei_test_flip(&victim, 0, 2);
    }
    printf("not detected: %d\n", victim);
}

/* a read-only input flipped after E1: E2 writes elsewhere (R6) */
static void case_flip_branch(void) {
    SEI_LOCAL_HANDLER() {
        if (selector)
            a_side = 1;
        else
            b_side = 1;
        sei_test_flip(&selector, 0, 1);
    }
    printf("not detected: %d %d\n", a_side, b_side);
}

static void case_flip_output(void) {
    SEI_LOCAL_HANDLER() {
        memcpy(reply, "STORED\r\n", 8);
        sei_output_append(reply, 8);
        sei_output_done();
        sei_test_flip(reply, 1, 2); /* after E2's CRC: V re-reads the output */
    }
    printf("not detected\n");
}

static void case_flip_send(void) {
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    SEI_LOCAL_HANDLER() {
        victim++;
        reply[0] = (char)('a' + victim);
        sei_test_flip(reply, 3, 2);
        send(sv[0], reply, 1, 0);
    }
    printf("not detected\n");
}

static void case_unlock_not_held(void) {
    SEI_LOCAL_HANDLER() {
        shared_value++;
        pthread_mutex_unlock(&lock_b);
    }
    printf("not detected\n");
}

static void case_other_lock(void) {
    SEI_LOCAL_HANDLER() {
        pthread_mutex_t *m = execution_started() == 1 ? &lock_a : &lock_b;
        pthread_mutex_lock(m);
        shared_value++;
        pthread_mutex_unlock(m);
    }
    printf("not detected\n");
}

static void case_end_without_handler(void) {
    sei_end();
    printf("not detected\n");
}

static void case_begin_twice(void) {
    sei_begin_nm();
    sei_begin_nm();
    printf("not detected\n");
}

/* dup mode: a flip between handlers is found by the next handler that reads the word */
static long protected_total;
static void case_flip_between(void) {
    SEI_LOCAL_HANDLER() { protected_total = 1000; }
    sei_test_flip(&protected_total, 4, 0);
    long copy = 0;
    SEI_LOCAL_HANDLER() { copy = protected_total + 1; }
    printf("mode=%s read=%ld\n", sei_mode() == SEI_MODE_DUP ? "dup" : "ecc", copy);
}

/* dup mode must not raise false alarms: words written outside handlers, frees, reuse */
static void case_dup_quiet(void) {
    for (int round = 0; round < 200; round++) {
        SEI_LOCAL_HANDLER() {
            struct node *n = malloc(sizeof *n);
            n->value = round;
            n->next = list;
            list = n;
            if (round % 3 == 0) {
                struct node *dead = list;
                list = list->next;
                free(dead);
            }
            protected_total += list ? list->value : 0;
        }
    }
    printf("ok quiet mode=%s total=%ld\n", sei_mode() == SEI_MODE_DUP ? "dup" : "ecc", protected_total);
}

/* ---- threads: the checking barrier ---- */

static volatile int release_worker, worker_in_handler;
static int worker_state;
static SEI_PURE void worker_wait(void) {
    worker_in_handler = 1;
    while (!release_worker) sched_yield();
}
static void *worker(void *arg) {
    (void)arg;
    SEI_LOCAL_HANDLER() {
        worker_state++;
        worker_wait();
    }
    return NULL;
}

static void case_barrier(void) {
    pthread_t th;
    CHECK(pthread_create(&th, NULL, worker, NULL) == 0);
    while (!worker_in_handler) sched_yield();
    SEI_LOCAL_HANDLER() { shared_value++; }
    int blocked = !sei_barrier(); /* the worker's handler is still running */
    release_worker = 1;
    pthread_join(th, NULL);
    int open = sei_barrier();
    printf("ok barrier blocked=%d open=%d\n", blocked, open);
}

/* ---- calls through pointers with no transactional clone ---- */

typedef int (*safe_fn)(int) SEI_SAFE;
static int clone_result;
/* Not SEI_SAFE, so GCC makes no clone: a handler may not call it through a pointer. */
__attribute__((noinline)) int unsafe_callee(int x) {
    printf("unsafe callee ran\n");
    return x + 1;
}
static void call_through(safe_fn fn) {
    SEI_LOCAL_HANDLER() { clone_result = fn(clone_result); }
    printf("not detected: %d\n", clone_result);
}
/* the program's mistake: a real function without a clone (exit 70) */
static void case_no_clone(void) { call_through((safe_fn)(uintptr_t)(void *)unsafe_callee); }
/* a fault's: a pointer into the middle of a function, or to data (exit 86) */
static void case_wild_pointer(void) { call_through((safe_fn)((uintptr_t)(void *)unsafe_callee + 3)); }
static void case_data_pointer(void) { call_through((safe_fn)(uintptr_t)&clone_result); }

/* ---- a reply far larger than the first write log: the log grows ---- */

static char big_reply[1 << 16];
static void case_big_reply(void) {
    SEI_LOCAL_HANDLER() {
        for (size_t i = 0; i < sizeof big_reply; i++) big_reply[i] = (char)('a' + i % 26);
        sei_output_append(big_reply, sizeof big_reply);
        sei_output_done();
    }
    uint32_t crc = sei_crc_pop();
    CHECK(crc == sei_crc32c(0, big_reply, sizeof big_reply));
    struct sei_stats st;
    sei_stats(&st);
    printf("ok big reply %zu bytes, %llu words logged\n", sizeof big_reply, (unsigned long long)st.max_words);
}

static const struct {
    const char *name;
    void (*run)(void);
} cases[] = {
    {"big-reply", case_big_reply},
    {"no-clone", case_no_clone},
    {"wild-pointer", case_wild_pointer},
    {"data-pointer", case_data_pointer},
    {"abi", case_abi},
    {"reset", case_reset},
    {"alloc", case_alloc},
    {"send", case_send},
    {"output", case_output},
    {"cancel", case_cancel},
    {"pure-handler", case_pure_handler},
    {"locks", case_locks},
    {"flip-e1", case_flip_e1},
    {"flip-e2", case_flip_e2},
    {"flip-branch", case_flip_branch},
    {"flip-output", case_flip_output},
    {"flip-send", case_flip_send},
    {"unlock-not-held", case_unlock_not_held},
    {"other-lock", case_other_lock},
    {"end-without-handler", case_end_without_handler},
    {"begin-twice", case_begin_twice},
    {"flip-between", case_flip_between},
    {"dup-quiet", case_dup_quiet},
    {"barrier", case_barrier},
};

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IONBF, 0);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (argc == 2 && strcmp(argv[1], cases[i].name) == 0) {
            cases[i].run();
            return 0;
        }
    fprintf(stderr, "usage: %s CASE\n", argv[0]);
    return 2;
}
