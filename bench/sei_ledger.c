/* A handler-dominated service for libsei's speed goals (issue 18): each request is a
 * batch of 32 transfers between 4096 accounts ("T from to amount" lines); the handler
 * parses it, applies the transfers that the balances allow, folds each into an audit
 * hash, and formats a reply with sei_snprintf. Its work (a few thousand cycles of
 * parsing, loads and stores of state) dwarfs the fixed cost of the phases, unlike the
 * key-value store's (bench/sei_handler.c). Timed with rdtsc from phase I to sei_end.
 *
 * Built natively (-DSEI_NATIVE) and with lockstep cc by bench/sei_bench.py; prints one
 * JSON line: median cycles per handler over OPS handlers, and a checksum of the final
 * state that must equal the native build's. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <x86intrin.h>

#include "sei.h"

#define ACCOUNTS 4096
#define TRANSFERS 32
#define OPS 20000

static int64_t balance[ACCOUNTS];
static uint64_t audit;
static uint64_t applied, refused;
static char reply[128];
static size_t reply_len;
static char request[TRANSFERS * 32];

/* Reads a decimal number at *p (instrumented reads of the request, as plain code does). */
static uint64_t number(const char **p) {
    uint64_t v = 0;
    while (**p == ' ') (*p)++;
    while (**p >= '0' && **p <= '9') v = v * 10 + (uint64_t)(*(*p)++ - '0');
    return v;
}

static void apply_batch(const char *req, size_t len) {
    const char *p = req, *end = req + len;
    int moved = 0;
    while (p < end && *p == 'T') {
        p++;
        uint64_t from = number(&p) % ACCOUNTS, to = number(&p) % ACCOUNTS;
        int64_t amount = (int64_t)number(&p);
        while (p < end && *p != '\n') p++;
        p++;
        if (balance[from] >= amount) {
            balance[from] -= amount;
            balance[to] += amount;
            audit = (audit ^ (from << 32 ^ to << 12 ^ (uint64_t)amount)) * 0x100000001b3ull;
            applied++;
            moved++;
        } else {
            refused++;
        }
    }
    reply_len = (size_t)sei_snprintf(reply, sizeof reply, "OK %d moved, audit %016llx\r\n", moved,
                                     (unsigned long long)audit);
}

static uint64_t handle(size_t len, uint32_t crc) {
    uint64_t start = __rdtsc();
    if (sei_begin(request, len, crc)) {
        SEI_ATOMIC {
            apply_batch(request, len);
            sei_output_append(reply, reply_len);
            sei_output_done();
        }
        sei_end();
        (void)sei_crc_pop();
    }
    return __rdtsc() - start;
}

static int by_value(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

int main(void) {
    static uint64_t cycles[OPS];
    srand(7);
    for (int i = 0; i < ACCOUNTS; i++) balance[i] = 1000;
    for (int op = 0; op < OPS; op++) {
        size_t n = 0;
        for (int k = 0; k < TRANSFERS; k++)
            n += (size_t)snprintf(request + n, sizeof request - n, "T %d %d %d\n", rand() % ACCOUNTS,
                                  rand() % ACCOUNTS, rand() % 300);
        cycles[op] = handle(n, sei_crc32c(0, request, n));
    }
    qsort(cycles, OPS, sizeof cycles[0], by_value);
    uint64_t sum = audit ^ applied << 20 ^ refused;
    for (int i = 0; i < ACCOUNTS; i++) sum = sum * 31 + (uint64_t)balance[i];
    printf("{\"service\": \"ledger\", \"transfers\": %d, \"handler_cycles\": %llu, \"state_checksum\": \"%016llx\"}\n",
           TRANSFERS, (unsigned long long)cycles[OPS / 2], (unsigned long long)sum);
    return 0;
}
