/* The key-value store shared by the two example servers: a chained hash table with an
 * optional set of striped mutexes, and the handler that executes one memcached text
 * request (get, set, delete) against it. */
#ifndef KV_STORE_H
#define KV_STORE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "sei.h"

#define KV_MAX_KEY 250
#define KV_MAX_VALUE 4096 /* a set is logged word by word: see SEI_MAX_WORDS */
#define KV_MAX_LINE 1024
#define KV_MAX_FRAME (2 * KV_MAX_VALUE) /* larger sets close the connection */
#define KV_REPLY_MAX (4 * (KV_MAX_VALUE + KV_MAX_KEY + 64))
#define KV_BUCKETS 65536
#define KV_STRIPES 16

struct kv_item {
    struct kv_item *next;
    uint32_t flags;
    uint32_t key_len;
    uint32_t value_len;
    char data[]; /* key, then value */
};

struct kv_store {
    struct kv_item **buckets;
    pthread_mutex_t *stripes; /* NULL: single-threaded, no locking */
    /* items per stripe: a single counter would be written under different stripe locks,
     * a data race that libsei reports (E1 and E2 would read different counts) */
    uint64_t items[KV_STRIPES];
};

struct kv_reply {
    size_t len;
    char buf[KV_REPLY_MAX + 16]; /* + the "#crc XXXXXXXX" line of --crc mode */
};

/* Outside handlers: creates an empty store (with striped locks if threaded). */
int kv_store_init(struct kv_store *s, int threaded);

/* The length of the complete request at the start of buf (the command line and, for
 * set, its data block), 0 if more bytes are needed, -1 if the line is too long or the
 * data block larger than KV_MAX_FRAME. */
long kv_request_length(const char *buf, size_t len);

/* The handler: executes one request and writes its reply (possibly empty, for noreply).
 * Instrumented under libsei (SEI_SAFE). */
SEI_SAFE void kv_execute(struct kv_store *s, const char *req, size_t len, struct kv_reply *reply);

#endif
