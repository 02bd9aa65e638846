/* sei.h's libc subset against libc itself, on random inputs.
 *
 *   libc WHERE N SEED     WHERE: handler (each call inside a hardened handler), plain
 *                         (a hardened build, outside handlers) or native (-DSEI_NATIVE)
 *
 * Each case computes libc's answer first, outside any handler, then the subset's (in a
 * handler when asked, on inputs held in handler state, so that dup mode checks its
 * reads), and compares result, end pointer, errno and output bytes. Prints "ok libc N"
 * or the first mismatch (exit 1). crates/cli/tests/sei.rs runs it. */
#define _POSIX_C_SOURCE 200809L /* strnlen, the reference */
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sei.h"

static uint64_t rng;
static uint64_t next(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}
static unsigned below(unsigned n) { return (unsigned)(next() % n); }

static int in_handler;

static void mismatch(const char *what, unsigned long long seed_case) {
    fprintf(stderr, "mismatch in %s (case %llu)\n", what, seed_case);
    exit(1);
}

/* ---- inputs, written outside handlers and read inside; results, written only inside
 * (dup mode keeps a copy of what handlers write and checks it at their reads, so a
 * result written outside too would look like corruption) ---- */
static char text_a[96], text_b[96];
static size_t size_a, size_n;
static int char_c, base_n;
static unsigned long long utoa_value;
static long long result_i;
static unsigned long long result_u;
static const void *result_p;
static char *result_end;
static char out[160];
static char out_libc[160];

/* The strings of one random case: bytes from an alphabet that exercises each function. */
static void random_text(char *buf, size_t cap, const char *alphabet) {
    size_t n = below((unsigned)cap - 1);
    size_t k = strlen(alphabet);
    for (size_t i = 0; i < n; i++) buf[i] = alphabet[below((unsigned)k)];
    buf[n] = 0;
}

/* Runs body once: in a handler (twice, then validated) or plainly. */
#define RUN(body)                                     \
    do {                                              \
        if (in_handler) {                             \
            if (sei_begin_nm()) {                     \
                SEI_ATOMIC { body; }                  \
                sei_end();                            \
            }                                         \
        } else {                                      \
            body;                                     \
        }                                             \
    } while (0)

static void case_memory(unsigned long long c) {
    random_text(text_a, 64, "ab\001\377");
    memcpy(text_b, text_a, sizeof text_a);
    if (below(2)) text_b[below(64)] ^= (char)(1u << below(8));
    size_a = below(64);
    char_c = (int)below(2) ? (unsigned char)text_a[below(64)] : (int)below(512) - 128;
    int want_cmp = memcmp(text_a, text_b, size_a);
    const void *want_chr = memchr(text_a, char_c, size_a);
    RUN(result_i = sei_memcmp(text_a, text_b, size_a); result_p = sei_memchr(text_a, char_c, size_a));
    if ((want_cmp > 0) != (result_i > 0) || (want_cmp < 0) != (result_i < 0)) mismatch("sei_memcmp", c);
    if (want_chr != result_p) mismatch("sei_memchr", c);
}

static void case_strings(unsigned long long c) {
    random_text(text_a, 80, "abc\001\377");
    size_n = below(90);
    char_c = (int)below(3) == 0 ? 0 : (int)below(2) ? 'b' : (int)below(600) - 200;
    size_t want_len = strlen(text_a);
    size_t want_nlen = strnlen(text_a, size_n);
    const char *want_chr = strchr(text_a, char_c);
    RUN(result_u = sei_strlen(text_a); result_i = (long long)sei_strnlen(text_a, size_n);
        result_p = sei_strchr(text_a, char_c));
    if (want_len != result_u) mismatch("sei_strlen", c);
    if ((long long)want_nlen != result_i) mismatch("sei_strnlen", c);
    if (want_chr != result_p) mismatch("sei_strchr", c);
}

static void case_numbers(unsigned long long c) {
    static const int bases[] = {0, 0, 0, 10, 10, 16, 8, 2, 36, 1, 37, -1, 5, 20};
    base_n = bases[below(sizeof bases / sizeof bases[0])];
    if (below(4) == 0) { /* long digit runs: the overflow boundary */
        size_t n = 15 + below(12);
        size_t i = 0;
        if (below(2)) text_a[i++] = below(2) ? '-' : '+';
        for (; i < n; i++) text_a[i] = below(3) ? '9' : (char)('0' + below(10));
        text_a[i] = 0;
    } else {
        random_text(text_a, 28, " \t+-0xX0123456789abcdefzAZ");
    }
    int unsigned_long = (int)below(2);
    char *want_end = (char *)1;
    errno = 0;
    unsigned long long want = unsigned_long ? strtoul(text_a, &want_end, base_n) : strtoull(text_a, &want_end, base_n);
    int want_errno = errno;
    errno = 0;
    if (unsigned_long)
        RUN(result_end = (char *)1; result_u = sei_strtoul(text_a, &result_end, base_n));
    else
        RUN(result_end = (char *)1; result_u = sei_strtoull(text_a, &result_end, base_n));
    if (want != result_u || want_end != result_end || want_errno != errno) {
        fprintf(stderr, "\"%s\" base %d: libc %llu end %+td errno %d, sei %llu end %+td errno %d\n", text_a, base_n,
                want, want_end - text_a, want_errno, result_u, result_end - text_a, errno);
        mismatch(unsigned_long ? "sei_strtoul" : "sei_strtoull", c);
    }
    /* utoa against the same value in the bases printf knows */
    static const unsigned utoa_bases[] = {10, 16, 8};
    unsigned b = utoa_bases[below(3)];
    unsigned long long v = below(4) == 0 ? ULLONG_MAX - below(3) : next() >> below(64);
    int n = snprintf(out_libc, sizeof out_libc, b == 10 ? "%llu" : b == 16 ? "%llx" : "%llo", v);
    utoa_value = v;
    RUN(result_i = (long long)sei_utoa(utoa_value, out, b));
    if (result_i != n || strcmp(out, out_libc) != 0) mismatch("sei_utoa", c);
}

/* ---- sei_snprintf: one random conversion between literal text ---- */

enum arg_kind { K_INT, K_LONG, K_LLONG, K_SIZE, K_UINT, K_ULONG, K_ULLONG, K_CHAR, K_STR, K_PTR, K_HH, K_H };
static char format[64];
static int star_w, star_p, width_v, prec_v, fmt_kind;
static long long value_s;
static unsigned long long value_u;
static void *value_p;
static size_t out_size;

static long long random_signed(void) {
    static const long long edges[] = {0, 1, -1, INT_MIN, INT_MAX, LLONG_MIN, LLONG_MAX, 42, -42};
    return below(3) == 0 ? edges[below(9)] : (long long)(next() >> below(64)) * (below(2) ? 1 : -1);
}

static void random_format(void) {
    static const char *const convs[] = {"d", "i", "ld", "lld", "zu", "u", "lu", "llu", "x", "X", "o",
                                        "llx", "c", "s", "p", "hhd", "hd"};
    static const enum arg_kind kinds[] = {K_INT, K_INT, K_LONG, K_LLONG, K_SIZE, K_UINT, K_ULONG, K_ULLONG, K_UINT,
                                          K_UINT, K_UINT, K_ULLONG, K_CHAR, K_STR, K_PTR, K_HH, K_H};
    unsigned which = below(sizeof convs / sizeof convs[0]);
    const char *conv = convs[which];
    char last = conv[strlen(conv) - 1];
    fmt_kind = kinds[which];
    int numeric = strchr("diuxXo", last) != NULL;
    char *f = format;
    f += sprintf(f, "%s", below(2) ? "a%%b" : "");
    *f++ = '%';
    /* flags only where C defines them for the conversion */
    if (below(3) == 0) *f++ = '-';
    if ((last == 'd' || last == 'i') && below(3) == 0) *f++ = '+';
    if ((last == 'd' || last == 'i') && below(3) == 0) *f++ = ' ';
    if (strchr("xXo", last) && below(2)) *f++ = '#';
    if (numeric && below(3) == 0) *f++ = '0';
    star_w = star_p = 0;
    if (below(3) == 0) {
        star_w = 1;
        width_v = (int)below(30) - 10;
        *f++ = '*';
    } else if (below(2)) {
        f += sprintf(f, "%u", below(25));
    }
    if ((numeric || last == 's') && below(2)) {
        *f++ = '.';
        if (below(3) == 0) {
            star_p = 1;
            prec_v = (int)below(30) - 5;
            *f++ = '*';
        } else {
            f += sprintf(f, "%u", below(22));
        }
    }
    f += sprintf(f, "%s%s", conv, below(2) ? "|tail" : "");
    *f = 0;
    value_s = random_signed();
    value_u = (unsigned long long)random_signed();
    static char words[4][24] = {"", "x", "hello, world", "a longer string here"};
    value_p = below(8) == 0 && fmt_kind == K_STR ? NULL : fmt_kind == K_STR ? (void *)words[below(4)]
                                                                             : (void *)(uintptr_t)value_u;
    out_size = below(4) == 0 ? below(8) : below(sizeof out);
}

/* Calls F (snprintf or sei_snprintf) with the stars' arguments and the value the
 * conversion takes. */
#define WITH_STARS(F, dst, V) \
    (star_w && star_p ? F(dst, out_size, format, width_v, prec_v, V) \
     : star_w         ? F(dst, out_size, format, width_v, V)         \
     : star_p         ? F(dst, out_size, format, prec_v, V)          \
                      : F(dst, out_size, format, V))
#define CALL_ALL(F, dst)                                                     \
    memset(dst, '#', sizeof out);                                            \
    switch (fmt_kind) {                                                      \
    case K_INT: result_i = WITH_STARS(F, dst, (int)value_s); break;               \
    case K_LONG: result_i = WITH_STARS(F, dst, (long)value_s); break;             \
    case K_LLONG: result_i = WITH_STARS(F, dst, value_s); break;                  \
    case K_SIZE: result_i = WITH_STARS(F, dst, (size_t)value_u); break;           \
    case K_UINT: result_i = WITH_STARS(F, dst, (unsigned)value_u); break;         \
    case K_ULONG: result_i = WITH_STARS(F, dst, (unsigned long)value_u); break;   \
    case K_ULLONG: result_i = WITH_STARS(F, dst, value_u); break;                 \
    case K_CHAR: result_i = WITH_STARS(F, dst, (int)(unsigned char)value_u); break; \
    case K_STR: result_i = WITH_STARS(F, dst, (const char *)value_p); break;      \
    case K_PTR: result_i = WITH_STARS(F, dst, value_p); break;                    \
    case K_HH: result_i = WITH_STARS(F, dst, (int)(signed char)value_s); break;   \
    default: result_i = WITH_STARS(F, dst, (int)(short)value_s); break;           \
    }

#pragma GCC diagnostic ignored "-Wformat-nonliteral"
#pragma GCC diagnostic ignored "-Wformat-security"
#pragma GCC diagnostic ignored "-Wformat"

static void case_format(unsigned long long c) {
    random_format();
    long long want;
#define result_i want
    CALL_ALL(snprintf, out_libc)
#undef result_i
    RUN(CALL_ALL(sei_snprintf, out));
    if (want != result_i || memcmp(out, out_libc, sizeof out) != 0) {
        fprintf(stderr, "format \"%s\" size %zu: libc %lld \"%.*s\", sei %lld \"%.*s\"\n", format, out_size, want,
                (int)sizeof out, out_libc, result_i, (int)sizeof out, out);
        mismatch("sei_snprintf", c);
    }
}

/* The barriers the subset does by hand, seen working: `diverge` makes the two
 * executions format different numbers into handler state, which V must catch (the
 * writes were logged); `flip` corrupts a string a handler wrote, between handlers, and
 * a later handler's sei_strlen of it must catch it in dup mode (the reads are checked). */
#ifndef SEI_NATIVE
static int executions;
static SEI_PURE int execution_number(void) { return ++executions; }
static char kept[32];
#endif

static int barrier_case(const char *which) {
#ifndef SEI_NATIVE
    if (strcmp(which, "diverge") == 0) {
        if (sei_begin_nm()) {
            SEI_ATOMIC { result_i = sei_snprintf(out, sizeof out, "run %d", execution_number()); }
            sei_end();
        }
        printf("not detected: \"%s\"\n", out);
        return 1;
    }
    if (strcmp(which, "flip") == 0) {
        if (sei_begin_nm()) {
            SEI_ATOMIC { sei_snprintf(kept, sizeof kept, "%s", "hello"); }
            sei_end();
        }
        sei_test_flip(&kept[2], 7, 0); /* 'l' | 0x80: still no NUL, so only a check sees it */
        if (sei_begin_nm()) {
            SEI_ATOMIC { result_u = sei_strlen(kept); }
            sei_end();
        }
        printf("not detected: length %llu\n", result_u);
        return 1;
    }
#endif
    fprintf(stderr, "unknown case %s\n", which);
    return 2;
}

int main(int argc, char **argv) {
    if (argc == 2) return barrier_case(argv[1]);
    if (argc != 4) {
        fprintf(stderr, "usage: libc handler|plain|native N SEED, or libc diverge|flip\n");
        return 2;
    }
    in_handler = strcmp(argv[1], "handler") == 0;
#ifdef SEI_NATIVE
    if (strcmp(argv[1], "native") != 0) {
        fprintf(stderr, "a native build runs only `native`\n");
        return 2;
    }
#endif
    unsigned long long n = strtoull(argv[2], NULL, 10);
    rng = strtoull(argv[3], NULL, 10) * 0x9e3779b97f4a7c15ull | 1;
    for (unsigned long long c = 0; c < n; c++) {
        switch (c % 4) {
        case 0: case_memory(c); break;
        case 1: case_strings(c); break;
        case 2: case_numbers(c); break;
        default: case_format(c); break;
        }
    }
    printf("ok libc %llu\n", n);
    return 0;
}
