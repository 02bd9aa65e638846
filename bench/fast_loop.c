/* Per-call cost of hot syscalls: N iterations of read(/dev/zero, 64 B) + write(/dev/null,
 * 64 B), timed with clock_gettime(CLOCK_MONOTONIC) around the loop. Prints
 * `ns_per_call <float>` = elapsed ns / (2*N). Used by bench/fast_bench.py to compare
 * native runs with `lockstep run --backend fast|ptrace`. Usage: fast_loop N */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s N\n", argv[0]);
        return 2;
    }
    char *end;
    errno = 0;
    long long n = strtoll(argv[1], &end, 10);
    if (errno != 0 || *end != '\0' || n <= 0) {
        fprintf(stderr, "fast_loop: bad N: %s\n", argv[1]);
        return 2;
    }
    int zero = open("/dev/zero", O_RDONLY);
    if (zero < 0) {
        perror("fast_loop: open /dev/zero");
        return 1;
    }
    int null = open("/dev/null", O_WRONLY);
    if (null < 0) {
        perror("fast_loop: open /dev/null");
        return 1;
    }
    char buf[64];
    memset(buf, 1, sizeof buf);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long long i = 0; i < n; i++) {
        ssize_t r = read(zero, buf, sizeof buf);
        if (r != (ssize_t)sizeof buf) {
            fprintf(stderr, "fast_loop: short read at %lld: %zd (%s)\n", i, r,
                    r < 0 ? strerror(errno) : "short");
            return 1;
        }
        ssize_t w = write(null, buf, sizeof buf);
        if (w != (ssize_t)sizeof buf) {
            fprintf(stderr, "fast_loop: short write at %lld: %zd (%s)\n", i, w,
                    w < 0 ? strerror(errno) : "short");
            return 1;
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double ns = (double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec);
    printf("ns_per_call %.3f\n", ns / (2.0 * (double)n));
    return 0;
}
