/* See wire.h. */
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

#include "wire.h"

int wire_listen(int port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                               .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (fd < 0 || bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0 || listen(fd, 128) != 0) {
        fprintf(stderr, "%s: cannot listen on 127.0.0.1:%d: %s\n", program_invocation_short_name, port,
                strerror(errno));
        exit(1);
    }
    return fd;
}

void wire_accept(const struct wire_protocol *p, int lfd, const int *eps, int n) {
    static unsigned next; /* only the accepting thread calls this */
    int fd;
    while ((fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK)) >= 0) {
        struct wire_conn *c = p->new_conn(fd);
        if (c == NULL) {
            close(fd);
            continue;
        }
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &(int){1}, sizeof(int));
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
        epoll_ctl(eps[next++ % (unsigned)n], EPOLL_CTL_ADD, fd, &ev);
    }
}

void wire_loop(const struct wire_protocol *p, int ep, int lfd) {
    if (lfd >= 0) {
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
        epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev);
    }
    for (;;) {
        struct epoll_event events[64];
        int n = epoll_wait(ep, events, 64, -1);
        for (int i = 0; i < n; i++) {
            struct wire_conn *c = events[i].data.ptr;
            if (c == NULL) {
                wire_accept(p, lfd, &ep, 1);
                continue;
            }
            if (wire_serve(p, c) != 0) {
                epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
                close(c->fd);
                free(c);
            }
        }
    }
}

/* The output phase runs once and outside any handler, so it checks what the kernel
 * tells it: a send count that no kernel returns (neither -1 nor 1..len) is a corrupted
 * register, and stopping (86, detected) beats resending a reply the client would take
 * for the next one (found by bench/sei_eval.sh: send's 23 with bit 63 flipped, a stale
 * EAGAIN in errno, and the reply went out twice). */
int wire_send_all(int fd, const char *buf, size_t len) {
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
            fprintf(stderr, "%s: send returned %zd for %zu bytes: corrupted; stopping\n",
                    program_invocation_short_name, n, len);
            _exit(86);
        }
    }
    return 0;
}

int wire_reply_plain(struct wire_conn *c, const char *text) { return wire_send_all(c->fd, text, strlen(text)); }

void wire_put_crc_line(char *at, uint32_t crc) { snprintf(at, WIRE_CRC_LINE + 1, "#crc %08x\r\n", crc); }

/* "#crc XXXXXXXX\r\n" at buf: the CRC, or -1 if the line is not one */
static long long parse_crc_line(const char *buf, size_t len) {
    if (len < WIRE_CRC_LINE || memcmp(buf, "#crc ", 5) != 0 || buf[13] != '\r' || buf[14] != '\n') return -1;
    char hex[9];
    memcpy(hex, buf + 5, 8);
    hex[8] = 0;
    char *end;
    unsigned long v = strtoul(hex, &end, 16);
    return *end ? -1 : (long long)v;
}

/* The bytes that arrived, counted by recv: 0 at the end of the stream, -1 when nothing
 * more is there for now, -2 when the connection is lost. Like send's, a count no kernel
 * returns stops the process. */
static ssize_t receive(struct wire_conn *c) {
    for (;;) {
        errno = 0;
        size_t room = c->in_cap - c->in_len;
        ssize_t n = recv(c->fd, c->in + c->in_len, room, 0);
        if (n >= 0 && (size_t)n <= room) return n;
        if (n != -1) {
            fprintf(stderr, "%s: recv returned %zd for %zu bytes: corrupted; stopping\n",
                    program_invocation_short_name, n, room);
            _exit(86);
        }
        if (errno == EAGAIN || errno == EWOULDBLOCK) return -1;
        if (errno != EINTR) return -2;
    }
}

int wire_serve(const struct wire_protocol *p, struct wire_conn *c) {
    for (;;) {
        if (c->discarding) c->in_len = 0;
        ssize_t n = receive(c);
        if (n == 0 || n == -2) return -1;
        if (n == -1) return 0;
        c->in_len += (size_t)n;
        if (c->discarding) continue;
        size_t used = 0;
        for (;;) {
            char *req = c->in + used;
            size_t avail = c->in_len - used;
            long len = p->request_length(req, avail);
            if (len < 0) {
                wire_reply_plain(c, p->too_large);
                return -1;
            }
            if (len == 0) break;
            size_t frame = (size_t)len;
            long long crc = -1;
            if (p->crc_lines) {
                if (avail < frame + WIRE_CRC_LINE) break;
                crc = parse_crc_line(req + frame, avail - frame);
                if (crc < 0) {
                    wire_reply_plain(c, "CLIENT_ERROR expected a #crc line\r\n");
                    return -1;
                }
                frame += WIRE_CRC_LINE;
            }
            int served = p->serve(p, c, req, (size_t)len, crc);
            if (served < 0) return -1;
            if (served > 0) {
                /* The client resends from the discarded request on; running what
                 * follows it now would run those requests out of order. The FIN after
                 * the notice tells the client that nothing more will run here; reading
                 * until its close spares it a reset that could destroy the notice. */
                shutdown(c->fd, SHUT_WR);
                c->discarding = 1;
                used = c->in_len;
                break;
            }
            used += frame;
        }
        memmove(c->in, c->in + used, c->in_len - used);
        c->in_len -= used;
        /* in_cap holds two of the longest framed requests, so a full buffer means a
         * request_length that let a longer one through */
        if (c->in_len == c->in_cap) {
            wire_reply_plain(c, p->too_large);
            return -1;
        }
    }
}
