/* Connections of the example servers: request framing (the dispatching phase), the
 * hardened handler, and replies (the output phase, with the reply's CRC in --crc mode). */
#ifndef KV_NET_H
#define KV_NET_H

#include "kv_store.h"

#define KV_IN_MAX (2 * (KV_MAX_FRAME + KV_MAX_LINE))

struct kv_conn {
    int fd;
    /* set once a request failed its CRC: every later byte is dropped unread until the
     * client closes (the pipeline rule, docs/sei.md "Wire format and end-to-end CRCs") */
    int discarding;
    size_t in_len;
    char in[KV_IN_MAX];
    struct kv_reply reply;
};

struct kv_options {
    int port;
    int threads;
    int crc; /* requests and replies carry "#crc XXXXXXXX" lines */
};

/* Parses the command line; prints usage and exits 2 on a bad argument. */
void kv_parse_options(int argc, char **argv, struct kv_options *o, int threaded);
/* A listening, non-blocking TCP socket on 127.0.0.1:port; exits with a message on error. */
int kv_listen(int port);
/* Accepts every pending connection on lfd, dealing them round-robin over the epoll
 * instances eps[0..n) (for EPOLLIN, with the kv_conn as the event's data). */
void kv_accept(int lfd, const int *eps, int n);
/* Serves what has arrived on c: returns 0 to keep the connection, -1 to close it. */
int kv_serve(struct kv_store *s, struct kv_conn *c, int crc_mode);

#endif
