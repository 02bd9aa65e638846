/* The store and the request handler of the example key-value servers. Everything
 * kv_execute calls is instrumented when built with lockstep cc, so it avoids libc
 * string functions (which are not transaction-safe) in favour of small loops. */
#include <stdlib.h>
#include <string.h>

#include "kv_store.h"

int kv_store_init(struct kv_store *s, int threaded) {
    s->buckets = calloc(KV_BUCKETS, sizeof *s->buckets);
    for (int i = 0; i < KV_STRIPES; i++) s->items[i] = 0;
    s->stripes = NULL;
    if (s->buckets == NULL) return -1;
    if (threaded) {
        s->stripes = calloc(KV_STRIPES, sizeof *s->stripes);
        if (s->stripes == NULL) return -1;
        for (int i = 0; i < KV_STRIPES; i++) pthread_mutex_init(&s->stripes[i], NULL);
    }
    return 0;
}

/* Words the handler compares against. GCC 12 crashes (trans-mem.cc:1538) when
 * instrumented code reads a string literal in a loop; a const array is fine. */
static const char WORD_GET[] = "get ", WORD_SET[] = "set ", WORD_DELETE[] = "delete ", WORD_NOREPLY[] = "noreply";

/* Helpers that only read the request (an input message, checked by its CRC, not
 * state) and write the caller's locals are SEI_PURE: not instrumented, which spares
 * a barrier call per request byte in both executions (docs/sei.md, "Tuning"). */

/* memcmp is not transaction-safe; the handler compares with this loop */
static SEI_PURE int same_bytes(const char *a, const char *b, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (a[i] != b[i]) return 0;
    return 1;
}

static SEI_PURE int starts_with(const char *p, const char *end, const char *word, size_t n) {
    return (size_t)(end - p) >= n && same_bytes(p, word, n);
}

static SEI_PURE long find_crlf(const char *buf, size_t len) {
    for (size_t i = 0; i + 1 < len; i++)
        if (buf[i] == '\r' && buf[i + 1] == '\n') return (long)i;
    return -1;
}

/* parses an unsigned decimal token [p, end); -1 if it is not one */
static SEI_PURE long long parse_number(const char *p, const char *end) {
    if (p == end || end - p > 18) return -1;
    long long v = 0;
    for (; p < end; p++) {
        if (*p < '0' || *p > '9') return -1;
        v = v * 10 + (*p - '0');
    }
    return v;
}

/* the next space-separated token of [*p, end) */
static SEI_PURE int next_token(const char **p, const char *end, const char **start, const char **stop) {
    while (*p < end && **p == ' ') (*p)++;
    if (*p == end) return 0;
    *start = *p;
    while (*p < end && **p != ' ') (*p)++;
    *stop = *p;
    return 1;
}

long kv_request_length(const char *buf, size_t len) {
    long line = find_crlf(buf, len < KV_MAX_LINE ? len : KV_MAX_LINE);
    if (line < 0) return len >= KV_MAX_LINE ? -1 : 0;
    size_t total = (size_t)line + 2;
    if (line >= 4 && memcmp(buf, WORD_SET, 4) == 0) {
        /* the fifth token is the data block's length */
        const char *p = buf + 4, *end = buf + line, *a, *b;
        long long bytes = -1;
        for (int i = 0; i < 4 && next_token(&p, end, &a, &b); i++)
            if (i == 3) bytes = parse_number(a, b);
        if (bytes < 0) return (long)total; /* the handler rejects the line */
        /* a block too large for a connection's buffer cannot be framed at all */
        if (bytes > KV_MAX_FRAME) return -1;
        total += (size_t)bytes + 2;
        if (len < total) return 0;
    }
    return (long)total;
}

static SEI_PURE uint32_t hash_key(const char *key, size_t len) {
    uint32_t h = 2166136261u; /* FNV-1a */
    for (size_t i = 0; i < len; i++) h = (h ^ (unsigned char)key[i]) * 16777619u;
    return h;
}

/* reads an item (state): instrumented */
static int same_key(const struct kv_item *it, const char *key, size_t len) {
    if (it->key_len != len) return 0;
    for (size_t i = 0; i < len; i++)
        if (it->data[i] != key[i]) return 0;
    return 1;
}

static void append(struct kv_reply *r, const char *s, size_t n) {
    if (r->len + n > KV_REPLY_MAX) return; /* cannot happen within the limits above */
    memcpy(r->buf + r->len, s, n);
    r->len += n;
}

/* literals are appended with their compile-time length (see the words above) */
#define append_text(r, literal) append((r), (literal), sizeof(literal) - 1)

static void append_number(struct kv_reply *r, unsigned long long v) {
    char digits[24];
    int n = 0;
    do {
        digits[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    char out[24];
    for (int i = 0; i < n; i++) out[i] = digits[n - 1 - i];
    append(r, out, (size_t)n);
}

/* locks the stripes of the given buckets in ascending order (a lock hierarchy: libsei
 * defers every release until the handler is validated) */
static void lock_stripes(struct kv_store *s, unsigned mask) {
    if (s->stripes == NULL) return;
    for (int i = 0; i < KV_STRIPES; i++)
        if (mask & (1u << i)) pthread_mutex_lock(&s->stripes[i]);
}

static void unlock_stripes(struct kv_store *s, unsigned mask) {
    if (s->stripes == NULL) return;
    for (int i = KV_STRIPES - 1; i >= 0; i--)
        if (mask & (1u << i)) pthread_mutex_unlock(&s->stripes[i]);
}

static unsigned stripe_of(uint32_t bucket) { return 1u << (bucket % KV_STRIPES); }

static void do_get(struct kv_store *s, const char *p, const char *end, struct kv_reply *r) {
    const char *a, *b;
    unsigned mask = 0;
    const char *scan = p;
    int keys = 0;
    while (next_token(&scan, end, &a, &b)) {
        if (b - a > KV_MAX_KEY || ++keys > 4) {
            append_text(r, "CLIENT_ERROR bad command line format\r\n");
            return;
        }
        mask |= stripe_of(hash_key(a, (size_t)(b - a)) % KV_BUCKETS);
    }
    if (keys == 0) {
        append_text(r, "ERROR\r\n");
        return;
    }
    lock_stripes(s, mask);
    while (next_token(&p, end, &a, &b)) {
        size_t klen = (size_t)(b - a);
        uint32_t bucket = hash_key(a, klen) % KV_BUCKETS;
        for (struct kv_item *it = s->buckets[bucket]; it; it = it->next) {
            if (!same_key(it, a, klen)) continue;
            append_text(r, "VALUE ");
            append(r, it->data, it->key_len);
            append_text(r, " ");
            append_number(r, it->flags);
            append_text(r, " ");
            append_number(r, it->value_len);
            append_text(r, "\r\n");
            append(r, it->data + it->key_len, it->value_len);
            append_text(r, "\r\n");
            break;
        }
    }
    unlock_stripes(s, mask);
    append_text(r, "END\r\n");
}

static void do_set(struct kv_store *s, const char *p, const char *end, const char *data, size_t avail,
                   struct kv_reply *r) {
    const char *tok[5][2];
    int n = 0;
    while (n < 5 && next_token(&p, end, &tok[n][0], &tok[n][1])) n++;
    int noreply = n == 5 && tok[4][1] - tok[4][0] == 7 && same_bytes(tok[4][0], WORD_NOREPLY, 7);
    long long flags = n >= 4 ? parse_number(tok[1][0], tok[1][1]) : -1;
    long long exptime = n >= 4 ? parse_number(tok[2][0], tok[2][1]) : -1;
    long long bytes = n >= 4 ? parse_number(tok[3][0], tok[3][1]) : -1;
    const char *extra, *extra_end;
    if (n < 4 || (n == 5 && !noreply) || next_token(&p, end, &extra, &extra_end) || flags < 0 ||
        flags > 0xffffffffll || exptime < 0 || bytes < 0 || tok[0][1] - tok[0][0] > KV_MAX_KEY) {
        append_text(r, "CLIENT_ERROR bad command line format\r\n");
        return;
    }
    if (bytes > KV_MAX_VALUE) {
        append_text(r, "SERVER_ERROR object too large for cache\r\n");
        return;
    }
    if (avail < (size_t)bytes + 2 || data[bytes] != '\r' || data[bytes + 1] != '\n') {
        append_text(r, "CLIENT_ERROR bad data chunk\r\n");
        return;
    }
    size_t klen = (size_t)(tok[0][1] - tok[0][0]);
    struct kv_item *it = malloc(sizeof *it + klen + (size_t)bytes);
    if (it == NULL) {
        append_text(r, "SERVER_ERROR out of memory storing object\r\n");
        return;
    }
    it->flags = (uint32_t)flags;
    it->key_len = (uint32_t)klen;
    it->value_len = (uint32_t)bytes;
    memcpy(it->data, tok[0][0], klen);
    memcpy(it->data + klen, data, (size_t)bytes);
    uint32_t bucket = hash_key(it->data, klen) % KV_BUCKETS;
    lock_stripes(s, stripe_of(bucket));
    struct kv_item **link = &s->buckets[bucket];
    while (*link && !same_key(*link, it->data, klen)) link = &(*link)->next;
    if (*link) {
        struct kv_item *old = *link;
        it->next = old->next;
        free(old);
    } else {
        it->next = NULL;
        s->items[bucket % KV_STRIPES]++;
    }
    *link = it;
    unlock_stripes(s, stripe_of(bucket));
    if (!noreply) append_text(r, "STORED\r\n");
}

static void do_delete(struct kv_store *s, const char *p, const char *end, struct kv_reply *r) {
    const char *a, *b, *c, *d;
    if (!next_token(&p, end, &a, &b) || b - a > KV_MAX_KEY) {
        append_text(r, "ERROR\r\n");
        return;
    }
    int noreply = 0;
    if (next_token(&p, end, &c, &d)) {
        noreply = d - c == 7 && same_bytes(c, WORD_NOREPLY, 7);
        if (!noreply) {
            append_text(r, "CLIENT_ERROR bad command line format\r\n");
            return;
        }
    }
    size_t klen = (size_t)(b - a);
    uint32_t bucket = hash_key(a, klen) % KV_BUCKETS;
    lock_stripes(s, stripe_of(bucket));
    struct kv_item **link = &s->buckets[bucket];
    while (*link && !same_key(*link, a, klen)) link = &(*link)->next;
    int found = *link != NULL;
    if (found) {
        struct kv_item *dead = *link;
        *link = dead->next;
        free(dead);
        s->items[bucket % KV_STRIPES]--;
    }
    unlock_stripes(s, stripe_of(bucket));
    if (noreply)
        return;
    if (found)
        append_text(r, "DELETED\r\n");
    else
        append_text(r, "NOT_FOUND\r\n");
}


SEI_SAFE void kv_execute(struct kv_store *s, const char *req, size_t len, struct kv_reply *reply) {
    reply->len = 0;
    long line = find_crlf(req, len);
    if (line < 0) {
        append_text(reply, "CLIENT_ERROR line too long\r\n");
        return;
    }
    const char *end = req + line;
    if (starts_with(req, end, WORD_GET, 4))
        do_get(s, req + 4, end, reply);
    else if (starts_with(req, end, WORD_SET, 4))
        do_set(s, req + 4, end, end + 2, len - (size_t)line - 2, reply);
    else if (starts_with(req, end, WORD_DELETE, 7))
        do_delete(s, req + 7, end, reply);
    else
        append_text(reply, "ERROR\r\n");
}
