/* `lockstep cc` test fixture: an always_inline helper that GCC finds to be const.
 * Under -fgnu-tm GCC 12 makes such a function transaction-pure and then refuses to inline
 * it into any function that is not ("inlining failed in call to 'always_inline' 'mix':"
 * with an empty reason), as in memcached's xxhash.h and murmur3_hash.c. It is called
 * outside the handler (hash) and inside it. Prints the same lines hardened and native. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "sei.h"

static inline __attribute__((always_inline)) uint32_t mix(uint32_t h, uint32_t r) {
    return (h << r | h >> (32 - r)) * 0x9e3779b1u;
}

uint32_t hash(const char *s) {
    uint32_t h = 17;
    while (*s) h = mix(h ^ (unsigned char)*s++, 5);
    return h;
}

static uint32_t table[8];

int main(void) {
    static const char *const keys[] = {"alpha", "beta", "gamma"};
    for (unsigned i = 0; i < 3; i++) {
        const char *k = keys[i];
        size_t n = strlen(k);
        uint32_t h = hash(k);
        SEI_HANDLER(k, n, sei_crc32c(0, k, n)) { table[h % 8] = mix(table[h % 8] + h, 7); }
        printf("%s %08x %08x\n", k, (unsigned)h, (unsigned)table[h % 8]);
    }
    return 0;
}
