/* digest.c - workload (a) of the fault-injection evaluation: a CPU-bound program that
 * prints a digest, in the spirit of RCoE's md5sum test, but with its input generated in
 * memory so that it makes almost no syscalls (a replica then runs freely between its
 * start and its single write, as the native program does).
 *
 * It fills a 4 MiB heap buffer from a fixed xorshift generator, then hashes it ROUNDS
 * times with a 64-bit multiply-xorshift hash, chaining the rounds, and prints the final
 * 64-bit digest in hex. Usage: digest [ROUNDS] (default 12).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define WORDS (4u << 20) / 8

static uint64_t mix(uint64_t h, uint64_t v)
{
    h ^= v * 0x9E3779B97F4A7C15ull;
    h = (h << 27) | (h >> 37);
    return h * 0xBF58476D1CE4E5B9ull + 0x94D049BB133111EBull;
}

int main(int argc, char **argv)
{
    int rounds = argc > 1 ? atoi(argv[1]) : 12;
    uint64_t *buf = malloc(WORDS * sizeof *buf);
    if (!buf)
        return 1;
    uint64_t x = 88172645463325252ull;
    for (size_t i = 0; i < WORDS; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        buf[i] = x;
    }
    uint64_t h = 0;
    for (int r = 0; r < rounds; r++)
        for (size_t i = 0; i < WORDS; i++)
            h = mix(h, buf[i] + (uint64_t)r);
    printf("%016llx\n", (unsigned long long)h);
    free(buf);
    return 0;
}
