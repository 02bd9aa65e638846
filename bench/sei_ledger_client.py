#!/usr/bin/env python3
"""Deterministic, CRC-checking client of the ledger server (bench/sei_ledger_server.c),
the workload of the fault campaign bench/sei_ledger_eval.sh.

  sei_ledger_client.py --port P [--batches N] [--seed S] [--pipeline K]
                       [--corrupt-crc M] [--verify]

Sends N batches of 32 transfers between 4096 accounts, generated from the seed (default
200 batches, seed 1), K per pipeline (default 8); prints every reply line, then asks the
server for its state checksum ("C") and prints that reply. Stdout depends only on N, S
and a correct server, so a campaign compares it with a golden run's.

Every reply must end with "#crc YYYYYYYY\\r\\n" = CRC32C(R ‖ P), R the request it answers
as sent and P the reply (docs/sei.md, "Wire format and end-to-end CRCs"); a reply that
fails it ends the client with status 86 (detected). The notice "CLIENT_ERROR crc
mismatch" is the pipeline rule: reconnect and send again from the first request without
a reply; a request discarded 3 times is also a detection (86). Any other failure (the
server gone, an error line without a CRC) is status 1.

--corrupt-crc M flips one bit of the CRC of the Mth request frame sent (a test of the
resend); --verify replays the batches in a model of the ledger and exits 1 unless the
server's checksum equals the model's. stderr gets the number of discarded requests.
Standard library only.
"""
import argparse
import os
import random
import socket
import sys

DETECTED = 86
ACCOUNTS = 4096
TRANSFERS = 32
NOTICE = b"CLIENT_ERROR crc mismatch\r\n"
ATTEMPTS = 3
MASK = (1 << 64) - 1


# One CRC32C for every Python client: the example client's (docs/sei.md, "Wire format").
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sei", "examples"))
from kv_client import crc32c  # noqa: E402


class Detected(Exception):
    pass


class Client:
    def __init__(self, port, corrupt_nth=0):
        self.port = port
        self.corrupt_nth = corrupt_nth
        self.sent = 0
        self.discards = 0
        self.sock = None

    def _connect(self):
        self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def _need(self, n):
        while len(self.buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the server closed the connection")
            self.buf += chunk

    def _line(self):
        """The next line (with its \\r\\n), taken off the buffer."""
        while True:
            at = self.buf.find(b"\r\n")
            if at >= 0:
                line, self.buf = self.buf[:at + 2], self.buf[at + 2:]
                return line
            if len(self.buf) > 4096:
                raise Detected(b"a reply line without its end: " + self.buf[:40])
            self._need(len(self.buf) + 1)

    def _frame(self, req):
        self.sent += 1
        crc = crc32c(req) ^ (1 if self.sent == self.corrupt_nth else 0)
        return req + b"#crc %08x\r\n" % crc

    def _reply(self, req):
        """The reply to req, or None for the server's notice that it discarded it."""
        reply = self._line()
        if reply == NOTICE:
            return None
        self._need(15)
        line, self.buf = self.buf[:15], self.buf[15:]
        given = line[5:13]
        if not (line.startswith(b"#crc ") and line.endswith(b"\r\n")) or \
                not all(c in b"0123456789abcdefABCDEF" for c in given) or \
                int(given, 16) != crc32c(reply, crc32c(req)):
            raise Detected(b"reply " + reply[:60] + b" with CRC line " + line)
        return reply

    def pipeline(self, reqs):
        """Sends reqs as one pipeline and returns their replies in order. The server runs
        them in order or not at all: after a discarded request it runs nothing more on
        the connection, so the client sends again from the first request whose reply it
        did not get."""
        replies = [None] * len(reqs)
        start, restart, attempts = 0, None, 1
        while True:
            if self.sock is None:
                self._connect()
            try:
                self.sock.sendall(b"".join(self._frame(r) for r in reqs[start:]))
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server cut the pipeline: the replies say where
            discarded = False
            for i in range(start, len(reqs)):
                reply = self._reply(reqs[i])
                if reply is None:
                    discarded = True
                    break
                replies[i] = reply
                start = i + 1
            if not discarded:
                return replies
            self.discards += 1
            self.sock.close()
            self.sock = None
            if start == restart:
                attempts += 1
                if attempts >= ATTEMPTS:
                    raise Detected(b"request discarded %d times: " % ATTEMPTS + reqs[start][:40])
            else:
                restart, attempts = start, 1


def batches(n, seed):
    rng = random.Random(seed)
    for _ in range(n):
        yield b"".join(b"T %d %d %d\n" % (rng.randrange(ACCOUNTS), rng.randrange(ACCOUNTS), rng.randrange(300))
                       for _ in range(TRANSFERS)) + b"\n"


def model_checksum(reqs):
    """bench/sei_ledger.h's state after reqs, and its ledger_checksum."""
    balance = [1000] * ACCOUNTS
    audit = applied = refused = 0
    for req in reqs:
        for line in req.split(b"\n"):
            if not line.startswith(b"T"):
                break
            frm, to, amount = (int(w) for w in line[1:].split())
            frm, to = frm % ACCOUNTS, to % ACCOUNTS
            if balance[frm] >= amount:
                balance[frm] -= amount
                balance[to] += amount
                audit = ((audit ^ (frm << 32 ^ to << 12 ^ amount)) * 0x100000001b3) & MASK
                applied += 1
            else:
                refused += 1
    total = audit ^ (applied << 20 & MASK) ^ refused
    for b in balance:
        total = (total * 31 + (b & MASK)) & MASK
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--pipeline", type=int, default=8)
    ap.add_argument("--corrupt-crc", type=int, default=0)
    ap.add_argument("--verify", action="store_true")
    a = ap.parse_args()
    reqs = list(batches(a.batches, a.seed))
    client = Client(a.port, a.corrupt_crc)
    out = sys.stdout.buffer
    try:
        for at in range(0, len(reqs), a.pipeline):
            for reply in client.pipeline(reqs[at:at + a.pipeline]):
                out.write(reply.rstrip(b"\r\n") + b"\n")
        checksum = client.pipeline([b"C\n\n"])[0]
        out.write(checksum.rstrip(b"\r\n") + b"\n")
        out.flush()
    except Detected as e:
        out.flush()
        print("sei_ledger_client: rejected: %r" % e.args[0], file=sys.stderr)
        sys.exit(DETECTED)
    except (OSError, ValueError) as e:
        out.flush()
        print("sei_ledger_client: %s" % e, file=sys.stderr)
        sys.exit(1)
    print("sei_ledger_client: %d discarded" % client.discards, file=sys.stderr)
    if a.verify:
        want = b"CHECKSUM %016x\r\n" % model_checksum(reqs)
        if checksum != want:
            print("sei_ledger_client: checksum %r, the model's %r" % (checksum, want), file=sys.stderr)
            sys.exit(1)


if __name__ == "__main__":
    main()
