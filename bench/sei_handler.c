/* Handler cycles of the example key-value store (SEI's Table 5, for our server): the
 * same handler as sei/examples/kv_net.c, timed with rdtsc around phase I to sei_end,
 * for get and set of 8 B, 128 B and 1 KiB values. Built twice by bench/sei_bench.sh:
 * with lockstep cc (hardened; SEI_MODE picks ecc or dup) and with -DSEI_NATIVE.
 * Prints one JSON object per line. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <x86intrin.h>

#include "kv_store.h"

#define KEYS 1000
#define OPS 20000

static struct kv_store store;
static struct kv_reply reply;

static uint64_t handle(const char *req, size_t len) {
    uint32_t crc = sei_crc32c(0, req, len);
    uint64_t start = __rdtsc();
    if (sei_begin(req, len, crc)) {
        SEI_ATOMIC {
            sei_ignore_addr(&reply, sizeof reply);
            kv_execute(&store, req, len, &reply);
            sei_output_append(reply.buf, reply.len);
            sei_output_done();
        }
        sei_end();
        (void)sei_crc_pop();
    }
    return __rdtsc() - start;
}

static size_t make_set(char *buf, int key, size_t size) {
    size_t n = (size_t)sprintf(buf, "set key%d 0 0 %zu\r\n", key, size);
    memset(buf + n, 'a' + key % 26, size);
    memcpy(buf + n + size, "\r\n", 2);
    return n + size + 2;
}

int main(void) {
    if (kv_store_init(&store, 0) != 0) return 1;
    static char req[8192];
    const size_t sizes[] = {8, 128, 1024};
    srand(1);
    for (size_t s = 0; s < 3; s++) {
        for (int k = 0; k < KEYS; k++) handle(req, make_set(req, k, sizes[s]));
        uint64_t set_cycles = 0, get_cycles = 0;
        for (int i = 0; i < OPS; i++) {
            int key = rand() % KEYS;
            set_cycles += handle(req, make_set(req, key, sizes[s]));
            size_t n = (size_t)sprintf(req, "get key%d\r\n", rand() % KEYS);
            get_cycles += handle(req, n);
        }
        printf("{\"value_bytes\": %zu, \"set_cycles\": %.0f, \"get_cycles\": %.0f}\n", sizes[s],
               (double)set_cycles / OPS, (double)get_cycles / OPS);
    }
#ifndef SEI_NATIVE
    struct sei_stats st;
    sei_stats(&st);
    printf("{\"bytes_per_thread\": %zu, \"max_words\": %llu, \"handlers\": %llu}\n", st.bytes_per_thread,
           (unsigned long long)st.max_words, (unsigned long long)st.handlers);
#endif
    return 0;
}
