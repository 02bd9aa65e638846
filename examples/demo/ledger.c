/* The demo workload: a toy bank ledger. It applies pseudo-random transfers between
 * accounts and writes one line per batch with write(2), so every line is an output that
 * lockstep votes on. Deterministic: a native run and a replicated run print the same. */
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#define ACCOUNTS 8
#define BATCHES 12
#define TRANSFERS_PER_BATCH 5000

static uint64_t next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

int main(void)
{
    int64_t balance[ACCOUNTS];
    uint64_t seed = 0x2545F4914F6CDD1DULL;
    char line[160];
    for (int a = 0; a < ACCOUNTS; a++)
        balance[a] = 1000000;
    for (int batch = 1; batch <= BATCHES; batch++) {
        for (int t = 0; t < TRANSFERS_PER_BATCH; t++) {
            uint64_t r = next(&seed);
            int from = r % ACCOUNTS, to = (r >> 8) % ACCOUNTS;
            int64_t amount = (int64_t)((r >> 16) % 500);
            if (from != to && balance[from] >= amount) {
                balance[from] -= amount;
                balance[to] += amount;
            }
        }
        int64_t total = 0;
        for (int a = 0; a < ACCOUNTS; a++)
            total += balance[a];
        int n = snprintf(line, sizeof line, "batch %2d: acct0=%7lld acct1=%7lld acct2=%7lld total=%lld\n", batch,
                         (long long)balance[0], (long long)balance[1], (long long)balance[2], (long long)total);
        if (write(1, line, (size_t)n) != n)
            return 1;
    }
    return 0;
}
