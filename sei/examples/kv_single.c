/* The single-threaded example server: one epoll loop over all connections. */
#define _GNU_SOURCE
#include <stdio.h>
#include <sys/epoll.h>

#include "kv_net.h"

int main(int argc, char **argv) {
    struct kv_options o;
    kv_parse_options(argc, argv, &o, 0);
    static struct kv_store store;
    if (kv_store_init(&store, 0) != 0) {
        fprintf(stderr, "kv: out of memory\n");
        return 1;
    }
    struct wire_protocol protocol = kv_protocol(&store, o.crc);
    int lfd = wire_listen(o.port);
    fprintf(stderr, "kv_single: listening on 127.0.0.1:%d%s (%s)\n", o.port, o.crc ? " with CRCs" : "",
            sei_mode() == SEI_MODE_DUP ? "dup" : "ecc");
    wire_loop(&protocol, epoll_create1(0), lfd);
}
