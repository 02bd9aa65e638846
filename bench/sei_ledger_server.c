/* The ledger service (bench/sei_ledger.h, the handler bench/sei_ledger.c times) as a
 * single-threaded epoll TCP server on 127.0.0.1:--port, for the fault campaign of issue
 * 18 (bench/sei_ledger_eval.sh, with the CRC-checking client bench/sei_ledger_client.py).
 * Its connections are the example servers' (sei/examples/wire.c: framing, the pipeline
 * rule, the output phase); this file holds the request format and the hardened handler.
 * Built with wire.c natively (gcc -DSEI_NATIVE -I sei/include) and hardened (lockstep
 * cc). The lines that harden the handler are marked "SEI:".
 *
 * Wire format: that of the example servers with --crc (docs/sei.md, "Wire format and
 * end-to-end CRCs"), with the ledger's requests in place of memcached's. It always
 * carries CRCs.
 *
 *   request R   non-empty lines, each ending in "\n", then an empty line "\n" that ends
 *               R (an empty line alone is an empty batch). A batch is lines
 *               "T from to amount\n"; the line "C\n" asks for the state's checksum.
 *               At most REQ_MAX bytes: a longer one gets "CLIENT_ERROR request too
 *               large\r\n" and the connection is closed.
 *   then        "#crc XXXXXXXX\r\n" (15 bytes): CRC32C(R), 8 hex digits. Anything else
 *               gets "CLIENT_ERROR expected a #crc line\r\n" and the connection is closed.
 *   reply P     one line: "OK <moved> moved, audit <16 hex>\r\n" for a batch,
 *               "CHECKSUM <16 hex>\r\n" for "C";
 *   then        "#crc YYYYYYYY\r\n": CRC32C(R ‖ P), computed by the hardened handler
 *               (sei_output_append(R), then sei_output_append(P), inside SEI_ATOMIC).
 *
 * A request that fails phase I's CRC check gets "CLIENT_ERROR crc mismatch\r\n" in place
 * of its reply, and then the pipeline rule: the server runs nothing more on that
 * connection, shuts down its sending side and drops what arrives until the client
 * closes; the client reconnects and resends from the first request it has no reply to. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>

#include "../sei/examples/wire.h"
#include "sei.h"
#include "sei_ledger.h"

/* A batch of 32 transfers is under 700 bytes; 4096 leaves room for longer numbers
 * without letting a client make the server buffer without bound. */
#define REQ_MAX 4096

struct conn {
    struct wire_conn wire; /* first: wire.c frees a conn as its wire_conn */
    /* a whole request with its CRC line, and as much again of the next pipelined one */
    char in[2 * (REQ_MAX + WIRE_CRC_LINE)];
};

/* The reply and its CRC line. Written by the handler but left out of libsei's state
 * comparison (sei_ignore_addr), as kv_net.c does with its reply: the CRC that the client
 * checks covers its bytes, and len is only a count of them. */
static struct {
    size_t len;
    char buf[LEDGER_REPLY_MAX + WIRE_CRC_LINE + 1];
} out;

/* The length of the request at buf (up to and including its empty line), 0 if it has
 * not all arrived, -1 if it is longer than REQ_MAX. */
static long request_length(const char *buf, size_t avail) {
    size_t lim = avail < REQ_MAX ? avail : REQ_MAX;
    for (size_t i = 0; i < lim; i++)
        if (buf[i] == '\n' && (i == 0 || buf[i - 1] == '\n')) return (long)i + 1;
    return avail >= REQ_MAX ? -1 : 0;
}

/* One request: the hardened handler, then the output phase (wire_protocol.serve). */
static int serve_one(const struct wire_protocol *p, struct wire_conn *c, char *req, size_t len,
                     long long crc) {
    (void)p;
    if (!sei_begin(req, len, (uint32_t)crc))                /* SEI: phase I */
        return wire_reply_plain(c, "CLIENT_ERROR crc mismatch\r\n") == 0 ? 1 : -1;
    SEI_ATOMIC {                                            /* SEI: E1, R, E2, V */
        sei_ignore_addr(&out, sizeof out);                  /* SEI: checked by its CRC */
        /* The reply's CRC starts with the request as E2 saw it, so that a request that
         * framing lost, cut or took for another cannot pass for the one the client is
         * waiting on. */
        sei_output_append(req, len);                        /* SEI */
        out.len = ledger_handle(req, len, out.buf, LEDGER_REPLY_MAX);
        sei_output_append(out.buf, out.len);                /* SEI */
        sei_output_done();                                  /* SEI */
    }
    sei_end();                                              /* SEI */
    uint32_t reply_crc = sei_crc_pop();                     /* SEI */
    /* a corrupted count must not make the CRC line overflow the buffer; the client
     * rejects the cut reply by its CRC */
    size_t n = out.len < LEDGER_REPLY_MAX ? out.len : LEDGER_REPLY_MAX;
    /* the CRC line goes out in the same segment as the reply it covers */
    wire_put_crc_line(out.buf + n, reply_crc);
    return wire_send_all(c->fd, out.buf, n + WIRE_CRC_LINE);
}

static struct wire_conn *new_conn(int fd) {
    struct conn *c = calloc(1, sizeof *c);
    if (c == NULL) return NULL;
    c->wire.fd = fd;
    c->wire.in = c->in;
    c->wire.in_cap = sizeof c->in;
    return &c->wire;
}

static int parse_port(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "--port") == 0) {
        char *end;
        long v = strtol(argv[2], &end, 10);
        if (*end == 0 && v >= 1 && v <= 65535) return (int)v;
    }
    fprintf(stderr,
            "usage: %s --port P\n"
            "  the ledger service (bench/sei_ledger.h) on 127.0.0.1:P; requests and replies carry\n"
            "  CRC32C lines (see the header comment of bench/sei_ledger_server.c)\n",
            argv[0]);
    exit(2);
}

int main(int argc, char **argv) {
    int port = parse_port(argc, argv);
    /* The initial balances are state like any other: set outside a handler, a fault
     * in their stores (one in the campaign turned a 1000 into 1004) would stay silent
     * until the checksum, so a local handler sets them, and dup mode compares them. */
    SEI_LOCAL_HANDLER() { ledger_init(); }                  /* SEI */
    static const struct wire_protocol protocol = {
        .request_length = request_length,
        .too_large = "CLIENT_ERROR request too large\r\n",
        .crc_lines = 1,
        .serve = serve_one,
        .new_conn = new_conn,
    };
    int lfd = wire_listen(port);
#ifdef SEI_NATIVE
    const char *mode = "native";
#else
    const char *mode = sei_mode() == SEI_MODE_DUP ? "dup" : "ecc";
#endif
    fprintf(stderr, "sei_ledger_server: listening on 127.0.0.1:%d (%s)\n", port, mode);
    wire_loop(&protocol, epoll_create1(0), lfd);
}
