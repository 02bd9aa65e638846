/* A handler-dominated service for libsei's speed goals (issue 18): each request is a
 * batch of 32 transfers between 4096 accounts ("T from to amount" lines); the handler
 * parses it, applies the transfers that the balances allow, folds each into an audit
 * hash, and formats a reply with sei_snprintf. Its work (a few thousand cycles of
 * parsing, loads and stores of state) dwarfs the fixed cost of the phases, unlike the
 * key-value store's (bench/sei_handler.c). Timed with rdtsc from phase I to sei_end.
 *
 * Built natively (-DSEI_NATIVE) and with lockstep cc by bench/sei_bench.py; prints one
 * JSON line: median cycles per handler over OPS handlers, and a checksum of the final
 * state that must equal the native build's. The handler is in bench/sei_ledger.h,
 * shared with the TCP server of the fault campaign (bench/sei_ledger_server.c). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <x86intrin.h>

#include "sei.h"
#include "sei_ledger.h"

#define OPS 20000

static char reply[LEDGER_REPLY_MAX];
static size_t reply_len;
static char request[TRANSFERS * 32];

static uint64_t handle(size_t len, uint32_t crc) {
    uint64_t start = __rdtsc();
    if (sei_begin(request, len, crc)) {
        SEI_ATOMIC {
            reply_len = apply_batch(request, len, reply, sizeof reply);
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
    ledger_init();
    for (int op = 0; op < OPS; op++) {
        size_t n = 0;
        for (int k = 0; k < TRANSFERS; k++)
            n += (size_t)snprintf(request + n, sizeof request - n, "T %d %d %d\n", rand() % ACCOUNTS,
                                  rand() % ACCOUNTS, rand() % 300);
        cycles[op] = handle(n, sei_crc32c(0, request, n));
    }
    qsort(cycles, OPS, sizeof cycles[0], by_value);
    uint64_t sum = ledger_checksum();
    printf("{\"service\": \"ledger\", \"transfers\": %d, \"handler_cycles\": %llu, \"state_checksum\": \"%016llx\"}\n",
           TRANSFERS, (unsigned long long)cycles[OPS / 2], (unsigned long long)sum);
    return 0;
}
