/* See kv_net.h. The lines that harden the handler are marked "SEI:". */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

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

int kv_listen(int port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                               .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (fd < 0 || bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0 || listen(fd, 128) != 0) {
        fprintf(stderr, "kv: cannot listen on 127.0.0.1:%d: %s\n", port, strerror(errno));
        exit(1);
    }
    return fd;
}

void kv_accept(int lfd, const int *eps, int n) {
    static unsigned next; /* only the accepting thread calls this */
    int fd;
    while ((fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK)) >= 0) {
        struct kv_conn *c = calloc(1, sizeof *c);
        if (c == NULL) {
            close(fd);
            continue;
        }
        c->fd = fd;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &(int){1}, sizeof(int));
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
        epoll_ctl(eps[next++ % (unsigned)n], EPOLL_CTL_ADD, fd, &ev);
    }
}

/* The output phase runs once and outside any handler, so it checks what the kernel
 * tells it: a send count that no kernel returns (neither -1 nor 1..len) is a corrupted
 * register, and stopping beats resending a reply the client would take for the next one
 * (found by bench/sei_eval.sh: send's 23 with bit 63 flipped, a stale EAGAIN in errno,
 * and the reply went out twice). */
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
            fprintf(stderr, "kv: send returned %zd for %zu bytes: corrupted; stopping\n", n, len);
            _exit(86);
        }
    }
    return 0;
}

/* "#crc XXXXXXXX\r\n" at buf: the CRC, or -1 if the line is not one */
static long long parse_crc_line(const char *buf, size_t len) {
    if (len < 15 || memcmp(buf, "#crc ", 5) != 0 || buf[13] != '\r' || buf[14] != '\n') return -1;
    char hex[9];
    memcpy(hex, buf + 5, 8);
    hex[8] = 0;
    char *end;
    unsigned long v = strtoul(hex, &end, 16);
    return *end ? -1 : (long long)v;
}

static int reply_plain(struct kv_conn *c, const char *text) { return send_all(c->fd, text, strlen(text)); }

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

/* One request: the hardened handler, then the output phase. Returns 0 when served, 1
 * when the request failed its CRC (the caller applies the pipeline rule), -1 when the
 * connection is lost. */
static int serve_one(struct kv_store *s, struct kv_conn *c, const char *req, size_t len, uint32_t crc,
                     int crc_mode) {
    if (!sei_begin(req, len, crc))                          /* SEI: phase I */
        return reply_plain(c, "CLIENT_ERROR crc mismatch\r\n") == 0 ? 1 : -1;
    SEI_ATOMIC {                                            /* SEI: E1, R, E2, V */
        sei_ignore_addr(&c->reply, sizeof c->reply);        /* SEI: checked by its CRC */
        /* The reply's CRC starts with the request, as E2 saw it: the client compares it
         * with the request it sent, so a request that framing lost, cut or took for
         * another cannot pass for the one the client is waiting on. */
        if (crc_mode) sei_output_append(req, len);          /* SEI */
        kv_execute(s, req, len, &c->reply);
        sei_output_append(c->reply.buf, c->reply.len);      /* SEI */
        sei_output_done();                                  /* SEI */
    }
    sei_end();                                              /* SEI */
    uint32_t reply_crc = sei_crc_pop();                     /* SEI */
    sei_barrier_wait();                                     /* SEI: threads */
    if (c->reply.len == 0) return 0; /* noreply */
    if (crc_mode) {
        /* the CRC line goes out in the same segment as the reply it covers */
        snprintf(c->reply.buf + c->reply.len, 16, "#crc %08x\r\n", reply_crc);
        c->reply.len += 15;
    }
    maybe_flip(&corrupt_reply, c->reply.buf, c->reply.len);
    return send_all(c->fd, c->reply.buf, c->reply.len);
}

int kv_serve(struct kv_store *s, struct kv_conn *c, int crc_mode) {
    for (;;) {
        errno = 0;
        if (c->discarding) c->in_len = 0;
        size_t room = sizeof c->in - c->in_len;
        ssize_t n = recv(c->fd, c->in + c->in_len, room, 0);
        if (n == 0) return -1;
        if (n > 0 && (size_t)n > room) {
            fprintf(stderr, "kv: recv returned %zd for %zu bytes: corrupted; stopping\n", n, room);
            _exit(86);
        }
        if (n < 0) {
            if (n != -1) {
                fprintf(stderr, "kv: recv returned %zd: corrupted; stopping\n", n);
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
            long len = kv_request_length(req, avail);
            if (len < 0) {
                reply_plain(c, "SERVER_ERROR request too large\r\n");
                return -1;
            }
            if (len == 0) break;
            uint32_t crc;
            size_t frame = (size_t)len;
            if (crc_mode) {
                if (avail < frame + 15) break;
                long long given = parse_crc_line(req + frame, avail - frame);
                if (given < 0) {
                    reply_plain(c, "CLIENT_ERROR expected a #crc line\r\n");
                    return -1;
                }
                crc = (uint32_t)given;
                frame += 15;
            } else {
                crc = sei_crc32c(0, req, (size_t)len); /* protects the request from here on */
            }
            if (hook_fires(&skip_request)) {
                used += frame;
                continue;
            }
            maybe_flip(&corrupt_request, c->in + used, (size_t)len);
            int served = serve_one(s, c, req, (size_t)len, crc, crc_mode);
            if (served < 0) return -1;
            if (served > 0) {
                /* The client resends from the discarded request on; running what
                 * follows it now would run those requests out of order. The FIN
                 * after the notice tells the client that nothing more will run
                 * here; reading until its close spares it a reset that could
                 * destroy the notice. */
                shutdown(c->fd, SHUT_WR);
                c->discarding = 1;
                used = c->in_len;
                break;
            }
            used += frame;
        }
        memmove(c->in, c->in + used, c->in_len - used);
        c->in_len -= used;
        if (c->in_len == sizeof c->in) {
            reply_plain(c, "CLIENT_ERROR request too large\r\n");
            return -1;
        }
    }
    return 0;
}
