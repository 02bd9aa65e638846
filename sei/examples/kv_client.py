#!/usr/bin/env python3
"""Client of the example key-value servers that checks every reply's CRC32C.

  kv_client.py [--port P] [--crc] check          functional test of get/set/delete
  kv_client.py [--port P] [--crc] trace FILE     replay a request trace, print the replies
  kv_client.py gen-trace N [SEED]                 print a deterministic trace of N requests

With --crc every request carries a "#crc XXXXXXXX" line and every reply must carry one
that matches it: a reply whose CRC does not match was corrupted after the server
computed it (the "last mile"), and is rejected. A request the server discards as corrupt
("CLIENT_ERROR crc mismatch") is sent again, up to 3 times. A rejection, or a request
discarded 3 times, ends the client with exit status 86 (the lockstep contract for a
detected error). Standard library only.
"""
import random
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


class Client:
    def __init__(self, port, crc):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.crc = crc
        self.buf = b""

    def _line(self):
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the server closed the connection")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line + b"\r\n"

    def _exact(self, n):
        while len(self.buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the server closed the connection")
            self.buf += chunk
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def request(self, req, attempts=3):
        """Sends one request (bytes, with its data block); returns the reply bytes, or
        b"" for noreply requests. A request the server discarded because its CRC did not
        match (an omission, which SEI allows) is sent again; one discarded on every
        attempt ends the client as a detection."""
        for _ in range(attempts):
            reply = self._attempt(req)
            if reply != b"CLIENT_ERROR crc mismatch\r\n":
                return reply
        raise Rejected(b"request discarded %d times: " % attempts + req[:40])

    def _attempt(self, req):
        frame = req + (b"#crc %08x\r\n" % crc32c(req) if self.crc else b"")
        self.sock.sendall(frame)
        if req.split(b"\r\n", 1)[0].endswith(b" noreply"):
            return b""
        reply = last = self._line()
        while last.startswith(b"VALUE "):
            size = int(last[:-2].split(b" ")[3])
            reply += self._exact(size + 2)
            last = self._line()
            reply += last
        if self.crc and reply != b"CLIENT_ERROR crc mismatch\r\n":
            line = self._line()
            if not line.startswith(b"#crc ") or int(line[5:13], 16) != crc32c(reply):
                raise Rejected(reply)
        return reply


def get(key):
    return b"get " + key.encode() + b"\r\n"


def set_(key, value, noreply=False, flags=0):
    return b"set %s %d 0 %d%s\r\n%s\r\n" % (key.encode(), flags, len(value), b" noreply" if noreply else b"", value)


def delete(key, noreply=False):
    return b"delete " + key.encode() + (b" noreply" if noreply else b"") + b"\r\n"


def check(client):
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
    for req, want in expect:
        got = client.request(req)
        if got != want:
            print("unexpected reply to %r: %r (wanted %r)" % (req[:40], got[:80], want[:80]), file=sys.stderr)
            return 1
    for i in range(300):
        client.request(set_("k%d" % i, str(i).encode() * (1 + i % 50), noreply=i % 2 == 0))
    for i in range(300):
        want = str(i).encode() * (1 + i % 50)
        got = client.request(get("k%d" % i))
        if got != b"VALUE k%d 0 %d\r\n%s\r\nEND\r\n" % (i, len(want), want):
            print("k%d: %r" % (i, got[:80]), file=sys.stderr)
            return 1
    print("ok: %d checks" % (len(expect) + 600))
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


def trace(client, path):
    for line in open(path):
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "set":
            req = set_(parts[1], parts[2].encode())
        elif parts[0] == "get":
            req = get(" ".join(parts[1:]))
        else:
            req = delete(parts[1])
        sys.stdout.write(client.request(req).decode("latin-1"))
    return 0


def main(argv):
    port, crc, rest = 11311, False, []
    it = iter(argv)
    for a in it:
        if a == "--port":
            port = int(next(it))
        elif a == "--crc":
            crc = True
        else:
            rest.append(a)
    if rest[:1] == ["gen-trace"] and len(rest) in (2, 3):
        gen_trace(int(rest[1]), int(rest[2]) if len(rest) == 3 else 1)
        return 0
    if rest[:1] not in (["check"], ["trace"]) or (rest[0] == "trace" and len(rest) != 2):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        client = Client(port, crc)
        return check(client) if rest[0] == "check" else trace(client, rest[1])
    except Rejected as r:
        print("kv_client: rejected a reply whose CRC does not match, or a request the server kept "
              "discarding: %r" % bytes(r.args[0])[:60], file=sys.stderr)
        return DETECTED
    except (ConnectionError, OSError) as e:
        print("kv_client: %s" % e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
