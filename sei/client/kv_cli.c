/* The command-line client of the example servers on top of sei_client, the C twin of
 * sei/examples/kv_client.py (same commands, same output, same exit statuses):
 *
 *   kv_cli [--port P] [--crc] [--pipeline K] [--corrupt-crc N] check
 *   kv_cli [--port P] [--crc] [--pipeline K] [--corrupt-crc N] trace FILE
 *   kv_cli crc STRING
 *
 * check is a functional test of get, set and delete; trace replays a trace of
 * kv_client.py gen-trace ("set KEY VALUE [noreply]", "get KEY...", "delete KEY
 * [noreply]") and prints the replies; crc prints the CRC32C of STRING. --pipeline K
 * sends K requests per pipeline (default 1); --corrupt-crc N flips one bit of the CRC
 * of the Nth request frame sent (a test of the resend). Exit status 86: an error was
 * detected; 1: the connection failed; 2: usage. */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sei_client.h"

struct list {
    struct sei_request *reqs;
    char **want; /* the expected reply, or NULL: not checked */
    size_t n, cap;
};

static void add(struct list *l, char *req, size_t len, char *want) {
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 64;
        l->reqs = realloc(l->reqs, l->cap * sizeof *l->reqs);
        l->want = realloc(l->want, l->cap * sizeof *l->want);
        if (l->reqs == NULL || l->want == NULL) {
            fprintf(stderr, "kv_cli: out of memory\n");
            exit(1);
        }
    }
    l->reqs[l->n] = (struct sei_request){req, len};
    l->want[l->n++] = want;
}

static char *format(size_t *len, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static char *format(size_t *len, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char *s = NULL;
    int n = vasprintf(&s, fmt, ap);
    va_end(ap);
    if (n < 0) {
        fprintf(stderr, "kv_cli: out of memory\n");
        exit(1);
    }
    if (len) *len = (size_t)n;
    return s;
}

static char *repeat(const char *unit, size_t times) {
    size_t n = strlen(unit);
    char *s = malloc(n * times + 1);
    if (s == NULL) exit(1);
    for (size_t i = 0; i < times; i++) memcpy(s + i * n, unit, n);
    s[n * times] = 0;
    return s;
}

static void add_text(struct list *l, char *req, char *want) { add(l, req, strlen(req), want); }

static void add_set(struct list *l, const char *key, const char *value, int flags, int noreply, char *want) {
    size_t len;
    char *req = format(&len, "set %s %d 0 %zu%s\r\n%s\r\n", key, flags, strlen(value), noreply ? " noreply" : "", value);
    add(l, req, len, want);
}

/* Sends the list K requests at a time; prints the replies if `print`, else compares
 * them with the expected ones. */
static int run(struct sei_client *c, const struct list *l, size_t k, int print) {
    struct sei_reply *replies = calloc(k, sizeof *replies);
    if (replies == NULL) return 1;
    for (size_t at = 0; at < l->n; at += k) {
        size_t n = l->n - at < k ? l->n - at : k;
        int status = sei_client_pipeline(c, l->reqs + at, n, replies);
        if (status == SEI_CLIENT_DETECTED) {
            fflush(stdout);
            fprintf(stderr, "kv_cli: detected: %s\n", sei_client_error(c));
            return SEI_CLIENT_DETECTED;
        }
        if (status != SEI_CLIENT_OK) {
            fflush(stdout);
            fprintf(stderr, "kv_cli: %s\n", sei_client_error(c));
            return 1;
        }
        for (size_t i = 0; i < n; i++) {
            const char *want = l->want[at + i];
            const struct sei_reply *r = &replies[i];
            if (print) {
                fwrite(r->buf ? r->buf : "", 1, r->len, stdout);
            } else if (want && (r->len != strlen(want) || (r->len && memcmp(r->buf, want, r->len) != 0))) {
                fprintf(stderr, "unexpected reply to %.40s: %.80s (wanted %.80s)\n", l->reqs[at + i].buf,
                        r->buf ? r->buf : "", want);
                return 1;
            }
            free(r->buf);
        }
    }
    free(replies);
    if (sei_client_discards(c) > 0)
        fprintf(stderr, "kv_cli: the server discarded %lu pipelines; sent again from the discarded request\n",
                sei_client_discards(c));
    return 0;
}

/* The checks of kv_client.py's check, in the same order. */
static int check(struct sei_client *c, size_t k) {
    struct list l = {0};
    char *x1000 = repeat("x", 1000);
    add_set(&l, "a", "hello", 7, 0, "STORED\r\n");
    add_text(&l, "get a\r\n", "VALUE a 7 5\r\nhello\r\nEND\r\n");
    add_set(&l, "b", x1000, 0, 0, "STORED\r\n");
    add_text(&l, "get a b zz\r\n", format(NULL, "VALUE a 7 5\r\nhello\r\nVALUE b 0 1000\r\n%s\r\nEND\r\n", x1000));
    add_set(&l, "a", "again", 0, 1, "");
    add_text(&l, "get a\r\n", "VALUE a 0 5\r\nagain\r\nEND\r\n");
    add_text(&l, "delete a\r\n", "DELETED\r\n");
    add_text(&l, "delete a\r\n", "NOT_FOUND\r\n");
    add_text(&l, "get a\r\n", "END\r\n");
    add_text(&l, "bogus\r\n", "ERROR\r\n");
    add_text(&l, "set k 0 0 notanumber\r\n", "CLIENT_ERROR bad command line format\r\n");
    add_text(&l, "set k 0 0 3\r\nabcde", "CLIENT_ERROR bad data chunk\r\n");
    add_set(&l, "big", repeat("y", 5000), 0, 0, "SERVER_ERROR object too large for cache\r\n");
    add_text(&l, "get b\r\n", format(NULL, "VALUE b 0 1000\r\n%s\r\nEND\r\n", x1000));
    size_t first = l.n;
    for (int i = 0; i < 300; i++) {
        char *value = repeat(format(NULL, "%d", i), (size_t)(1 + i % 50));
        add_set(&l, format(NULL, "k%d", i), value, 0, i % 2 == 0, i % 2 == 0 ? "" : "STORED\r\n");
    }
    for (int i = 0; i < 300; i++) {
        char *value = repeat(format(NULL, "%d", i), (size_t)(1 + i % 50));
        add_text(&l, format(NULL, "get k%d\r\n", i),
                 format(NULL, "VALUE k%d 0 %zu\r\n%s\r\nEND\r\n", i, strlen(value), value));
    }
    int status = run(c, &l, k, 0);
    if (status == 0) printf("ok: %zu checks\n", first + 600);
    return status; /* the strings live until exit */
}

static int trace(struct sei_client *c, const char *path, size_t k) {
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        perror(path);
        return 1;
    }
    struct list l = {0};
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, f) > 0) {
        char *words[8];
        int n = 0;
        for (char *w = strtok(line, " \t\r\n"); w && n < 8; w = strtok(NULL, " \t\r\n")) words[n++] = w;
        if (n == 0) continue;
        if (strcmp(words[0], "set") == 0 && n >= 3) {
            int noreply = n == 4 && strcmp(words[3], "noreply") == 0;
            add_set(&l, strdup(words[1]), strdup(words[2]), 0, noreply, NULL);
        } else if (strcmp(words[0], "get") == 0 && n >= 2) {
            char *req = format(NULL, "get");
            for (int i = 1; i < n; i++) req = format(NULL, "%s %s", req, words[i]);
            add_text(&l, format(NULL, "%s\r\n", req), NULL);
        } else if (strcmp(words[0], "delete") == 0 && n >= 2) {
            int noreply = n == 3 && strcmp(words[2], "noreply") == 0;
            add_text(&l, format(NULL, "delete %s%s\r\n", words[1], noreply ? " noreply" : ""), NULL);
        } else {
            fprintf(stderr, "kv_cli: %s: not a trace line: %s\n", path, words[0]);
            return 1;
        }
    }
    fclose(f);
    return run(c, &l, k, 1);
}

static int usage(void) {
    fprintf(stderr, "usage: kv_cli [--port P] [--crc] [--pipeline K] [--corrupt-crc N] check | trace FILE\n"
                    "       kv_cli crc STRING\n");
    return 2;
}

int main(int argc, char **argv) {
    int port = 11311, crc = 0;
    long k = 1, corrupt = 0;
    int i = 1;
    for (; i < argc && strncmp(argv[i], "--", 2) == 0; i++) {
        if (strcmp(argv[i], "--crc") == 0) {
            crc = 1;
        } else if (i + 1 < argc && strcmp(argv[i], "--port") == 0) {
            port = atoi(argv[++i]);
        } else if (i + 1 < argc && strcmp(argv[i], "--pipeline") == 0) {
            k = atol(argv[++i]);
        } else if (i + 1 < argc && strcmp(argv[i], "--corrupt-crc") == 0) {
            corrupt = atol(argv[++i]);
        } else {
            return usage();
        }
    }
    if (i + 2 == argc && strcmp(argv[i], "crc") == 0) {
        printf("%08x\n", sei_client_crc32c(0, argv[i + 1], strlen(argv[i + 1])));
        return 0;
    }
    int is_check = i + 1 == argc && strcmp(argv[i], "check") == 0;
    int is_trace = i + 2 == argc && strcmp(argv[i], "trace") == 0;
    if ((!is_check && !is_trace) || k < 1 || port < 1 || port > 65535 || corrupt < 0) return usage();
    struct sei_client *c = sei_client_connect("127.0.0.1", port, crc);
    if (c == NULL) return 1;
    sei_client_test_corrupt(c, (unsigned long)corrupt);
    int status = is_check ? check(c, (size_t)k) : trace(c, argv[i + 1], (size_t)k);
    sei_client_close(c);
    return status;
}
