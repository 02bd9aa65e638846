/* The example servers' side of the wire (wire.h): their options, their connections and
 * the annotated handler that serves one request (with the reply's CRC in --crc mode). */
#ifndef KV_NET_H
#define KV_NET_H

#include "kv_store.h"
#include "wire.h"

struct kv_conn {
    struct wire_conn wire; /* first: wire.c frees a kv_conn as its wire_conn */
    struct kv_reply reply;
    char in[2 * (KV_MAX_FRAME + KV_MAX_LINE)];
};

struct kv_options {
    int port;
    int threads;
    int crc; /* requests and replies carry "#crc XXXXXXXX" lines */
};

/* Parses the command line; prints usage and exits 2 on a bad argument. */
void kv_parse_options(int argc, char **argv, struct kv_options *o, int threaded);
/* The memcached-subset protocol over store s, with CRC lines or without. */
struct wire_protocol kv_protocol(struct kv_store *s, int crc_lines);

#endif
