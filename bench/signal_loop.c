/* What a signal costs a replica on the fast path: N writes of 64 B to /dev/null, with an
 * interval timer (SIGALRM every US microseconds, SA_RESTART handler) or without one (US =
 * 0). Prints the writes on stdout and, on stderr, the handler's tick count and the ns per
 * write; the difference between a run with the timer and one without, divided by the
 * ticks, is the cost of one signal. Usage: signal_loop N US */
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>
static volatile sig_atomic_t ticks;
static void on_alarm(int sig) { (void)sig; ticks++; }
int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 200000;
    long us = argc > 2 ? atol(argv[2]) : 0;
    int fd = open("/dev/null", O_WRONLY);
    char buf[64] = {0};
    if (us > 0) {
        struct sigaction sa = {0};
        sa.sa_handler = on_alarm;
        sa.sa_flags = SA_RESTART;
        sigaction(SIGALRM, &sa, NULL);
        struct itimerval it = {{0, us}, {0, us}};
        setitimer(ITIMER_REAL, &it, NULL);
    }
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++)
        if (write(fd, buf, sizeof buf) != sizeof buf) return 1;
    clock_gettime(CLOCK_MONOTONIC, &b);
    struct itimerval off = {{0, 0}, {0, 0}};
    setitimer(ITIMER_REAL, &off, NULL);
    double s = (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9;
    printf("%ld writes in %.3f s\n", n, s);
    fprintf(stderr, "ticks %d, %.0f ns/write\n", (int)ticks, s * 1e9 / n);
    return 0;
}
