/* The connection side of the example servers and of the ledger bench server
 * (bench/sei_ledger_server.c): listening, accepting, an epoll loop, request framing with
 * the pipeline rule (the dispatching phase) and sending replies (the output phase), as
 * docs/sei.md "Wire format and end-to-end CRCs" describes them. No libsei call is made
 * here: what a request is and how it is served (the hardened handler) is the server's,
 * named by a wire_protocol. */
#ifndef WIRE_H
#define WIRE_H

#include <stddef.h>
#include <stdint.h>

/* "#crc XXXXXXXX\r\n": the CRC32C line after a request and after its reply */
#define WIRE_CRC_LINE 15

/* The start of every connection a server allocates (the server's own fields follow it,
 * so that free() on the wire_conn frees the whole). */
struct wire_conn {
    int fd;
    /* set once a request failed its CRC: every later byte is dropped unread until the
     * client closes (the pipeline rule) */
    int discarding;
    size_t in_len;
    size_t in_cap; /* bytes at in: at least two of the longest framed requests */
    char *in;
};

struct wire_protocol {
    /* The length of the complete request at the start of buf (without its CRC line), 0
     * if more bytes are needed, -1 if it would be longer than the server takes. */
    long (*request_length)(const char *buf, size_t avail);
    /* The reply (without a CRC line) to a request longer than the server takes; the
     * connection is closed after it. */
    const char *too_large;
    /* Every request is followed by a CRC line (without one, the server computes the
     * request's CRC itself). */
    int crc_lines;
    /* Serves one framed request of len bytes at req (writable: the test hooks flip its
     * bits); crc is its CRC line's value, or -1 without CRC lines. Returns 0 when
     * served, 1 when the request failed its CRC check (the pipeline rule follows), -1
     * when the connection is lost. */
    int (*serve)(const struct wire_protocol *p, struct wire_conn *c, char *req, size_t len, long long crc);
    /* A new connection on fd, from malloc (NULL when out of memory). */
    struct wire_conn *(*new_conn)(int fd);
    void *server; /* the server's state, for serve */
};

/* A listening, non-blocking TCP socket on 127.0.0.1:port; exits 1 with a message on error. */
int wire_listen(int port);
/* Accepts every pending connection on lfd, dealing them round-robin over the epoll
 * instances eps[0..n) (for EPOLLIN, with the wire_conn as the event's data). Only one
 * thread may call it. */
void wire_accept(const struct wire_protocol *p, int lfd, const int *eps, int n);
/* Serves the connections of epoll instance ep forever, and accepts those that come to
 * the listening socket lfd (-1: none, another thread accepts them). */
void wire_loop(const struct wire_protocol *p, int ep, int lfd);
/* Serves what has arrived on c: returns 0 to keep the connection, -1 to close it. */
int wire_serve(const struct wire_protocol *p, struct wire_conn *c);
/* Sends all of buf: 0 when sent, -1 when the connection is lost. A count that no kernel
 * returns ends the process with 86 (see wire.c). */
int wire_send_all(int fd, const char *buf, size_t len);
/* Sends text, a reply without a CRC line (a notice or an error that ends a connection). */
int wire_reply_plain(struct wire_conn *c, const char *text);
/* Writes the CRC line of crc at `at` (WIRE_CRC_LINE bytes and a NUL). */
void wire_put_crc_line(char *at, uint32_t crc);

#endif
