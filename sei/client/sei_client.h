/* A client of the example key-value servers (sei/examples) that carries the protection
 * of a libsei-hardened server to the caller: every request leaves with the CRC32C the
 * client computed, every reply must carry a CRC32C over the request it answers followed
 * by the reply, and a pipeline that the server cut at a corrupt request is sent again
 * from that request on. The wire format is specified in docs/sei.md, "Wire format and
 * end-to-end CRCs". C11 and libc only; one client per thread.
 *
 *     struct sei_client *c = sei_client_connect("127.0.0.1", 11311, 1);
 *     struct sei_request reqs[2] = {{"set a 0 0 2\r\nhi\r\n", 17}, {"get a\r\n", 7}};
 *     struct sei_reply replies[2];
 *     int status = sei_client_pipeline(c, reqs, 2, replies);
 *     if (status == SEI_CLIENT_DETECTED) exit(86);   // the lockstep contract
 *     ... replies[i].buf, replies[i].len; free(replies[i].buf) ...
 *     sei_client_close(c);
 */
#ifndef SEI_CLIENT_H
#define SEI_CLIENT_H

#include <stddef.h>
#include <stdint.h>

/* How many times one request may be sent: the third discard of the same request is a
 * detection, not bad luck on the wire. */
#define SEI_CLIENT_ATTEMPTS 3

enum sei_client_status {
    SEI_CLIENT_OK = 0,
    /* the connection failed, timed out or was closed, or the server sent an error that
     * ends the connection: nothing was detected, but what ran is unknown */
    SEI_CLIENT_FAILED = 1,
    /* an error was detected: a reply whose CRC does not cover the request and the reply,
     * or a request discarded SEI_CLIENT_ATTEMPTS times. The caller exits with this
     * status (86), so that a crash-tolerant system sees a crash, not a wrong answer. */
    SEI_CLIENT_DETECTED = 86,
};

/* One request: its bytes exactly as the protocol frames them (for set, the command
 * line and the data block), without the "#crc" line, which the client adds. */
struct sei_request {
    const char *buf;
    size_t len;
};

/* One reply, without its "#crc" line; buf is malloc'd (the caller frees it) and is
 * NULL with len 0 for a request that asked for no reply ("noreply"). */
struct sei_reply {
    char *buf;
    size_t len;
};

/* Connects to host (a dotted IPv4 address) and port. crc_mode: 1 for servers started
 * with --crc; 0 speaks plain memcached, where nothing is checked. NULL on failure, with
 * the reason on stderr. */
struct sei_client *sei_client_connect(const char *host, int port, int crc_mode);

/* Sends reqs[0..n) as one pipeline and fills replies[0..n) in order. The server runs
 * them in order or not at all: when it discards a request whose CRC does not match, it
 * runs nothing after it on that connection, so the client reconnects and sends again
 * from the first request whose reply it did not get. Returns an enum sei_client_status;
 * on anything but SEI_CLIENT_OK the replies are freed and zeroed, and
 * sei_client_error() says why. */
int sei_client_pipeline(struct sei_client *c, const struct sei_request *reqs, size_t n,
                        struct sei_reply *replies);

/* The reason for the last status other than SEI_CLIENT_OK ("" if none). */
const char *sei_client_error(const struct sei_client *c);

/* How many times the server discarded a pipeline of this client (each cost a resend). */
unsigned long sei_client_discards(const struct sei_client *c);

/* Closes the connection and frees the client. */
void sei_client_close(struct sei_client *c);

/* CRC32C (Castagnoli, reflected 0x82F63B78, init and final XOR 0xFFFFFFFF), continuable:
 * sei_client_crc32c(sei_client_crc32c(0, a, n), b, m) is the CRC of a followed by b.
 * The same function as libsei's sei_crc32c. */
uint32_t sei_client_crc32c(uint32_t crc, const void *buf, size_t len);

/* Test hook: the nth request frame this client sends (counting from 1, resends
 * included) carries a CRC with one bit flipped, as corruption on the way would leave
 * it. 0 turns the hook off. */
void sei_client_test_corrupt(struct sei_client *c, unsigned long nth);

#endif
