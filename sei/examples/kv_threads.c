/* The multi-threaded example server: the main thread accepts and deals connections
 * round-robin to worker threads, each with its own epoll loop; all workers share one
 * hash table guarded by striped mutexes (kv_store.c). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/epoll.h>

#include "kv_net.h"

static struct kv_store store;
static struct kv_options options;
static struct wire_protocol protocol;

struct worker {
    pthread_t thread;
    int ep;
};

static void *work(void *arg) {
    struct worker *w = arg;
    wire_loop(&protocol, w->ep, -1);
    return NULL;
}

int main(int argc, char **argv) {
    kv_parse_options(argc, argv, &options, 1);
    if (kv_store_init(&store, 1) != 0) {
        fprintf(stderr, "kv: out of memory\n");
        return 1;
    }
    protocol = kv_protocol(&store, options.crc);
    int lfd = wire_listen(options.port);
    struct worker *workers = calloc((size_t)options.threads, sizeof *workers);
    for (int i = 0; i < options.threads; i++) {
        workers[i].ep = epoll_create1(0);
        if (pthread_create(&workers[i].thread, NULL, work, &workers[i]) != 0) {
            fprintf(stderr, "kv: cannot start worker %d\n", i);
            return 1;
        }
    }
    fprintf(stderr, "kv_threads: listening on 127.0.0.1:%d with %d workers%s (%s)\n", options.port,
            options.threads, options.crc ? " and CRCs" : "", sei_mode() == SEI_MODE_DUP ? "dup" : "ecc");
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN};
    epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev);
    int *eps = calloc((size_t)options.threads, sizeof *eps);
    for (int i = 0; i < options.threads; i++) eps[i] = workers[i].ep;
    for (;;) {
        struct epoll_event e;
        if (epoll_wait(ep, &e, 1, -1) > 0) wire_accept(&protocol, lfd, eps, options.threads);
    }
}
