/* The single-threaded example server: one epoll loop over all connections. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kv_net.h"

int main(int argc, char **argv) {
    struct kv_options o;
    kv_parse_options(argc, argv, &o, 0);
    static struct kv_store store;
    if (kv_store_init(&store, 0) != 0) {
        fprintf(stderr, "kv: out of memory\n");
        return 1;
    }
    int lfd = kv_listen(o.port);
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev);
    fprintf(stderr, "kv_single: listening on 127.0.0.1:%d%s (%s)\n", o.port, o.crc ? " with CRCs" : "",
            sei_mode() == SEI_MODE_DUP ? "dup" : "ecc");
    for (;;) {
        struct epoll_event events[64];
        int n = epoll_wait(ep, events, 64, -1);
        for (int i = 0; i < n; i++) {
            struct kv_conn *c = events[i].data.ptr;
            if (c == NULL) {
                kv_accept(lfd, &ep, 1);
                continue;
            }
            if (kv_serve(&store, c, o.crc) != 0) {
                epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
                close(c->fd);
                free(c);
            }
        }
    }
}
