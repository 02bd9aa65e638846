/* http_load: a small closed-loop HTTP/1.1 keep-alive load generator, used by
 * bench/nginx_bench.py to measure nginx natively and under `lockstep run --backend fast`.
 *
 * What it measures: the request rate that CONNS concurrent keep-alive connections get from
 * a server when each connection has exactly one request outstanding (send a request, read
 * the whole response, send the next one; no pipelining). Exactly REQUESTS requests are
 * sent in total. The rate is REQUESTS / the wall time from the first connect() to the end
 * of the last response (CLOCK_MONOTONIC), so it includes connection set-up, which is
 * negligible for tens of thousands of requests. Latency (send of a request's first byte
 * to the end of its response) is reported on stderr as p50/p99/max and p90/p99.9 (from a
 * histogram: 1 us resolution below 100 ms, 1 ms above).
 *
 * How: one thread, one epoll instance (level-triggered), non-blocking sockets. Every
 * connection sends `GET PATH HTTP/1.1\r\nHost: x\r\n\r\n` and reads the response: the
 * status line (`HTTP/1.x NNN ...`), the headers (at most HDR_MAX bytes) and a body of
 * exactly Content-Length bytes (read into a scratch buffer and discarded; 204 and 304 have
 * none). Chunked transfer coding and bodies without Content-Length are not supported and
 * end the run with an error. A response with `Connection: close` (nginx sends it on the
 * last request of a keep-alive connection, after keepalive_requests, default 1000), or an
 * HTTP/1.0 response without `Connection: keep-alive`, makes the connection close and
 * reconnect before its next request; the number of connects is in the stderr summary.
 *
 * Errors: a response whose status is not 200 counts as an error (`errors E`); the run goes
 * on and exits 1 at the end if E > 0. Fatal, with a message on stderr, exit status 1 and
 * no result line: a failed connect, a malformed or unsupported response, a connection
 * closed or reset in the middle of a response or without `Connection: close`, bytes beyond
 * the response, and no progress (no byte sent or received, no connect completed) for
 * -t seconds (default 10).
 *
 * Output: one machine-readable line on stdout,
 *     requests N errors E seconds S rps R
 * where N is the number of completed responses, and a human summary on stderr.
 *
 * Usage: http_load -p PORT [-c CONNS] [-n REQUESTS] [-H HOST] [-u PATH] [-t TIMEOUT_S]
 * Defaults: -c 50 -n 100000 -H 127.0.0.1 -u / -t 10.
 * Build: gcc -O2 -Wall -Wextra -Werror -o http_load bench/http_load.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#define HDR_MAX 16384        /* status line + headers of one response */
#define SCRATCH 65536        /* body bytes are read here and dropped */
#define MAX_CONNS 10000
#define LAT_FINE 100000      /* latency histogram: 1 us buckets below 100 ms, */
#define LAT_COARSE 100000    /* then 1 ms buckets up to 100.1 s, then one overflow bucket */

enum state { CONNECTING, SENDING, READ_HEAD, READ_BODY };

struct conn {
    int fd;
    int id;
    enum state st;
    size_t sent;             /* bytes of the current request sent */
    size_t hlen;             /* bytes in head[] */
    long long body_left;     /* READ_BODY: body bytes still to come */
    int close_after;         /* the current response ends this connection */
    int served;              /* responses completed on this connection */
    double t_req;            /* when the current request started */
    char head[HDR_MAX + 1];
};

static const char *prog = "http_load";
static char request[4096];
static size_t request_len;
static struct addrinfo *server;
static const char *host = "127.0.0.1";
static const char *port;
static int epfd;

static long long n_total = 100000, issued, completed, errors, connects, body_bytes;
static double last_progress;
static uint32_t lat_hist[LAT_FINE + LAT_COARSE + 1];
static double lat_max;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void die(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: error: ", prog);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, " (after %lld of %lld responses)\n", completed, n_total);
    exit(1);
}

static void usage(void)
{
    fprintf(stderr,
            "usage: %s -p PORT [-c CONNS] [-n REQUESTS] [-H HOST] [-u PATH] [-t TIMEOUT_S]\n"
            "  -c CONNS     concurrent keep-alive connections (default 50)\n"
            "  -n REQUESTS  total requests (default 100000)\n"
            "  -H HOST      server address or name (default 127.0.0.1)\n"
            "  -u PATH      request path (default /)\n"
            "  -t SECONDS   fail if nothing moves for this long (default 10)\n",
            prog);
    exit(2);
}

static long long parse_num(const char *s, const char *what, long long lo, long long hi)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v < lo || v > hi) {
        fprintf(stderr, "%s: bad %s: %s (want %lld..%lld)\n", prog, what, s, lo, hi);
        exit(2);
    }
    return v;
}

static void ep_set(struct conn *c, uint32_t events, int op)
{
    struct epoll_event ev = {.events = events, .data.ptr = c};
    if (epoll_ctl(epfd, op, c->fd, &ev) < 0)
        die("epoll_ctl: %s", strerror(errno));
}

static void open_conn(struct conn *c)
{
    c->fd = socket(server->ai_family, server->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                   server->ai_protocol);
    if (c->fd < 0)
        die("socket: %s", strerror(errno));
    int one = 1;
    setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    c->st = CONNECTING;
    c->served = 0;
    connects++;
    if (connect(c->fd, server->ai_addr, server->ai_addrlen) < 0 && errno != EINPROGRESS)
        die("connect to %s port %s: %s", host, port, strerror(errno));
    ep_set(c, EPOLLOUT, EPOLL_CTL_ADD);
}

static void close_conn(struct conn *c)
{
    close(c->fd); /* also removes it from the epoll set */
    c->fd = -1;
}

/* Sends (the rest of) the current request; returns when it is all out or the socket is
 * full (then waits for EPOLLOUT). */
static void do_send(struct conn *c)
{
    while (c->sent < request_len) {
        ssize_t n = send(c->fd, request + c->sent, request_len - c->sent, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                if (c->st != SENDING) {
                    c->st = SENDING;
                    ep_set(c, EPOLLOUT, EPOLL_CTL_MOD);
                }
                return;
            }
            die("connection %d: send: %s", c->id, strerror(errno));
        }
        c->sent += (size_t)n;
        last_progress = now();
    }
    if (c->st == SENDING)
        ep_set(c, EPOLLIN, EPOLL_CTL_MOD);
    c->st = READ_HEAD;
    c->hlen = 0;
}

/* Starts the next request on c, or closes c if all requests are issued. */
static void next_request(struct conn *c)
{
    if (issued >= n_total) {
        close_conn(c);
        return;
    }
    issued++;
    c->sent = 0;
    c->t_req = now();
    c->st = READ_HEAD; /* so that do_send only touches epoll on EAGAIN */
    do_send(c);
}

static void response_done(struct conn *c)
{
    double t = now();
    double us = (t - c->t_req) * 1e6;
    size_t b = us < LAT_FINE ? (size_t)us
             : us < LAT_FINE + 1000.0 * LAT_COARSE ? LAT_FINE + (size_t)((us - LAT_FINE) / 1000)
             : LAT_FINE + LAT_COARSE;
    lat_hist[b]++;
    if (us > lat_max)
        lat_max = us;
    completed++;
    c->served++;
    if (c->close_after) {
        close_conn(c);
        if (issued < n_total)
            open_conn(c);
        return;
    }
    next_request(c);
}

/* Case-insensitive header name match at line start; returns the trimmed value or NULL. */
static const char *header_value(const char *line, const char *name, size_t *vlen,
                                const char *eol)
{
    size_t nl = strlen(name);
    if ((size_t)(eol - line) <= nl || strncasecmp(line, name, nl) != 0 || line[nl] != ':')
        return NULL;
    const char *v = line + nl + 1;
    while (v < eol && (*v == ' ' || *v == '\t'))
        v++;
    const char *e = eol;
    while (e > v && (e[-1] == ' ' || e[-1] == '\t'))
        e--;
    *vlen = (size_t)(e - v);
    return v;
}

static int has_token(const char *v, size_t len, const char *tok)
{
    size_t tl = strlen(tok);
    for (size_t i = 0; i + tl <= len; i++)
        if (strncasecmp(v + i, tok, tl) == 0)
            return 1;
    return 0;
}

/* Parses the head in c->head[0..end) (end points past "\r\n\r\n"). Sets body_left and
 * close_after. */
static void parse_head(struct conn *c, size_t end)
{
    char *h = c->head;
    char *eol = memmem(h, end, "\r\n", 2);
    /* Status line: HTTP/1.x SP NNN [SP reason] */
    if (eol == NULL || eol - h < 12 || memcmp(h, "HTTP/1.", 7) != 0 ||
        (h[7] != '0' && h[7] != '1') || h[8] != ' ' || h[9] < '0' || h[9] > '9' ||
        h[10] < '0' || h[10] > '9' || h[11] < '0' || h[11] > '9' ||
        (eol - h > 12 && h[12] != ' ')) {
        size_t l = eol ? (size_t)(eol - h) : end;
        die("connection %d: bad status line: \"%.*s\"", c->id, (int)(l > 80 ? 80 : l), h);
    }
    int http10 = h[7] == '0';
    int status = (h[9] - '0') * 100 + (h[10] - '0') * 10 + (h[11] - '0');
    if (status < 200)
        die("connection %d: unsupported informational response %d", c->id, status);
    if (status != 200)
        errors++;

    long long clen = -1;
    int conn_close = 0, conn_keepalive = 0;
    char *line = eol + 2;
    char *stop = h + end - 2; /* the final empty line */
    while (line < stop) {
        eol = memmem(line, (size_t)(stop + 2 - line), "\r\n", 2);
        if (eol == NULL)
            die("connection %d: malformed header block", c->id);
        size_t vlen;
        const char *v;
        if ((v = header_value(line, "Content-Length", &vlen, eol)) != NULL) {
            char num[32];
            if (vlen == 0 || vlen >= sizeof num)
                die("connection %d: bad Content-Length: \"%.*s\"", c->id, (int)vlen, v);
            memcpy(num, v, vlen);
            num[vlen] = '\0';
            char *e;
            errno = 0;
            long long n = strtoll(num, &e, 10);
            if (errno != 0 || *e != '\0' || n < 0)
                die("connection %d: bad Content-Length: \"%s\"", c->id, num);
            if (clen >= 0 && clen != n)
                die("connection %d: conflicting Content-Length headers", c->id);
            clen = n;
        } else if ((v = header_value(line, "Transfer-Encoding", &vlen, eol)) != NULL) {
            if (!(vlen == 8 && strncasecmp(v, "identity", 8) == 0))
                die("connection %d: response uses Transfer-Encoding: %.*s "
                    "(chunked bodies are not supported)", c->id, (int)vlen, v);
        } else if ((v = header_value(line, "Connection", &vlen, eol)) != NULL) {
            if (has_token(v, vlen, "close"))
                conn_close = 1;
            if (has_token(v, vlen, "keep-alive"))
                conn_keepalive = 1;
        }
        line = eol + 2;
    }
    if (status == 204 || status == 304)
        clen = 0;
    if (clen < 0)
        die("connection %d: HTTP %d response without Content-Length "
            "(bodies delimited by close are not supported)", c->id, status);
    c->body_left = clen;
    c->close_after = conn_close || (http10 && !conn_keepalive);
}

/* Reads what is there for c; completes responses and starts the next requests. */
static void do_read(struct conn *c)
{
    static char scratch[SCRATCH];
    for (;;) {
        if (c->fd < 0 || c->st == CONNECTING || c->st == SENDING)
            return;
        ssize_t n;
        if (c->st == READ_HEAD) {
            if (c->hlen >= HDR_MAX)
                die("connection %d: response head larger than %d bytes", c->id, HDR_MAX);
            n = recv(c->fd, c->head + c->hlen, HDR_MAX - c->hlen, 0);
        } else {
            size_t want = c->body_left < SCRATCH ? (size_t)c->body_left : SCRATCH;
            /* Ask for one byte more than the body so that extra bytes are noticed. */
            n = recv(c->fd, scratch, want < SCRATCH ? want + 1 : want, 0);
        }
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return;
            die("connection %d: recv: %s", c->id, strerror(errno));
        }
        if (n == 0) {
            if (c->st == READ_HEAD && c->hlen == 0)
                die("connection %d: server closed the connection after %d responses "
                    "without Connection: close", c->id, c->served);
            die("connection %d: server closed the connection in the middle of a response "
                "(%s)", c->id, c->st == READ_HEAD ? "in the headers" : "in the body");
        }
        last_progress = now();
        if (c->st == READ_HEAD) {
            c->hlen += (size_t)n;
            c->head[c->hlen] = '\0';
            char *e = memmem(c->head, c->hlen, "\r\n\r\n", 4);
            if (e == NULL)
                continue;
            size_t end = (size_t)(e - c->head) + 4;
            parse_head(c, end);
            size_t extra = c->hlen - end;
            if ((long long)extra > c->body_left)
                die("connection %d: %zu bytes after the end of the response",
                    c->id, (size_t)((long long)extra - c->body_left));
            c->body_left -= (long long)extra;
            body_bytes += (long long)extra;
            c->st = READ_BODY;
        } else {
            if ((long long)n > c->body_left)
                die("connection %d: %lld bytes after the end of the response",
                    c->id, (long long)n - c->body_left);
            c->body_left -= n;
            body_bytes += n;
        }
        if (c->st == READ_BODY && c->body_left == 0) {
            /* The next request is out (or c closed): its response is not there yet, so
             * wait for epoll rather than make a recv that would say EAGAIN. */
            response_done(c);
            return;
        }
    }
}

static void on_event(struct conn *c, uint32_t ev)
{
    if (c->st == CONNECTING) {
        int err = 0;
        socklen_t len = sizeof err;
        if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0)
            err = errno;
        if (err != 0)
            die("connect to %s port %s: %s", host, port, strerror(err));
        if (!(ev & EPOLLOUT))
            return;
        last_progress = now();
        ep_set(c, EPOLLIN, EPOLL_CTL_MOD);
        c->st = READ_HEAD;
        next_request(c);
        return;
    }
    if (c->st == SENDING) {
        do_send(c);
        if (c->st == SENDING)
            return;
    }
    if (ev & (EPOLLIN | EPOLLHUP | EPOLLERR))
        do_read(c);
}

static double percentile(double q)
{
    long long want = (long long)(q * (double)completed + 0.5);
    if (want < 1)
        want = 1;
    long long seen = 0;
    for (size_t i = 0; i < LAT_FINE + LAT_COARSE; i++) {
        seen += lat_hist[i];
        if (seen >= want) {
            double mid = i < LAT_FINE ? (double)i + 0.5
                                      : LAT_FINE + ((double)(i - LAT_FINE) + 0.5) * 1000;
            return mid < lat_max ? mid : lat_max;
        }
    }
    return lat_max;
}

int main(int argc, char **argv)
{
    long long conns = 50;
    double timeout_s = 10;
    const char *path = "/";
    int opt;
    while ((opt = getopt(argc, argv, "c:n:p:H:u:t:h")) != -1) {
        switch (opt) {
        case 'c': conns = parse_num(optarg, "-c CONNS", 1, MAX_CONNS); break;
        case 'n': n_total = parse_num(optarg, "-n REQUESTS", 1, 1000000000000LL); break;
        case 'p': port = optarg; parse_num(optarg, "-p PORT", 1, 65535); break;
        case 'H': host = optarg; break;
        case 'u': path = optarg; break;
        case 't': timeout_s = (double)parse_num(optarg, "-t SECONDS", 1, 86400); break;
        default: usage();
        }
    }
    if (optind != argc || port == NULL)
        usage();
    if (path[0] != '/' || strpbrk(path, " \r\n") != NULL) {
        fprintf(stderr, "%s: bad -u PATH: must start with / and contain no spaces or "
                "line breaks\n", prog);
        return 2;
    }
    int rl = snprintf(request, sizeof request, "GET %s HTTP/1.1\r\nHost: x\r\n\r\n", path);
    if (rl < 0 || (size_t)rl >= sizeof request) {
        fprintf(stderr, "%s: -u PATH too long\n", prog);
        return 2;
    }
    request_len = (size_t)rl;

    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICSERV};
    int gai = getaddrinfo(host, port, &hints, &server);
    if (gai != 0) {
        fprintf(stderr, "%s: error: cannot resolve %s: %s\n", prog, host, gai_strerror(gai));
        return 1;
    }

    if (conns > n_total)
        conns = n_total;
    struct conn *cs = calloc((size_t)conns, sizeof *cs);
    struct epoll_event *evs = calloc((size_t)conns, sizeof *evs);
    if (cs == NULL || evs == NULL) {
        fprintf(stderr, "%s: error: out of memory\n", prog);
        return 1;
    }
    epfd = epoll_create1(EPOLL_CLOEXEC);
    if (epfd < 0)
        die("epoll_create1: %s", strerror(errno));

    double t0 = now();
    last_progress = t0;
    for (long long i = 0; i < conns; i++) {
        cs[i].id = (int)i;
        open_conn(&cs[i]);
    }
    while (completed < n_total) {
        int n = epoll_wait(epfd, evs, (int)conns, 1000);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            die("epoll_wait: %s", strerror(errno));
        }
        for (int i = 0; i < n; i++) {
            struct conn *c = evs[i].data.ptr;
            if (c->fd >= 0)
                on_event(c, evs[i].events);
        }
        if (now() - last_progress > timeout_s) {
            long long connecting = 0, waiting = 0;
            for (long long i = 0; i < conns; i++) {
                if (cs[i].fd < 0)
                    continue;
                if (cs[i].st == CONNECTING)
                    connecting++;
                else
                    waiting++;
            }
            die("timeout: no progress for %.0f s (%lld connections connecting, %lld waiting "
                "for a response)", timeout_s, connecting, waiting);
        }
    }
    double secs = now() - t0;
    double rps = secs > 0 ? (double)completed / secs : 0;

    printf("requests %lld errors %lld seconds %.3f rps %.1f\n", completed, errors, secs, rps);
    fflush(stdout);
    fprintf(stderr,
            "%s: %lld requests to http://%s:%s%s over %lld connections (%lld connects) in "
            "%.3f s: %.1f requests/s; %lld non-200 responses; %lld body bytes; latency "
            "p50 %.0f us, p99 %.0f us, max %.0f us (p90 %.0f us, p99.9 %.0f us)\n",
            prog, completed, host, port, path, conns, connects, secs, rps, errors, body_bytes,
            percentile(0.50), percentile(0.99), lat_max, percentile(0.90), percentile(0.999));
    freeaddrinfo(server);
    return errors > 0 ? 1 : 0;
}
