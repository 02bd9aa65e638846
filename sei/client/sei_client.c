/* See sei_client.h. */
#define _GNU_SOURCE
#include "sei_client.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* A server that stops answering is a failure, not a hang of the caller. */
#define TIMEOUT_MS 30000
/* Replies larger than this are malformed (the examples cap values at 4 KiB). */
#define MAX_BUFFERED (16u << 20)
#define CRC_LINE 15 /* "#crc XXXXXXXX\r\n" */

static const char NOTICE[] = "CLIENT_ERROR crc mismatch\r\n";

struct sei_client {
    struct sockaddr_in addr;
    int fd; /* -1 after the server cut a pipeline: the next send reconnects */
    int crc_mode;
    char *in; /* received bytes; [pos, len) not parsed yet */
    size_t pos, len, cap;
    /* noreply requests at the end of earlier pipelines that no later reply has
     * confirmed: if the server discarded one, its notice arrives in a later pipeline,
     * which must then send them again (owned copies) */
    struct sei_request *tail;
    size_t tail_n;
    unsigned long sent, corrupt_nth, discards;
    char error[200];
};

static const uint32_t TABLE[256] = {
    0x00000000, 0xf26b8303, 0xe13b70f7, 0x1350f3f4, 0xc79a971f, 0x35f1141c,
    0x26a1e7e8, 0xd4ca64eb, 0x8ad958cf, 0x78b2dbcc, 0x6be22838, 0x9989ab3b,
    0x4d43cfd0, 0xbf284cd3, 0xac78bf27, 0x5e133c24, 0x105ec76f, 0xe235446c,
    0xf165b798, 0x030e349b, 0xd7c45070, 0x25afd373, 0x36ff2087, 0xc494a384,
    0x9a879fa0, 0x68ec1ca3, 0x7bbcef57, 0x89d76c54, 0x5d1d08bf, 0xaf768bbc,
    0xbc267848, 0x4e4dfb4b, 0x20bd8ede, 0xd2d60ddd, 0xc186fe29, 0x33ed7d2a,
    0xe72719c1, 0x154c9ac2, 0x061c6936, 0xf477ea35, 0xaa64d611, 0x580f5512,
    0x4b5fa6e6, 0xb93425e5, 0x6dfe410e, 0x9f95c20d, 0x8cc531f9, 0x7eaeb2fa,
    0x30e349b1, 0xc288cab2, 0xd1d83946, 0x23b3ba45, 0xf779deae, 0x05125dad,
    0x1642ae59, 0xe4292d5a, 0xba3a117e, 0x4851927d, 0x5b016189, 0xa96ae28a,
    0x7da08661, 0x8fcb0562, 0x9c9bf696, 0x6ef07595, 0x417b1dbc, 0xb3109ebf,
    0xa0406d4b, 0x522bee48, 0x86e18aa3, 0x748a09a0, 0x67dafa54, 0x95b17957,
    0xcba24573, 0x39c9c670, 0x2a993584, 0xd8f2b687, 0x0c38d26c, 0xfe53516f,
    0xed03a29b, 0x1f682198, 0x5125dad3, 0xa34e59d0, 0xb01eaa24, 0x42752927,
    0x96bf4dcc, 0x64d4cecf, 0x77843d3b, 0x85efbe38, 0xdbfc821c, 0x2997011f,
    0x3ac7f2eb, 0xc8ac71e8, 0x1c661503, 0xee0d9600, 0xfd5d65f4, 0x0f36e6f7,
    0x61c69362, 0x93ad1061, 0x80fde395, 0x72966096, 0xa65c047d, 0x5437877e,
    0x4767748a, 0xb50cf789, 0xeb1fcbad, 0x197448ae, 0x0a24bb5a, 0xf84f3859,
    0x2c855cb2, 0xdeeedfb1, 0xcdbe2c45, 0x3fd5af46, 0x7198540d, 0x83f3d70e,
    0x90a324fa, 0x62c8a7f9, 0xb602c312, 0x44694011, 0x5739b3e5, 0xa55230e6,
    0xfb410cc2, 0x092a8fc1, 0x1a7a7c35, 0xe811ff36, 0x3cdb9bdd, 0xceb018de,
    0xdde0eb2a, 0x2f8b6829, 0x82f63b78, 0x709db87b, 0x63cd4b8f, 0x91a6c88c,
    0x456cac67, 0xb7072f64, 0xa457dc90, 0x563c5f93, 0x082f63b7, 0xfa44e0b4,
    0xe9141340, 0x1b7f9043, 0xcfb5f4a8, 0x3dde77ab, 0x2e8e845f, 0xdce5075c,
    0x92a8fc17, 0x60c37f14, 0x73938ce0, 0x81f80fe3, 0x55326b08, 0xa759e80b,
    0xb4091bff, 0x466298fc, 0x1871a4d8, 0xea1a27db, 0xf94ad42f, 0x0b21572c,
    0xdfeb33c7, 0x2d80b0c4, 0x3ed04330, 0xccbbc033, 0xa24bb5a6, 0x502036a5,
    0x4370c551, 0xb11b4652, 0x65d122b9, 0x97baa1ba, 0x84ea524e, 0x7681d14d,
    0x2892ed69, 0xdaf96e6a, 0xc9a99d9e, 0x3bc21e9d, 0xef087a76, 0x1d63f975,
    0x0e330a81, 0xfc588982, 0xb21572c9, 0x407ef1ca, 0x532e023e, 0xa145813d,
    0x758fe5d6, 0x87e466d5, 0x94b49521, 0x66df1622, 0x38cc2a06, 0xcaa7a905,
    0xd9f75af1, 0x2b9cd9f2, 0xff56bd19, 0x0d3d3e1a, 0x1e6dcdee, 0xec064eed,
    0xc38d26c4, 0x31e6a5c7, 0x22b65633, 0xd0ddd530, 0x0417b1db, 0xf67c32d8,
    0xe52cc12c, 0x1747422f, 0x49547e0b, 0xbb3ffd08, 0xa86f0efc, 0x5a048dff,
    0x8ecee914, 0x7ca56a17, 0x6ff599e3, 0x9d9e1ae0, 0xd3d3e1ab, 0x21b862a8,
    0x32e8915c, 0xc083125f, 0x144976b4, 0xe622f5b7, 0xf5720643, 0x07198540,
    0x590ab964, 0xab613a67, 0xb831c993, 0x4a5a4a90, 0x9e902e7b, 0x6cfbad78,
    0x7fab5e8c, 0x8dc0dd8f, 0xe330a81a, 0x115b2b19, 0x020bd8ed, 0xf0605bee,
    0x24aa3f05, 0xd6c1bc06, 0xc5914ff2, 0x37faccf1, 0x69e9f0d5, 0x9b8273d6,
    0x88d28022, 0x7ab90321, 0xae7367ca, 0x5c18e4c9, 0x4f48173d, 0xbd23943e,
    0xf36e6f75, 0x0105ec76, 0x12551f82, 0xe03e9c81, 0x34f4f86a, 0xc69f7b69,
    0xd5cf889d, 0x27a40b9e, 0x79b737ba, 0x8bdcb4b9, 0x988c474d, 0x6ae7c44e,
    0xbe2da0a5, 0x4c4623a6, 0x5f16d052, 0xad7d5351
};

uint32_t sei_client_crc32c(uint32_t crc, const void *buf, size_t len) {
    const unsigned char *p = buf;
    crc = ~crc;
    while (len--) crc = TABLE[(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

static int fail(struct sei_client *c, int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->error, sizeof c->error, fmt, ap);
    va_end(ap);
    return status;
}

static int open_socket(struct sei_client *c) {
    c->fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (c->fd < 0) return fail(c, SEI_CLIENT_FAILED, "socket: %s", strerror(errno));
    if (connect(c->fd, (struct sockaddr *)&c->addr, sizeof c->addr) != 0) {
        int e = errno;
        close(c->fd);
        c->fd = -1;
        return fail(c, SEI_CLIENT_FAILED, "connect: %s", strerror(e));
    }
    setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &(int){1}, sizeof(int));
    c->pos = c->len = 0;
    return SEI_CLIENT_OK;
}

struct sei_client *sei_client_connect(const char *host, int port, int crc_mode) {
    struct sei_client *c = calloc(1, sizeof *c);
    if (c == NULL) return NULL;
    c->fd = -1;
    c->crc_mode = crc_mode;
    c->addr.sin_family = AF_INET;
    c->addr.sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, host, &c->addr.sin_addr) != 1) {
        fprintf(stderr, "sei_client: not an IPv4 address: %s\n", host);
        free(c);
        return NULL;
    }
    if (open_socket(c) != SEI_CLIENT_OK) {
        fprintf(stderr, "sei_client: %s:%d: %s\n", host, port, c->error);
        free(c);
        return NULL;
    }
    return c;
}

static void drop_tail(struct sei_client *c) {
    for (size_t i = 0; i < c->tail_n; i++) free((void *)c->tail[i].buf);
    free(c->tail);
    c->tail = NULL;
    c->tail_n = 0;
}

void sei_client_close(struct sei_client *c) {
    if (c == NULL) return;
    if (c->fd >= 0) close(c->fd);
    drop_tail(c);
    free(c->in);
    free(c);
}

const char *sei_client_error(const struct sei_client *c) { return c->error; }
unsigned long sei_client_discards(const struct sei_client *c) { return c->discards; }
void sei_client_test_corrupt(struct sei_client *c, unsigned long nth) { c->corrupt_nth = nth; }

/* Reads what the socket has (waiting for it if `wait`): 1 read (or nothing to read
 * without `wait`), 0 end of stream, -1 failed (the reason in c->error). */
static int fill(struct sei_client *c, int wait) {
    if (c->pos > 0) {
        memmove(c->in, c->in + c->pos, c->len - c->pos);
        c->len -= c->pos;
        c->pos = 0;
    }
    if (c->cap - c->len < 65536) {
        if (c->cap >= MAX_BUFFERED) return (fail(c, SEI_CLIENT_FAILED, "a reply larger than %u bytes", MAX_BUFFERED), -1);
        size_t cap = c->cap ? 2 * c->cap : 131072;
        char *in = realloc(c->in, cap);
        if (in == NULL) return (fail(c, SEI_CLIENT_FAILED, "out of memory"), -1);
        c->in = in;
        c->cap = cap;
    }
    for (;;) {
        if (wait) {
            struct pollfd p = {c->fd, POLLIN, 0};
            int r = poll(&p, 1, TIMEOUT_MS);
            if (r == 0) return (fail(c, SEI_CLIENT_FAILED, "no reply in %d s", TIMEOUT_MS / 1000), -1);
            if (r < 0 && errno != EINTR) return (fail(c, SEI_CLIENT_FAILED, "poll: %s", strerror(errno)), -1);
        }
        ssize_t n = recv(c->fd, c->in + c->len, c->cap - c->len, MSG_DONTWAIT);
        if (n > 0) {
            c->len += (size_t)n;
            return 1;
        }
        if (n == 0) return 0;
        if (errno == EINTR || ((errno == EAGAIN || errno == EWOULDBLOCK) && wait)) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return 1;
        return (fail(c, SEI_CLIENT_FAILED, "recv: %s", strerror(errno)), -1);
    }
}

/* Ensures that [pos, pos + n) has arrived. */
static int need(struct sei_client *c, size_t n) {
    while (c->len - c->pos < n) {
        int r = fill(c, 1);
        if (r == 0) return fail(c, SEI_CLIENT_FAILED, "the server closed the connection");
        if (r < 0) return SEI_CLIENT_FAILED;
    }
    return SEI_CLIENT_OK;
}

/* The end (after "\r\n", relative to pos) of the line that starts at `from`. */
static int line_end(struct sei_client *c, size_t from, size_t *end) {
    size_t i = from;
    for (;;) {
        for (; c->pos + i + 1 < c->len; i++) {
            if (c->in[c->pos + i] == '\r' && c->in[c->pos + i + 1] == '\n') {
                *end = i + 2;
                return SEI_CLIENT_OK;
            }
        }
        int r = need(c, i + 2);
        if (r != SEI_CLIENT_OK) return r;
    }
}

/* Sends everything while taking in what the server answers meanwhile: a server that
 * blocks on a full socket while the client blocks on another would never finish a long
 * pipeline. The server may have stopped reading (it cut the pipeline): what reaches it
 * after that is dropped, which is what the pipeline rule wants anyway. */
static int send_all(struct sei_client *c, const char *buf, size_t len) {
    while (len > 0) {
        ssize_t n = send(c->fd, buf, len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            buf += n;
            len -= (size_t)n;
            continue;
        }
        if (n < 0 && (errno == EPIPE || errno == ECONNRESET)) return SEI_CLIENT_OK;
        if (n < 0 && errno == EINTR) continue;
        if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK))
            return fail(c, SEI_CLIENT_FAILED, "send: %s", n == 0 ? "no progress" : strerror(errno));
        struct pollfd p = {c->fd, POLLIN | POLLOUT, 0};
        int r = poll(&p, 1, TIMEOUT_MS);
        if (r == 0) return fail(c, SEI_CLIENT_FAILED, "the server takes no requests for %d s", TIMEOUT_MS / 1000);
        if (r < 0 && errno != EINTR) return fail(c, SEI_CLIENT_FAILED, "poll: %s", strerror(errno));
        if (r > 0 && (p.revents & POLLIN)) {
            r = fill(c, 0);
            if (r == 0) return SEI_CLIENT_OK; /* the replies read so far say the rest */
            if (r < 0) return SEI_CLIENT_FAILED;
        }
    }
    return SEI_CLIENT_OK;
}

static int wants_reply(const struct sei_request *r) {
    static const char NOREPLY[] = " noreply\r\n";
    size_t n = sizeof NOREPLY - 1;
    for (size_t i = 0; i + 1 < r->len; i++) {
        if (r->buf[i] == '\r' && r->buf[i + 1] == '\n')
            return !(i + 2 >= n && memcmp(r->buf + i + 2 - n, NOREPLY, n) == 0);
    }
    return 1;
}

/* Frames reqs[0..n) with their CRC lines, in one buffer, so that one send carries the
 * whole pipeline. */
static int send_pipeline(struct sei_client *c, const struct sei_request *const *reqs, size_t n) {
    size_t total = 0;
    for (size_t i = 0; i < n; i++) total += reqs[i]->len + (c->crc_mode ? CRC_LINE : 0);
    char *frame = malloc(total + 1);
    if (frame == NULL) return fail(c, SEI_CLIENT_FAILED, "out of memory");
    char *p = frame;
    for (size_t i = 0; i < n; i++) {
        memcpy(p, reqs[i]->buf, reqs[i]->len);
        p += reqs[i]->len;
        if (++c->sent, !c->crc_mode) continue;
        uint32_t crc = sei_client_crc32c(0, reqs[i]->buf, reqs[i]->len);
        if (c->sent == c->corrupt_nth) crc ^= 1;
        snprintf(p, CRC_LINE + 1, "#crc %08x\r\n", crc);
        p += CRC_LINE;
    }
    int r = send_all(c, frame, total);
    free(frame);
    return r;
}

#define DISCARDED (-1)

static int hex_digit(char ch) {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
}

/* Reads the reply to req: SEI_CLIENT_OK with *out filled, DISCARDED for the server's
 * notice, or a status. */
static int read_reply(struct sei_client *c, const struct sei_request *req, struct sei_reply *out) {
    size_t end, body;
    int r = line_end(c, 0, &end);
    if (r != SEI_CLIENT_OK) return r;
    if (end == sizeof NOTICE - 1 && memcmp(c->in + c->pos, NOTICE, end) == 0) {
        c->pos += end;
        return DISCARDED;
    }
    /* "VALUE key flags bytes" lines each carry a data block; any other line ends it */
    size_t line = 0;
    while (end - line >= 6 && memcmp(c->in + c->pos + line, "VALUE ", 6) == 0) {
        const char *p = c->in + c->pos + line, *stop = c->in + c->pos + end - 2;
        int spaces = 0;
        while (p < stop && spaces < 3)
            if (*p++ == ' ') spaces++;
        unsigned long long bytes = 0;
        int digits = 0;
        for (; p < stop && *p >= '0' && *p <= '9' && digits < 10; p++, digits++) bytes = bytes * 10 + (unsigned)(*p - '0');
        if (spaces < 3 || digits == 0 || p != stop || bytes > MAX_BUFFERED)
            return fail(c, c->crc_mode ? SEI_CLIENT_DETECTED : SEI_CLIENT_FAILED, "a malformed VALUE line");
        if ((r = need(c, end + bytes + 2)) != SEI_CLIENT_OK) return r;
        if (memcmp(c->in + c->pos + end + bytes, "\r\n", 2) != 0)
            return fail(c, c->crc_mode ? SEI_CLIENT_DETECTED : SEI_CLIENT_FAILED, "a data block without its end");
        line = end + bytes + 2;
        if ((r = line_end(c, line, &end)) != SEI_CLIENT_OK) return r;
    }
    body = end;
    if (c->crc_mode) {
        if ((r = need(c, body + CRC_LINE)) != SEI_CLIENT_OK) return r;
        const char *l = c->in + c->pos + body;
        int well_formed = memcmp(l, "#crc ", 5) == 0 && l[13] == '\r' && l[14] == '\n';
        uint32_t given = 0;
        for (int i = 5; i < 13; i++) {
            int d = hex_digit(l[i]);
            well_formed &= d >= 0;
            given = given << 4 | (uint32_t)(d & 15);
        }
        uint32_t want = sei_client_crc32c(sei_client_crc32c(0, req->buf, req->len), c->in + c->pos, body);
        if (!well_formed || given != want)
            return fail(c, SEI_CLIENT_DETECTED, "rejected a reply whose CRC does not cover the request and the reply: %.*s",
                        (int)(body < 40 ? body : 40), c->in + c->pos);
    }
    out->buf = malloc(body + 1);
    if (out->buf == NULL) return fail(c, SEI_CLIENT_FAILED, "out of memory");
    memcpy(out->buf, c->in + c->pos, body);
    out->buf[body] = 0;
    out->len = body;
    c->pos += body + (c->crc_mode ? CRC_LINE : 0);
    return SEI_CLIENT_OK;
}

static void free_replies(struct sei_reply *replies, size_t n) {
    for (size_t i = 0; i < n; i++) {
        free(replies[i].buf);
        replies[i] = (struct sei_reply){NULL, 0};
    }
}

/* Keeps copies of the noreply requests at the end of all[0..n), which no reply has
 * confirmed yet. all[] starts with the old tail, which holds only noreply requests: the
 * new tail either starts at 0 and keeps the old one whole, or starts after it. */
static int keep_tail(struct sei_client *c, const struct sei_request *const *all, size_t n) {
    size_t first = n;
    while (first > 0 && !wants_reply(all[first - 1])) first--;
    if (first > 0) drop_tail(c);
    size_t want = n - first, have = c->tail_n;
    if (want == have) return SEI_CLIENT_OK;
    struct sei_request *tail = realloc(c->tail, want * sizeof *tail);
    if (tail == NULL) return fail(c, SEI_CLIENT_FAILED, "out of memory");
    c->tail = tail;
    for (size_t i = have; i < want; i++) {
        const struct sei_request *r = all[first + i];
        char *copy = malloc(r->len ? r->len : 1);
        if (copy == NULL) return fail(c, SEI_CLIENT_FAILED, "out of memory");
        memcpy(copy, r->buf, r->len);
        c->tail[i] = (struct sei_request){copy, r->len};
        c->tail_n = i + 1;
    }
    return SEI_CLIENT_OK;
}

int sei_client_pipeline(struct sei_client *c, const struct sei_request *reqs, size_t n,
                        struct sei_reply *replies) {
    c->error[0] = 0;
    for (size_t i = 0; i < n; i++) replies[i] = (struct sei_reply){NULL, 0};
    /* the unconfirmed tail of earlier pipelines, then this one */
    size_t total = c->tail_n + n;
    const struct sei_request **all = malloc((total ? total : 1) * sizeof *all);
    if (all == NULL) return fail(c, SEI_CLIENT_FAILED, "out of memory");
    for (size_t i = 0; i < c->tail_n; i++) all[i] = &c->tail[i];
    for (size_t i = 0; i < n; i++) all[c->tail_n + i] = &reqs[i];
    size_t from = 0; /* the first request whose reply has not arrived */
    size_t restart = (size_t)-1;
    unsigned attempts = 1;
    int status = SEI_CLIENT_OK;
    for (;;) {
        if (c->fd < 0 && (status = open_socket(c)) != SEI_CLIENT_OK) break;
        if ((status = send_pipeline(c, all + from, total - from)) != SEI_CLIENT_OK) break;
        for (size_t i = from; i < total; i++) {
            if (!wants_reply(all[i])) continue;
            struct sei_reply reply = {NULL, 0};
            status = read_reply(c, all[i], &reply);
            if (status != SEI_CLIENT_OK) break;
            /* a tail request never wants a reply, so i is in this pipeline */
            replies[i - c->tail_n] = reply;
            from = i + 1;
        }
        if (status != DISCARDED) break;
        /* The server ran nothing after the discarded request, and the noreply
         * requests between `from` and it may or may not have run: they are blind
         * writes, so running them again right after themselves changes nothing. */
        status = SEI_CLIENT_OK;
        c->discards++;
        close(c->fd);
        c->fd = -1;
        if (from == restart && ++attempts >= SEI_CLIENT_ATTEMPTS) {
            status = fail(c, SEI_CLIENT_DETECTED, "the server discarded a request %d times: %.*s",
                          SEI_CLIENT_ATTEMPTS, (int)(all[from]->len < 40 ? all[from]->len : 40), all[from]->buf);
            break;
        }
        if (from != restart) attempts = 1;
        restart = from;
    }
    if (status == SEI_CLIENT_OK) status = keep_tail(c, all, total);
    free(all);
    if (status != SEI_CLIENT_OK) free_replies(replies, n);
    return status;
}
