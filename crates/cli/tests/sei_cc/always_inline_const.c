/* `lockstep cc` test fixture: an always_inline helper declared const. GCC makes it
 * transaction-pure whatever -fipa-pure-const says, so it can only be called, not inlined:
 * `lockstep cc` retries a second time with always_inline turned into `unused`. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "sei.h"

static inline __attribute__((always_inline, const)) uint32_t fmix(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    return h;
}

static uint32_t state;

int main(void) {
    static const char *const keys[] = {"one", "two", "three"};
    for (unsigned i = 0; i < 3; i++) {
        size_t n = strlen(keys[i]);
        uint32_t h = fmix((uint32_t)n + i);
        SEI_HANDLER(keys[i], n, sei_crc32c(0, keys[i], n)) { state = fmix(state ^ h); }
        printf("%s %08x %08x\n", keys[i], (unsigned)h, (unsigned)state);
    }
    return 0;
}
