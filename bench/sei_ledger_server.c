/* The ledger service (bench/sei_ledger.h, the handler bench/sei_ledger.c times) as a
 * single-threaded epoll TCP server on 127.0.0.1:--port, for the fault campaign of issue
 * 18 (bench/sei_ledger_eval.sh, with the CRC-checking client bench/sei_ledger_client.py).
 * Built natively (gcc -DSEI_NATIVE -I sei/include) and hardened (lockstep cc). The lines
 * that harden the handler are marked "SEI:".
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
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "sei.h"
#include "sei_ledger.h"

/* A batch of 32 transfers is under 700 bytes; 4096 leaves room for longer numbers
 * without letting a client make the server buffer without bound. */
#define REQ_MAX 4096
#define CRC_LINE 15
/* a whole request with its CRC line, and as much again of the next pipelined one */
#define IN_MAX (2 * (REQ_MAX + CRC_LINE))

struct conn {
    int fd;
    int discarding; /* a request failed its CRC: drop every later byte (the pipeline rule) */
    size_t in_len;
    char in[IN_MAX];
};

/* The reply and its CRC line. Written by the handler but left out of libsei's state
 * comparison (sei_ignore_addr), as kv_net.c does with its reply: the CRC that the client
 * checks covers its bytes, and len is only a count of them. */
static struct {
    size_t len;
    char buf[LEDGER_REPLY_MAX + CRC_LINE + 1];
} out;

/* The output phase runs once and outside any handler, so it checks what the kernel
 * tells it: a send count that no kernel returns is a corrupted register, and stopping
 * (86, detected) beats resending a reply the client would take for the next one (as in
 * sei/examples/kv_net.c). */
static int send_all(int fd, const char *buf, size_t len) {
    while (len > 0) {
        errno = 0;
        ssize_t n = send(fd, buf, len, MSG_NOSIGNAL);
        if (n > 0 && (size_t)n <= len) {
            buf += n;
            len -= (size_t)n;
        } else if (n == -1 && (errno == EAGAIN || errno == EINTR)) {
            struct pollfd p = {fd, POLLOUT, 0};
            poll(&p, 1, 1000);
        } else if (n == -1 || n == 0) {
            return -1;
        } else {
            fprintf(stderr, "ledger: send returned %zd for %zu bytes: corrupted; stopping\n", n, len);
            _exit(86);
        }
    }
    return 0;
}

static int reply_plain(struct conn *c, const char *text) { return send_all(c->fd, text, strlen(text)); }

/* The length of the request at buf (up to and including its empty line), 0 if it has
 * not all arrived, -1 if it is longer than REQ_MAX. */
static long request_length(const char *buf, size_t avail) {
    size_t lim = avail < REQ_MAX ? avail : REQ_MAX;
    for (size_t i = 0; i < lim; i++)
        if (buf[i] == '\n' && (i == 0 || buf[i - 1] == '\n')) return (long)i + 1;
    return avail >= REQ_MAX ? -1 : 0;
}

/* "#crc XXXXXXXX\r\n" at buf: the CRC, or -1 if the line is not one */
static long long parse_crc_line(const char *buf, size_t len) {
    if (len < CRC_LINE || memcmp(buf, "#crc ", 5) != 0 || buf[13] != '\r' || buf[14] != '\n') return -1;
    char hex[9];
    memcpy(hex, buf + 5, 8);
    hex[8] = 0;
    char *end;
    unsigned long v = strtoul(hex, &end, 16);
    return *end ? -1 : (long long)v;
}

/* One request: the hardened handler, then the output phase. Returns 0 when served, 1
 * when the request failed its CRC (the caller applies the pipeline rule), -1 when the
 * connection is lost. */
static int serve_one(struct conn *c, const char *req, size_t len, uint32_t crc) {
    if (!sei_begin(req, len, crc))                          /* SEI: phase I */
        return reply_plain(c, "CLIENT_ERROR crc mismatch\r\n") == 0 ? 1 : -1;
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
    snprintf(out.buf + n, CRC_LINE + 1, "#crc %08x\r\n", reply_crc);
    return send_all(c->fd, out.buf, n + CRC_LINE);
}

/* Serves what has arrived on c: returns 0 to keep the connection, -1 to close it. */
static int serve(struct conn *c) {
    for (;;) {
        errno = 0;
        if (c->discarding) c->in_len = 0;
        size_t room = sizeof c->in - c->in_len;
        ssize_t n = recv(c->fd, c->in + c->in_len, room, 0);
        if (n == 0) return -1;
        if (n > 0 && (size_t)n > room) {
            fprintf(stderr, "ledger: recv returned %zd for %zu bytes: corrupted; stopping\n", n, room);
            _exit(86);
        }
        if (n < 0) {
            if (n != -1) {
                fprintf(stderr, "ledger: recv returned %zd: corrupted; stopping\n", n);
                _exit(86);
            }
            if (errno == EAGAIN || errno == EWOULDBLOCK) break;
            if (errno == EINTR) continue;
            return -1;
        }
        c->in_len += (size_t)n;
        if (c->discarding) continue;
        size_t used = 0;
        for (;;) {
            const char *req = c->in + used;
            size_t avail = c->in_len - used;
            long len = request_length(req, avail);
            if (len < 0) {
                reply_plain(c, "CLIENT_ERROR request too large\r\n");
                return -1;
            }
            if (len == 0) break;
            size_t frame = (size_t)len;
            if (avail < frame + CRC_LINE) break;
            long long given = parse_crc_line(req + frame, avail - frame);
            if (given < 0) {
                reply_plain(c, "CLIENT_ERROR expected a #crc line\r\n");
                return -1;
            }
            int served = serve_one(c, req, frame, (uint32_t)given);
            if (served < 0) return -1;
            if (served > 0) {
                /* The client resends from the discarded request on; running what
                 * follows now would run those requests out of order. The FIN after the
                 * notice tells the client that nothing more runs here; reading until its
                 * close spares it a reset that could destroy the notice. */
                shutdown(c->fd, SHUT_WR);
                c->discarding = 1;
                used = c->in_len;
                break;
            }
            used += frame + CRC_LINE;
        }
        memmove(c->in, c->in + used, c->in_len - used);
        c->in_len -= used;
    }
    return 0;
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
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &(int){1}, sizeof(int));
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                               .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&addr, sizeof addr) != 0 || listen(lfd, 128) != 0) {
        fprintf(stderr, "ledger: cannot listen on 127.0.0.1:%d: %s\n", port, strerror(errno));
        return 1;
    }
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev);
#ifdef SEI_NATIVE
    const char *mode = "native";
#else
    const char *mode = sei_mode() == SEI_MODE_DUP ? "dup" : "ecc";
#endif
    fprintf(stderr, "sei_ledger_server: listening on 127.0.0.1:%d (%s)\n", port, mode);
    for (;;) {
        struct epoll_event events[64];
        int n = epoll_wait(ep, events, 64, -1);
        for (int i = 0; i < n; i++) {
            struct conn *c = events[i].data.ptr;
            if (c == NULL) {
                int fd;
                while ((fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK)) >= 0) {
                    c = calloc(1, sizeof *c);
                    if (c == NULL) {
                        close(fd);
                        continue;
                    }
                    c->fd = fd;
                    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &(int){1}, sizeof(int));
                    struct epoll_event cev = {.events = EPOLLIN, .data.ptr = c};
                    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &cev);
                }
                continue;
            }
            if (serve(c) != 0) {
                epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
                close(c->fd);
                free(c);
            }
        }
    }
}
