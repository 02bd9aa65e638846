/* kernels.c - small SPLASH2-like parallel kernels for issue 17's overhead goal (wall time
 * under `lockstep run` against native, bench/kernels.py).
 *
 * Usage: kernels prefix|stencil|queue THREADS SIZE ROUNDS
 *
 *   prefix   a parallel prefix sum over SIZE longs, ROUNDS times: each thread sums its
 *            block, a barrier, thread 0 scans the block sums, a barrier, each thread
 *            adds its offset to its block. Three barrier waits per round per thread.
 *   stencil  a 1-D three-point Jacobi stencil over SIZE doubles, ROUNDS sweeps: each
 *            thread updates its block from the previous sweep's array, then a barrier.
 *            One barrier wait per sweep per thread: barrier-heavy when SIZE is small.
 *   queue    a work queue: main pushes SIZE tasks ROUNDS times into a bounded queue under
 *            a mutex and two condition variables; workers pop a task, hash a 256-byte
 *            buffer seeded by it, and add the hash to their own sum under a second mutex.
 *            Several lock operations per task.
 *
 * Every kernel ends by printing one checksum line that does not depend on how the
 * threads interleave, so native and replicated runs print the same. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_THREADS 16
#define QUEUE_CAP 64

static long threads, size, rounds;
static pthread_barrier_t barrier;

/* --- prefix ------------------------------------------------------------------------- */
static long *values;
static long block_sums[MAX_THREADS];

static void *prefix_worker(void *arg)
{
    long t = (long)arg;
    long lo = size * t / threads, hi = size * (t + 1) / threads;
    for (long r = 0; r < rounds; r++) {
        long sum = 0;
        for (long i = lo; i < hi; i++)
            sum += values[i];
        block_sums[t] = sum;
        pthread_barrier_wait(&barrier);
        if (t == 0) {
            long running = 0;
            for (long b = 0; b < threads; b++) {
                long s = block_sums[b];
                block_sums[b] = running;
                running += s;
            }
        }
        pthread_barrier_wait(&barrier);
        /* Each round turns the values into their prefix sums, reduced to stay small. */
        long running = block_sums[t];
        for (long i = lo; i < hi; i++) {
            running += values[i];
            values[i] = running % 1000003;
        }
        pthread_barrier_wait(&barrier);
    }
    return NULL;
}

/* --- stencil ------------------------------------------------------------------------ */
static double *grid[2];

static void *stencil_worker(void *arg)
{
    long t = (long)arg;
    long lo = size * t / threads, hi = size * (t + 1) / threads;
    for (long r = 0; r < rounds; r++) {
        const double *from = grid[r % 2];
        double *to = grid[(r + 1) % 2];
        for (long i = lo; i < hi; i++) {
            double left = i > 0 ? from[i - 1] : 0.0, right = i + 1 < size ? from[i + 1] : 0.0;
            to[i] = (left + from[i] + right) / 3.0;
        }
        pthread_barrier_wait(&barrier);
    }
    return NULL;
}

/* --- queue -------------------------------------------------------------------------- */
static pthread_mutex_t queue_lock = PTHREAD_MUTEX_INITIALIZER, sum_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t not_empty = PTHREAD_COND_INITIALIZER, not_full = PTHREAD_COND_INITIALIZER;
static long queue[QUEUE_CAP], queue_head, queue_len;
static int queue_closed;
static uint64_t total_hash;

static uint64_t task_hash(long task)
{
    unsigned char buf[256];
    uint64_t h = 1469598103934665603ULL ^ (uint64_t)task;
    for (int i = 0; i < 256; i++)
        buf[i] = (unsigned char)(task * 31 + i);
    for (int pass = 0; pass < 8; pass++)
        for (int i = 0; i < 256; i++)
            h = (h ^ buf[i]) * 1099511628211ULL;
    return h;
}

static void *queue_worker(void *arg)
{
    (void)arg;
    for (;;) {
        pthread_mutex_lock(&queue_lock);
        while (queue_len == 0 && !queue_closed)
            pthread_cond_wait(&not_empty, &queue_lock);
        if (queue_len == 0) {
            pthread_mutex_unlock(&queue_lock);
            return NULL;
        }
        long task = queue[queue_head];
        queue_head = (queue_head + 1) % QUEUE_CAP;
        queue_len--;
        pthread_cond_signal(&not_full);
        pthread_mutex_unlock(&queue_lock);
        uint64_t h = task_hash(task);
        pthread_mutex_lock(&sum_lock);
        total_hash += h; /* a sum: the same whichever worker took which task */
        pthread_mutex_unlock(&sum_lock);
    }
}

static void push_tasks(void)
{
    for (long r = 0; r < rounds; r++)
        for (long task = 0; task < size; task++) {
            pthread_mutex_lock(&queue_lock);
            while (queue_len == QUEUE_CAP)
                pthread_cond_wait(&not_full, &queue_lock);
            queue[(queue_head + queue_len) % QUEUE_CAP] = r * size + task;
            queue_len++;
            pthread_cond_signal(&not_empty);
            pthread_mutex_unlock(&queue_lock);
        }
    pthread_mutex_lock(&queue_lock);
    queue_closed = 1;
    pthread_cond_broadcast(&not_empty);
    pthread_mutex_unlock(&queue_lock);
}

static int usage(void)
{
    fprintf(stderr, "usage: kernels prefix|stencil|queue THREADS(1-%d) SIZE ROUNDS\n", MAX_THREADS);
    return 2;
}

int main(int argc, char **argv)
{
    if (argc != 5)
        return usage();
    const char *kernel = argv[1];
    threads = atol(argv[2]);
    size = atol(argv[3]);
    rounds = atol(argv[4]);
    if (threads < 1 || threads > MAX_THREADS || size < threads || size > (1L << 28) || rounds < 1)
        return usage();
    void *(*worker)(void *);
    if (strcmp(kernel, "prefix") == 0) {
        values = malloc(sizeof *values * (size_t)size);
        if (values == NULL)
            return 1;
        for (long i = 0; i < size; i++)
            values[i] = i % 7;
        worker = prefix_worker;
    } else if (strcmp(kernel, "stencil") == 0) {
        grid[0] = malloc(sizeof(double) * (size_t)size);
        grid[1] = malloc(sizeof(double) * (size_t)size);
        if (grid[0] == NULL || grid[1] == NULL)
            return 1;
        for (long i = 0; i < size; i++)
            grid[0][i] = grid[1][i] = (double)(i % 100);
        worker = stencil_worker;
    } else if (strcmp(kernel, "queue") == 0) {
        worker = queue_worker;
    } else {
        return usage();
    }
    pthread_barrier_init(&barrier, NULL, (unsigned)threads);
    pthread_t tid[MAX_THREADS];
    for (long t = 0; t < threads; t++)
        if (pthread_create(&tid[t], NULL, worker, (void *)t) != 0)
            return 1;
    if (worker == queue_worker)
        push_tasks();
    for (long t = 0; t < threads; t++)
        pthread_join(tid[t], NULL);
    if (worker == prefix_worker) {
        long check = 0;
        for (long i = 0; i < size; i++)
            check = (check * 31 + values[i]) % 1000000007;
        printf("prefix %ld threads %ld size %ld rounds checksum %ld\n", threads, size, rounds, check);
    } else if (worker == stencil_worker) {
        double check = 0;
        for (long i = 0; i < size; i++)
            check += grid[rounds % 2][i] * (double)(i % 13 + 1);
        printf("stencil %ld threads %ld size %ld rounds checksum %.6e\n", threads, size, rounds, check);
    } else {
        printf("queue %ld threads %ld tasks %ld rounds checksum %016llx\n", threads, size, rounds,
               (unsigned long long)total_hash);
    }
    return 0;
}
