/* CRC32C (Castagnoli, reflected 0x82F63B78), the checksum every lockstep component
 * shares: SSE4.2's crc32 instruction where the CPU has it, a table otherwise. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "internal.h"

static uint32_t table[256];
static int use_hw = -1;

__attribute__((constructor)) static void init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        table[i] = c;
    }
    use_hw = __builtin_cpu_supports("sse4.2") ? 1 : 0;
}

__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const unsigned char *p, size_t len) {
    uint64_t c = crc;
    while (len >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = __builtin_ia32_crc32di(c, v);
        p += 8;
        len -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (len--) c32 = __builtin_ia32_crc32qi(c32, *p++);
    return c32;
}

static uint32_t crc_sw(uint32_t crc, const unsigned char *p, size_t len) {
    while (len--) crc = table[(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return crc;
}

/* Continues a CRC: sei_crc32c(sei_crc32c(0, a, n), b, m) == sei_crc32c(0, ab, n + m). */
uint32_t sei_crc32c(uint32_t crc, const void *buf, size_t len) {
    if (__builtin_expect(use_hw < 0, 0)) init();
    crc = ~crc;
    crc = use_hw ? crc_hw(crc, buf, len) : crc_sw(crc, buf, len);
    return ~crc;
}
