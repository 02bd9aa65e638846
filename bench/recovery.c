/*
 * Recovery benchmark workload for `lockstep run -r 3`.
 *
 * Usage: recovery MIB          the workload
 *        recovery MIB fork     native reference, not run under lockstep: prints
 *                              "fork_us N", the median time fork() takes in the
 *                              parent for a process with MIB MiB resident
 *
 * Allocates MIB mebibytes, writes to every page so that all of it is resident,
 * then writes 20 lines to stdout with one write(2) each. The lines depend on the
 * memory contents, so the replicas agree only if they computed the same thing.
 * Linked statically, the syscalls lockstep intercepts before the first write are
 * few and fixed (execve, prlimit64, readlink, getrandom, and rseq once lockstep
 * intercepts it), so write k is intercepted stop C + k for a constant C. bench/run.py
 * finds C with one calibration run and checks every run from the divergent line.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int cmp_ll(const void *a, const void *b)
{
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}

/* Median over 5 forks of the time fork() takes to return in the parent. */
static int fork_time(void)
{
    long long t[5];
    int i;
    for (i = 0; i < 5; i++) {
        long long t0 = now_ns();
        pid_t pid = fork();
        if (pid == 0)
            _exit(0);
        t[i] = now_ns() - t0;
        if (pid < 0 || waitpid(pid, NULL, 0) != pid)
            return 5;
    }
    qsort(t, 5, sizeof t[0], cmp_ll);
    printf("fork_us %lld\n", t[2] / 1000);
    return 0;
}

static size_t fmt_u64(char *p, unsigned long long v)
{
    char tmp[24];
    size_t n = 0, i;
    do {
        tmp[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    for (i = 0; i < n; i++)
        p[i] = tmp[n - 1 - i];
    return n;
}

int main(int argc, char **argv)
{
    long mib = argc > 1 ? atol(argv[1]) : 16;
    size_t size, page = 4096, off;
    unsigned char *mem;
    unsigned long long sum = 0;
    int k;

    if (mib < 0)
        return 2;
    size = (size_t)mib << 20;
    mem = size ? malloc(size) : NULL;
    if (size && !mem)
        return 3;
    for (off = 0; off < size; off += page)
        mem[off] = (unsigned char)(off >> 12);
    for (off = 0; off < size; off += page)
        sum += mem[off];
    if (argc > 2 && strcmp(argv[2], "fork") == 0)
        return fork_time();

    for (k = 1; k <= 20; k++) {
        char line[96];
        size_t n = 0;
        memcpy(line + n, "step ", 5);
        n += 5;
        n += fmt_u64(line + n, (unsigned long long)k);
        memcpy(line + n, " of 20, resident MiB ", 21);
        n += 21;
        n += fmt_u64(line + n, (unsigned long long)mib);
        memcpy(line + n, ", page sum ", 11);
        n += 11;
        n += fmt_u64(line + n, sum + (unsigned long long)k);
        line[n++] = '\n';
        if (write(1, line, n) != (ssize_t)n)
            return 4;
    }
    free(mem);
    return 0;
}
