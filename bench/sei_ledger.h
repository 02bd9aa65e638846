/* The handler of the handler-dominated ledger service (issue 18), shared by the
 * in-process benchmark (bench/sei_ledger.c) and its TCP server (bench/sei_ledger_server.c)
 * so that the fault campaign (bench/sei_ledger_eval.sh) injects into the very code whose
 * cost bench/sei_bench.py measures: the same state, the same parsing, the same transfer
 * rule and the same reply.
 *
 * A batch is "T from to amount\n" lines; the handler applies the transfers that the
 * balances allow, folds each applied one into an audit hash, and formats the reply with
 * sei_snprintf. Everything here is static (one copy of the state per program) and
 * inline (a program that uses only part of it builds clean with -Wall -Werror). */
#ifndef SEI_LEDGER_H
#define SEI_LEDGER_H

#include <stddef.h>
#include <stdint.h>

#include "sei.h"

#define ACCOUNTS 4096
#define TRANSFERS 32
/* Every reply below fits: "OK <int> moved, audit <16 hex>\r\n", "CHECKSUM <16 hex>\r\n". */
#define LEDGER_REPLY_MAX 128

static int64_t balance[ACCOUNTS];
static uint64_t audit;
static uint64_t applied, refused;

static inline void ledger_init(void) {
    for (int i = 0; i < ACCOUNTS; i++) balance[i] = 1000;
}

/* Reads a decimal number at *p (instrumented reads of the request, as plain code does).
 * It stops at the first byte that is neither a space nor a digit, so a request whose
 * lines end with '\n' bounds it. */
static inline uint64_t number(const char **p) {
    uint64_t v = 0;
    while (**p == ' ') (*p)++;
    while (**p >= '0' && **p <= '9') v = v * 10 + (uint64_t)(*(*p)++ - '0');
    return v;
}

/* Applies the batch req[0..len) and writes the reply to reply[0..size); returns its
 * length. */
static inline size_t apply_batch(const char *req, size_t len, char *reply, size_t size) {
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
    return (size_t)sei_snprintf(reply, size, "OK %d moved, audit %016llx\r\n", moved, (unsigned long long)audit);
}

/* A digest of the whole state: what a run must end with to have served every batch
 * right (the benchmark prints it; the server answers it to "C"). */
static inline uint64_t ledger_checksum(void) {
    uint64_t sum = audit ^ applied << 20 ^ refused;
    for (int i = 0; i < ACCOUNTS; i++) sum = sum * 31 + (uint64_t)balance[i];
    return sum;
}

/* The server's handler: a request that starts with the line "C" asks for the checksum
 * (a read of all the state, hardened like a batch), any other is a batch. */
static inline size_t ledger_handle(const char *req, size_t len, char *reply, size_t size) {
    if (len >= 2 && req[0] == 'C' && req[1] == '\n')
        return (size_t)sei_snprintf(reply, size, "CHECKSUM %016llx\r\n", (unsigned long long)ledger_checksum());
    return apply_batch(req, len, reply, size);
}

#endif
