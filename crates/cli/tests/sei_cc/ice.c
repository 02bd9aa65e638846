/* `lockstep cc` test fixture: GCC 12 crashes ("internal compiler error: in
 * requires_barrier, at trans-mem.cc:1538") when a loop that reads a string literal is
 * inlined into a handler at -O1 and above: ivopts bases the address on the literal,
 * which the TM instrumentation does not expect. `lockstep cc` retries with -fno-ivopts.
 * Prints the same lines hardened and native. */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "sei.h"

static unsigned gets, sets;

static int starts_with(const char *s, size_t n, const char *prefix) {
    for (size_t i = 0; prefix[i]; i++)
        if (i >= n || s[i] != prefix[i]) return 0;
    return 1;
}

int main(void) {
    static const char *const requests[] = {"get a", "set b 1", "get c", "delete d"};
    for (unsigned i = 0; i < 4; i++) {
        const char *m = requests[i];
        size_t n = strlen(m);
        SEI_HANDLER(m, n, sei_crc32c(0, m, n)) {
            if (starts_with(m, n, "get ")) gets++;
            else if (starts_with(m, n, "set ")) sets++;
        }
        printf("%s: gets=%u sets=%u\n", m, gets, sets);
    }
    return 0;
}
