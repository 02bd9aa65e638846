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
import sys

ACCOUNTS = 4096
TRANSFERS = 32
MASK = (1 << 64) - 1


# The example servers' client (docs/sei.md, "Wire format"): the ledger's server speaks
# the same wire, with one-line replies.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sei", "examples"))
import kv_client  # noqa: E402
from kv_client import DETECTED, Rejected  # noqa: E402


class Client(kv_client.Client):
    """The example client, always with CRC lines, for replies of one line each. Its
    pipeline() sends a pipeline and resends it from the first request the server
    discarded."""

    def __init__(self, port, corrupt_nth=0):
        super().__init__(port, True, corrupt_nth)

    def _reply_end(self, end):
        return end


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
    out = sys.stdout.buffer
    try:
        client = Client(a.port, a.corrupt_crc)
        for at in range(0, len(reqs), a.pipeline):
            for reply in client.pipeline(reqs[at:at + a.pipeline]):
                out.write(reply.rstrip(b"\r\n") + b"\n")
        checksum = client.pipeline([b"C\n\n"])[0]
        out.write(checksum.rstrip(b"\r\n") + b"\n")
        out.flush()
    except Rejected as e:
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
