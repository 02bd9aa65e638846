/* The transaction-safe libc subset of sei.h: memcmp, strlen, strnlen, memchr, strchr,
 * strtoul, strtoull, snprintf and utoa, with libc's signatures and semantics.
 *
 * They are declared transaction_pure, so GCC calls them from a handler without
 * instrumenting them (one barrier per byte would cost more than the work), and each
 * does by hand what the barriers would: inside a handler, the bytes it reads go through
 * check(v) (dup mode) once per call, and the bytes it writes are logged before they
 * are stored, as a write barrier would log them. Outside a handler they are plain
 * functions. None allocates, takes a lock or calls into libc's locale machinery. */
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <string.h>

#include "internal.h"

size_t sei_tx_anchor; /* always 0; see sei.h */

/* The running handler, or NULL. */
static inline struct sei_thread *handler(void) {
    struct sei_thread *t = sei_self;
    return sei_in_handler(t) ? t : NULL;
}

/* check(v) on [addr, addr+len) before the caller uses what it read. */
static inline void checked_read(const void *addr, size_t len) {
    if (__builtin_expect(sei_dup, 0) && len != 0) {
        struct sei_thread *t = handler();
        if (t != NULL) sei_dup_check(t, (uintptr_t)addr, len);
    }
}

/* Logs [addr, addr+len) as a write barrier would, before the caller stores there. */
static inline void logged_write(void *addr, size_t len) {
    struct sei_thread *t = handler();
    if (t != NULL && len != 0) sei_log_write(t, (uintptr_t)addr, len);
}

int sei_libc_memcmp(const void *a, const void *b, size_t n) {
    const unsigned char *x = a, *y = b;
    size_t i = 0;
    while (i < n && x[i] == y[i]) i++;
    /* Only the bytes compared decide the result: those are the ones checked. */
    size_t seen = i < n ? i + 1 : n;
    checked_read(a, seen);
    checked_read(b, seen);
    return i < n ? (int)x[i] - (int)y[i] : 0;
}

size_t sei_libc_strlen(const char *s) {
    size_t n = 0;
    while (s[n] != 0) n++;
    checked_read(s, n + 1);
    return n;
}

size_t sei_libc_strnlen(const char *s, size_t max) {
    size_t n = 0;
    while (n < max && s[n] != 0) n++;
    checked_read(s, n < max ? n + 1 : n);
    return n;
}

void *sei_libc_memchr(const void *s, int c, size_t n) {
    const unsigned char *p = s;
    size_t i = 0;
    while (i < n && p[i] != (unsigned char)c) i++;
    checked_read(s, i < n ? i + 1 : n);
    return i < n ? (void *)(uintptr_t)(p + i) : NULL;
}

char *sei_libc_strchr(const char *s, int c) {
    size_t i = 0;
    while (s[i] != (char)c && s[i] != 0) i++;
    checked_read(s, i + 1);
    return s[i] == (char)c ? (char *)(uintptr_t)(s + i) : NULL;
}

/* ---- number parsing ---- */

static int is_space(unsigned char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }

static int digit_value(unsigned char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'z') return c - 'a' + 10;
    if (c >= 'A' && c <= 'Z') return c - 'A' + 10;
    return 99;
}

static void set_errno(int value) {
    logged_write(&errno, sizeof errno);
    errno = value;
}

static void set_end(char **endptr, const char *end) {
    if (endptr == NULL) return;
    logged_write(endptr, sizeof *endptr);
    *endptr = (char *)(uintptr_t)end;
}

/* strtoull's grammar in the C locale; `max` is the type's largest value. */
static unsigned long long parse_unsigned(const char *s, char **endptr, int base, unsigned long long max) {
    if (base < 0 || base == 1 || base > 36) { /* as glibc: *endptr is left alone */
        set_errno(EINVAL);
        return 0;
    }
    const unsigned char *p = (const unsigned char *)s;
    while (is_space(*p)) p++;
    int negative = 0;
    if (*p == '+' || *p == '-') negative = *p++ == '-';
    /* "0x" is a prefix only when a hex digit follows; otherwise the 0 alone is the number */
    if ((base == 0 || base == 16) && p[0] == '0' && (p[1] == 'x' || p[1] == 'X') && digit_value(p[2]) < 16) {
        p += 2;
        base = 16;
    } else if (base == 0) {
        base = p[0] == '0' ? 8 : 10;
    }
    const unsigned char *digits = p;
    unsigned long long value = 0;
    int overflow = 0;
    /* the bound, computed once per call rather than a division per digit */
    const unsigned long long limit = max / (unsigned long long)base, last = max % (unsigned long long)base;
    for (int d; (d = digit_value(*p)) < base; p++) {
        if (value > limit || (value == limit && (unsigned long long)d > last))
            overflow = 1;
        else
            value = value * (unsigned long long)base + (unsigned long long)d;
    }
    checked_read(s, (size_t)((const char *)p - s) + 1);
    if (p == digits) { /* no number: nothing consumed, errno untouched */
        set_end(endptr, s);
        return 0;
    }
    set_end(endptr, (const char *)p);
    if (overflow) {
        set_errno(ERANGE);
        return max;
    }
    return negative ? (unsigned long long)(-value) & max : value;
}

unsigned long sei_libc_strtoul(const char *s, char **endptr, int base) {
    return (unsigned long)parse_unsigned(s, endptr, base, ULONG_MAX);
}

unsigned long long sei_libc_strtoull(const char *s, char **endptr, int base) {
    return parse_unsigned(s, endptr, base, ULLONG_MAX);
}

/* Digits of v in base (2-36, lowercase), most significant first, into out (which holds
 * 64); returns how many. */
static size_t digits_of(unsigned long long v, unsigned base, int upper, char *out) {
    const char *set = upper ? "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ" : "0123456789abcdefghijklmnopqrstuvwxyz";
    char rev[64];
    size_t n = 0;
    do {
        rev[n++] = set[v % base];
        v /= base;
    } while (v != 0);
    for (size_t i = 0; i < n; i++) out[i] = rev[n - 1 - i];
    return n;
}

size_t sei_libc_utoa(unsigned long long value, char *buf, unsigned base) {
    if (base < 2 || base > 36) sei_unsupported("sei_utoa: base %u (expected 2 to 36)", base);
    char digits[65];
    size_t n = digits_of(value, base, 0, digits);
    digits[n] = 0;
    logged_write(buf, n + 1);
    memcpy(buf, digits, n + 1);
    return n;
}

/* ---- formatting ---- */

/* The destination of sei_snprintf: bytes go through a small stack buffer, logged and
 * copied to the caller's buffer a chunk at a time, so that a 1-byte write does not
 * cost a barrier call and the log holds only the bytes written. */
struct sink {
    char *dst;
    size_t room;  /* bytes of dst that may still receive output (the NUL excluded) */
    size_t total; /* bytes the whole output has, as snprintf counts them */
    char chunk[128];
    size_t used;
};

static void flush(struct sink *k) {
    size_t n = k->used < k->room ? k->used : k->room;
    if (n != 0) {
        logged_write(k->dst, n);
        memcpy(k->dst, k->chunk, n);
        k->dst += n;
        k->room -= n;
    }
    k->used = 0;
}

static void put(struct sink *k, const char *s, size_t n) {
    k->total += n;
    while (n != 0) {
        if (k->used == sizeof k->chunk) flush(k);
        size_t take = sizeof k->chunk - k->used;
        if (take > n) take = n;
        memcpy(k->chunk + k->used, s, take);
        k->used += take;
        s += take;
        n -= take;
    }
}

static void pad(struct sink *k, char c, size_t n) {
    char run[16];
    memset(run, c, sizeof run);
    for (; n > sizeof run; n -= sizeof run) put(k, run, sizeof run);
    put(k, run, n);
}

struct spec {
    int left, plus, space, alt, zero;
    size_t width;
    int precision; /* -1: none */
};

/* Prefix (sign or 0x), zeros up to the precision, then the digits, padded to the width. */
static void put_number(struct sink *k, const struct spec *f, const char *prefix, const char *digits, size_t n) {
    size_t zeros = f->precision >= 0 && (size_t)f->precision > n ? (size_t)f->precision - n : 0;
    size_t plen = strlen(prefix);
    size_t body = plen + zeros + n;
    size_t fill = f->width > body ? f->width - body : 0;
    if (!f->left && !(f->zero && f->precision < 0)) pad(k, ' ', fill);
    put(k, prefix, plen);
    if (!f->left && f->zero && f->precision < 0) pad(k, '0', fill);
    pad(k, '0', zeros);
    put(k, digits, n);
    if (f->left) pad(k, ' ', fill);
}

static void put_text(struct sink *k, const struct spec *f, const char *s, size_t n) {
    size_t fill = f->width > n ? f->width - n : 0;
    if (!f->left) pad(k, ' ', fill);
    put(k, s, n);
    if (f->left) pad(k, ' ', fill);
}

enum length { LEN_INT, LEN_CHAR, LEN_SHORT, LEN_LONG, LEN_LLONG, LEN_SIZE, LEN_MAX, LEN_PTRDIFF };

static unsigned long long take_unsigned(va_list *ap, enum length len) {
    switch (len) {
    case LEN_CHAR: return (unsigned char)va_arg(*ap, unsigned);
    case LEN_SHORT: return (unsigned short)va_arg(*ap, unsigned);
    case LEN_LONG: return va_arg(*ap, unsigned long);
    case LEN_LLONG: return va_arg(*ap, unsigned long long);
    case LEN_SIZE: return va_arg(*ap, size_t);
    case LEN_MAX: return va_arg(*ap, uintmax_t);
    case LEN_PTRDIFF: return (unsigned long long)va_arg(*ap, ptrdiff_t);
    default: return va_arg(*ap, unsigned);
    }
}

static long long take_signed(va_list *ap, enum length len) {
    switch (len) {
    case LEN_CHAR: return (signed char)va_arg(*ap, int);
    case LEN_SHORT: return (short)va_arg(*ap, int);
    case LEN_LONG: return va_arg(*ap, long);
    case LEN_LLONG: return va_arg(*ap, long long);
    case LEN_SIZE: return (long long)va_arg(*ap, size_t);
    case LEN_MAX: return va_arg(*ap, intmax_t);
    case LEN_PTRDIFF: return va_arg(*ap, ptrdiff_t);
    default: return va_arg(*ap, int);
    }
}

/* One conversion after its '%', flags, width, precision and length are read. */
static void convert(struct sink *k, struct spec *f, enum length len, char conv, va_list *ap) {
    char digits[66];
    size_t n;
    switch (conv) {
    case 'd':
    case 'i': {
        long long v = take_signed(ap, len);
        unsigned long long magnitude = v < 0 ? 0ull - (unsigned long long)v : (unsigned long long)v;
        n = f->precision == 0 && v == 0 ? 0 : digits_of(magnitude, 10, 0, digits);
        put_number(k, f, v < 0 ? "-" : f->plus ? "+" : f->space ? " " : "", digits, n);
        return;
    }
    case 'u':
    case 'x':
    case 'X':
    case 'o': {
        unsigned long long v = take_unsigned(ap, len);
        unsigned base = conv == 'u' ? 10 : conv == 'o' ? 8 : 16;
        n = f->precision == 0 && v == 0 ? 0 : digits_of(v, base, conv == 'X', digits);
        const char *prefix = "";
        if (f->alt && v != 0 && base == 16) prefix = conv == 'X' ? "0X" : "0x";
        /* '#' with 'o' makes the first digit a 0, unless the precision's zeros already do
         * (a digit, not a raised precision: the '0' flag still applies) */
        int zeros_lead = f->precision >= 0 && (size_t)f->precision > n;
        if (f->alt && conv == 'o' && !zeros_lead && (n == 0 || digits[0] != '0')) {
            memmove(digits + 1, digits, n);
            digits[0] = '0';
            n++;
        }
        put_number(k, f, prefix, digits, n);
        return;
    }
    case 'p': {
        void *p = va_arg(*ap, void *);
        if (p == NULL) {
            put_text(k, f, "(nil)", 5);
            return;
        }
        n = digits_of((uintptr_t)p, 16, 0, digits);
        put_number(k, f, "0x", digits, n);
        return;
    }
    case 'c': {
        char c = (char)va_arg(*ap, int);
        put_text(k, f, &c, 1);
        return;
    }
    case 's': {
        const char *s = va_arg(*ap, const char *);
        if (s == NULL) { /* glibc's rendering; a precision too short for it prints nothing */
            s = f->precision < 0 || f->precision >= 6 ? "(null)" : "";
            put_text(k, f, s, strlen(s));
            return;
        }
        size_t len_s = f->precision >= 0 ? sei_libc_strnlen(s, (size_t)f->precision) : sei_libc_strlen(s);
        put_text(k, f, s, len_s);
        return;
    }
    default:
        sei_unsupported("sei_snprintf: conversion %%%c is not supported (it supports d i u x X o c s p %%)",
                        conv);
    }
}

int sei_libc_vsnprintf(char *buf, size_t size, const char *fmt, va_list ap_in) {
    struct sink k = {.dst = buf, .room = size != 0 ? size - 1 : 0};
    va_list ap;
    va_copy(ap, ap_in);
    checked_read(fmt, strlen(fmt) + 1);
    for (const char *p = fmt; *p != 0;) {
        if (*p != '%') {
            const char *run = p;
            while (*p != 0 && *p != '%') p++;
            put(&k, run, (size_t)(p - run));
            continue;
        }
        p++;
        if (*p == '%') {
            put(&k, "%", 1);
            p++;
            continue;
        }
        struct spec f = {.precision = -1};
        for (;; p++) {
            if (*p == '-') f.left = 1;
            else if (*p == '+') f.plus = 1;
            else if (*p == ' ') f.space = 1;
            else if (*p == '#') f.alt = 1;
            else if (*p == '0') f.zero = 1;
            else break;
        }
        if (*p == '*') {
            int w = va_arg(ap, int);
            if (w < 0) {
                f.left = 1;
                w = w == INT_MIN ? INT_MAX : -w;
            }
            f.width = (size_t)w;
            p++;
        } else {
            for (; *p >= '0' && *p <= '9'; p++)
                f.width = f.width > INT_MAX / 10 ? INT_MAX : f.width * 10 + (size_t)(*p - '0');
        }
        if (*p == '.') {
            p++;
            if (*p == '*') {
                int prec = va_arg(ap, int);
                f.precision = prec < 0 ? -1 : prec;
                p++;
            } else {
                long prec = 0;
                for (; *p >= '0' && *p <= '9'; p++) prec = prec > INT_MAX / 10 ? INT_MAX : prec * 10 + (*p - '0');
                f.precision = (int)prec;
            }
        }
        enum length len = LEN_INT;
        if (p[0] == 'h' && p[1] == 'h') len = LEN_CHAR, p += 2;
        else if (p[0] == 'h') len = LEN_SHORT, p++;
        else if (p[0] == 'l' && p[1] == 'l') len = LEN_LLONG, p += 2;
        else if (p[0] == 'l') len = LEN_LONG, p++;
        else if (p[0] == 'z') len = LEN_SIZE, p++;
        else if (p[0] == 'j') len = LEN_MAX, p++;
        else if (p[0] == 't') len = LEN_PTRDIFF, p++;
        if (*p == 0) sei_unsupported("sei_snprintf: the format \"%s\" ends inside a conversion", fmt);
        convert(&k, &f, len, *p++, &ap);
    }
    va_end(ap);
    flush(&k);
    if (size != 0) {
        logged_write(k.dst, 1);
        *k.dst = 0;
    }
    return k.total > INT_MAX ? -1 : (int)k.total;
}

int sei_libc_snprintf(size_t anchor, char *buf, size_t size, const char *fmt, ...) {
    (void)anchor; /* read by the caller: see sei_tx_anchor */
    va_list ap;
    va_start(ap, fmt);
    int n = sei_libc_vsnprintf(buf, size, fmt, ap);
    va_end(ap);
    return n;
}
