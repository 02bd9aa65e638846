#!/usr/bin/env python3
"""Client of the example key-value servers that checks every reply's CRC32C.

  kv_client.py [OPTIONS] check          functional test of get/set/delete
  kv_client.py [OPTIONS] trace FILE     replay a request trace, print the replies
  kv_client.py gen-trace N [SEED]       print a deterministic trace of N requests
  kv_client.py crc STRING               print the CRC32C of STRING

OPTIONS: --port P (default 11311), --crc, --pipeline K (send K requests per pipeline,
default 1), --corrupt-crc N (flip one bit of the CRC of the Nth request frame sent: a
test of the resend).

With --crc every request carries a "#crc XXXXXXXX" line with the CRC32C of the request,
and every reply must carry one with the CRC32C of the request it answers followed by the
reply (docs/sei.md, "Wire format and end-to-end CRCs"). A reply whose CRC does not match
was corrupted after the server computed it, or answers another request than the one
sent, and is rejected. When the server discards a request as corrupt ("CLIENT_ERROR crc
mismatch"), it runs nothing after it on that connection and closes it; the client
reconnects and sends the pipeline again from the first request whose reply it did not
get. A rejection, or a request discarded 3 times, ends the client with exit status 86
(the lockstep contract for a detected error). sei/client/kv_cli.c is the same client in
C. Standard library only.
"""
import random
import select
import socket
import sys

DETECTED = 86


def _crc_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc_table()


def crc32c(data, crc=0):
    crc ^= 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


class Rejected(Exception):
    pass


NOTICE = b"CLIENT_ERROR crc mismatch\r\n"
ATTEMPTS = 3
# the longest reply line the servers write is a VALUE line with a 250-byte key
MAX_LINE = 4096


def wants_reply(req):
    return not req.split(b"\r\n", 1)[0].endswith(b" noreply")


class Client:
    def __init__(self, port, crc, corrupt_nth=0):
        self.port = port
        self.crc = crc
        self.corrupt_nth = corrupt_nth
        self.sent = 0
        self.discards = 0
        # noreply requests at the end of earlier pipelines that no reply has confirmed
        # yet: if the server discarded one, its notice arrives in a later pipeline,
        # which must send them again
        self.tail = []
        self._connect()

    def _connect(self):
        self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def _fill(self):
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self.buf += chunk

    def _line(self, start=0):
        """The end of the line that starts at buf[start:]."""
        while True:
            at = self.buf.find(b"\r\n", start)
            if at >= 0:
                return at + 2
            if len(self.buf) - start > MAX_LINE:
                self._malformed(b"a reply line without its end: " + self.buf[start:start + 40])
            self._fill()

    def _malformed(self, what):
        """A reply the protocol does not allow: with CRCs, a corrupted one."""
        raise Rejected(what) if self.crc else ConnectionError(what.decode(errors="replace"))

    def _need(self, n):
        while len(self.buf) < n:
            self._fill()

    def _send(self, data):
        # Takes in what the server answers while sending: a server blocked on a full
        # socket while the client blocks on another would never finish a long pipeline.
        # A short pipeline fits in the socket's buffer, since every earlier reply has
        # been read: it goes out in one call.
        if len(data) <= 65536:
            try:
                self.sock.sendall(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server cut the pipeline: the replies say where
            return
        view = memoryview(data)
        while view:
            readable, writable, _ = select.select([self.sock], [self.sock], [], 30)
            if not readable and not writable:
                raise ConnectionError("the server takes no requests for 30 s")
            if readable:
                chunk = self.sock.recv(65536)
                if not chunk:
                    return  # the server cut the pipeline: the replies say where
                self.buf += chunk
            if writable:
                try:
                    n = self.sock.send(view[:65536])
                except (BrokenPipeError, ConnectionResetError):
                    return
                view = view[n:]

    def _frame(self, req):
        self.sent += 1
        if not self.crc:
            return req
        crc = crc32c(req) ^ (1 if self.sent == self.corrupt_nth else 0)
        return req + b"#crc %08x\r\n" % crc

    def _reply_end(self, end):
        """The end of the reply whose first line ends at buf[end]: "VALUE key flags bytes"
        lines each carry a data block, and any other line ends the reply."""
        line = 0
        while self.buf.startswith(b"VALUE ", line):
            words = self.buf[line:end - 2].split(b" ")
            if len(words) != 4 or not words[3].isdigit():
                self._malformed(b"a malformed VALUE line: " + self.buf[line:end])
            size = int(words[3])
            self._need(end + size + 2)
            if self.buf[end + size:end + size + 2] != b"\r\n":
                self._malformed(b"a data block without its end: " + self.buf[line:end])
            line = end + size + 2
            end = self._line(line)
        return end

    def _reply(self, req):
        """The reply to req, or None for the server's notice that it discarded it."""
        end = self._line()
        if self.buf[:end] == NOTICE:
            self.buf = self.buf[end:]
            return None
        end = self._reply_end(end)
        reply, self.buf = self.buf[:end], self.buf[end:]
        if self.crc:
            self._need(15)
            line, self.buf = self.buf[:15], self.buf[15:]
            given = line[5:13]
            if not (line.startswith(b"#crc ") and line.endswith(b"\r\n")) or \
                    not all(c in b"0123456789abcdefABCDEF" for c in given) or \
                    int(given, 16) != crc32c(reply, crc32c(req)):
                raise Rejected(reply)
        return reply

    def pipeline(self, reqs):
        """Sends reqs (bytes, each with its data block) as one pipeline; returns their
        replies in order (b"" for noreply requests). The server runs them in order or
        not at all: when it discards a corrupt request it runs nothing after it, so the
        client sends again from the first request whose reply it did not get. A request
        discarded on every attempt ends the client as a detection."""
        all_ = self.tail + list(reqs)
        base = len(self.tail)
        replies = [b""] * len(reqs)
        start, restart, attempts = 0, None, 1
        while True:
            if self.sock is None:
                self._connect()
            self._send(b"".join(self._frame(r) for r in all_[start:]))
            discarded = False
            for i in range(start, len(all_)):
                if not wants_reply(all_[i]):
                    continue
                reply = self._reply(all_[i])
                if reply is None:
                    discarded = True
                    break
                replies[i - base] = reply
                start = i + 1
            if not discarded:
                break
            # The noreply requests between start and the discarded one may have run:
            # they are blind writes, so running them again right after changes nothing.
            self.discards += 1
            self.sock.close()
            self.sock = None
            if start == restart:
                attempts += 1
                if attempts >= ATTEMPTS:
                    raise Rejected(b"request discarded %d times: " % ATTEMPTS + all_[start][:40])
            else:
                restart, attempts = start, 1
        first = len(all_)
        while first > 0 and not wants_reply(all_[first - 1]):
            first -= 1
        self.tail = all_[first:]
        return replies

    def request(self, req):
        """Sends one request; returns its reply (b"" for noreply)."""
        return self.pipeline([req])[0]


def get(key):
    return b"get " + key.encode() + b"\r\n"


def set_(key, value, noreply=False, flags=0):
    return b"set %s %d 0 %d%s\r\n%s\r\n" % (key.encode(), flags, len(value), b" noreply" if noreply else b"", value)


def delete(key, noreply=False):
    return b"delete " + key.encode() + (b" noreply" if noreply else b"") + b"\r\n"


def run(client, reqs, k):
    """The replies to reqs, sent k at a time."""
    for at in range(0, len(reqs), k):
        yield from client.pipeline(reqs[at:at + k])


def check(client, k):
    expect = [
        (set_("a", b"hello", flags=7), b"STORED\r\n"),
        (get("a"), b"VALUE a 7 5\r\nhello\r\nEND\r\n"),
        (set_("b", b"x" * 1000), b"STORED\r\n"),
        (get("a b zz"), b"VALUE a 7 5\r\nhello\r\nVALUE b 0 1000\r\n" + b"x" * 1000 + b"\r\nEND\r\n"),
        (set_("a", b"again", noreply=True), b""),
        (get("a"), b"VALUE a 0 5\r\nagain\r\nEND\r\n"),
        (delete("a"), b"DELETED\r\n"),
        (delete("a"), b"NOT_FOUND\r\n"),
        (get("a"), b"END\r\n"),
        (b"bogus\r\n", b"ERROR\r\n"),
        (b"set k 0 0 notanumber\r\n", b"CLIENT_ERROR bad command line format\r\n"),
        (b"set k 0 0 3\r\nabcde", b"CLIENT_ERROR bad data chunk\r\n"),
        (set_("big", b"y" * 5000), b"SERVER_ERROR object too large for cache\r\n"),
        (get("b"), b"VALUE b 0 1000\r\n" + b"x" * 1000 + b"\r\nEND\r\n"),
    ]
    checks = len(expect)
    for i in range(300):
        expect.append((set_("k%d" % i, str(i).encode() * (1 + i % 50), noreply=i % 2 == 0),
                       b"" if i % 2 == 0 else b"STORED\r\n"))
    for i in range(300):
        want = str(i).encode() * (1 + i % 50)
        expect.append((get("k%d" % i), b"VALUE k%d 0 %d\r\n%s\r\nEND\r\n" % (i, len(want), want)))
    for (req, want), got in zip(expect, run(client, [req for req, _ in expect], k)):
        if got != want:
            print("unexpected reply to %r: %r (wanted %r)" % (req[:40], got[:80], want[:80]), file=sys.stderr)
            return 1
    print("ok: %d checks" % (checks + 600))
    return 0


def gen_trace(n, seed):
    rng = random.Random(seed)
    for _ in range(n):
        key = "key%d" % rng.randrange(64)
        op = rng.random()
        if op < 0.45:
            size = rng.choice([8, 64, 128, 512, 1024])
            print("set %s %s" % (key, "".join(rng.choice("abcdefghij") for _ in range(size))))
        elif op < 0.9:
            print("get %s" % key)
        else:
            print("delete %s" % key)


def trace(client, path, k):
    """Replays "set KEY VALUE [noreply]", "get KEY..." and "delete KEY [noreply]" lines."""
    reqs = []
    for line in open(path):
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "set":
            reqs.append(set_(parts[1], parts[2].encode(), noreply=parts[3:] == ["noreply"]))
        elif parts[0] == "get":
            reqs.append(get(" ".join(parts[1:])))
        else:
            reqs.append(delete(parts[1], noreply=parts[2:] == ["noreply"]))
    for reply in run(client, reqs, k):
        sys.stdout.write(reply.decode("latin-1"))
    sys.stdout.flush()
    return 0


def main(argv):
    port, crc, k, corrupt, rest = 11311, False, 1, 0, []
    it = iter(argv)
    for a in it:
        if a == "--port":
            port = int(next(it))
        elif a == "--crc":
            crc = True
        elif a == "--pipeline":
            k = int(next(it))
        elif a == "--corrupt-crc":
            corrupt = int(next(it))
        else:
            rest.append(a)
    if rest[:1] == ["gen-trace"] and len(rest) in (2, 3):
        gen_trace(int(rest[1]), int(rest[2]) if len(rest) == 3 else 1)
        return 0
    if rest[:1] == ["crc"] and len(rest) == 2:
        print("%08x" % crc32c(rest[1].encode()))
        return 0
    if rest[:1] not in (["check"], ["trace"]) or (rest[0] == "trace" and len(rest) != 2) or k < 1:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        client = Client(port, crc, corrupt)
        status = check(client, k) if rest[0] == "check" else trace(client, rest[1], k)
        if client.discards:
            print("kv_client: the server discarded %d pipelines; sent again from the discarded request"
                  % client.discards, file=sys.stderr)
        return status
    except Rejected as r:
        print("kv_client: rejected a reply whose CRC does not cover the request and the reply, or a "
              "request the server kept discarding: %r" % bytes(r.args[0])[:60], file=sys.stderr)
        return DETECTED
    except (ConnectionError, OSError) as e:
        print("kv_client: %s" % e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
