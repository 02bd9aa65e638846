/* See kv_net.h. The lines that harden the handler are marked "SEI:". */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_net.h"

void kv_parse_options(int argc, char **argv, struct kv_options *o, int threaded) {
    o->port = 11311;
    o->threads = 1;
    o->crc = 0;
    for (int i = 1; i < argc; i++) {
        char *end = NULL;
        if (strcmp(argv[i], "--port") == 0 && i + 1 < argc) {
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 1 || v > 65535) goto usage;
            o->port = (int)v;
        } else if (threaded && strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 1 || v > 64) goto usage;
            o->threads = (int)v;
        } else if (strcmp(argv[i], "--crc") == 0) {
            o->crc = 1;
        } else {
            goto usage;
        }
    }
    return;
usage:
    fprintf(stderr,
            "usage: %s [--port P] [--crc]%s\n"
            "  a memcached text-protocol subset (get, set, delete) on 127.0.0.1:P (default 11311)\n"
            "  --crc      every request and reply is followed by a line \"#crc XXXXXXXX\" (CRC32C);\n"
            "             a reply's CRC covers the request it answers, then the reply\n"
            "%s",
            argv[0], threaded ? " [--threads N]" : "", threaded ? "  --threads  worker threads (1-64, default 1)\n" : "");
    exit(2);
}

/* Test hooks, outside the handler, each counting down from an environment variable:
 * KV_TEST_CORRUPT_REPLY=N flips one bit of the Nth reply after libsei validated it, as a
 * memory error on the way to the NIC would (only the CRC the client checks can catch
 * it); KV_TEST_CORRUPT_REQUEST=N flips one bit of the Nth request after it arrived
 * (phase I discards it, and the client sends it again); KV_TEST_SKIP_REQUEST=N makes
 * framing step over the Nth request unexecuted, as a fault in framing can (one in the
 * fault campaign cut a request short, and the replies after it answered other requests
 * than the client thought): only a reply CRC that covers the request shows the client
 * that a reply answers another request. */
struct test_hook {
    const char *env;
    long countdown; /* -1: not read yet */
};
static struct test_hook corrupt_reply = {"KV_TEST_CORRUPT_REPLY", -1};
static struct test_hook corrupt_request = {"KV_TEST_CORRUPT_REQUEST", -1};
static struct test_hook skip_request = {"KV_TEST_SKIP_REQUEST", -1};

static int hook_fires(struct test_hook *hook) {
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&lock);
    if (hook->countdown < 0) {
        const char *v = getenv(hook->env);
        hook->countdown = v ? atol(v) : 0;
    }
    int fires = hook->countdown > 0 && --hook->countdown == 0;
    pthread_mutex_unlock(&lock);
    return fires;
}

static void maybe_flip(struct test_hook *hook, char *buf, size_t len) {
    if (hook_fires(hook) && len > 0) buf[0] ^= 0x02;
}

/* One request: the hardened handler, then the output phase (wire_protocol.serve). */
static int serve_one(const struct wire_protocol *p, struct wire_conn *wire, char *req, size_t len,
                     long long given_crc) {
    struct kv_conn *c = (struct kv_conn *)wire;
    struct kv_store *s = p->server;
    if (hook_fires(&skip_request)) return 0;
    /* without CRC lines the CRC protects the request from here on */
    uint32_t crc = p->crc_lines ? (uint32_t)given_crc : sei_crc32c(0, req, len);
    maybe_flip(&corrupt_request, req, len);
    if (!sei_begin(req, len, crc))                          /* SEI: phase I */
        return wire_reply_plain(wire, "CLIENT_ERROR crc mismatch\r\n") == 0 ? 1 : -1;
    SEI_ATOMIC {                                            /* SEI: E1, R, E2, V */
        sei_ignore_addr(&c->reply, sizeof c->reply);        /* SEI: checked by its CRC */
        /* The reply's CRC starts with the request, as E2 saw it: the client compares it
         * with the request it sent, so a request that framing lost, cut or took for
         * another cannot pass for the one the client is waiting on. */
        if (p->crc_lines) sei_output_append(req, len);      /* SEI */
        kv_execute(s, req, len, &c->reply);
        sei_output_append(c->reply.buf, c->reply.len);      /* SEI */
        sei_output_done();                                  /* SEI */
    }
    sei_end();                                              /* SEI */
    uint32_t reply_crc = sei_crc_pop();                     /* SEI */
    sei_barrier_wait();                                     /* SEI: threads */
    if (c->reply.len == 0) return 0; /* noreply */
    if (p->crc_lines) {
        /* the CRC line goes out in the same segment as the reply it covers */
        wire_put_crc_line(c->reply.buf + c->reply.len, reply_crc);
        c->reply.len += WIRE_CRC_LINE;
    }
    maybe_flip(&corrupt_reply, c->reply.buf, c->reply.len);
    return wire_send_all(c->wire.fd, c->reply.buf, c->reply.len);
}

static struct wire_conn *new_conn(int fd) {
    struct kv_conn *c = calloc(1, sizeof *c);
    if (c == NULL) return NULL;
    c->wire.fd = fd;
    c->wire.in = c->in;
    c->wire.in_cap = sizeof c->in;
    return &c->wire;
}

struct wire_protocol kv_protocol(struct kv_store *s, int crc_lines) {
    return (struct wire_protocol){
        .request_length = kv_request_length,
        .too_large = "SERVER_ERROR request too large\r\n",
        .crc_lines = crc_lines,
        .serve = serve_one,
        .new_conn = new_conn,
        .server = s,
    };
}
