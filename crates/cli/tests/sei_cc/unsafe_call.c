/* `lockstep cc` test fixture: a handler whose static helpers end in libc calls that GCC
 * cannot instrument. GCC names the helper called from the transaction ("unsafe function
 * call 'handle_get' within atomic transaction"); `lockstep cc` must add the chain down
 * to strlen and memcmp, and name sei_strlen and sei_memcmp. The SEI_PURE helper's strlen
 * and the memcpy are fine and must not be blamed. */
#include <stddef.h>
#include <string.h>

#include "sei.h"

static char last_key[32];
static unsigned hits;

static size_t key_length(const char *key) { return strlen(key); }

static size_t parse_key(const char *msg) { return key_length(msg + 4); }

static int same_key(const char *key, size_t n) { return n < sizeof last_key && memcmp(key, last_key, n) == 0; }

static SEI_PURE size_t pure_length(const char *msg) { return strlen(msg); }

static void handle_get(const char *msg) {
    size_t n = parse_key(msg);
    if (same_key(msg + 4, n)) hits++;
    if (n < sizeof last_key) memcpy(last_key, msg + 4, n);
}

int serve(const char *msg, size_t len, unsigned crc) {
    SEI_HANDLER(msg, len, crc) {
        if (pure_length(msg) > 4) handle_get(msg);
    }
    return (int)hits;
}
