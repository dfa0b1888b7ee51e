"""The rehearsal's resolver (localswarm/dns.py): real clients get NXDOMAIN at once, for any name."""
from __future__ import annotations

import os
import struct
import subprocess
import sys

from localswarm import dns
from tests.tools import require_tool

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_busybox_nslookup_and_glibc_hear_nxdomain_at_once():
    # In a network namespace of its own, so the resolver can have port 53 on loopback, as on the bridge.
    require_tool("unshare")
    busybox = require_tool("busybox")
    script = f"""
import subprocess, sys, time
from localswarm import dns
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
dns.serve_in_background("127.0.0.1")
started = time.monotonic()
for _ in range(20):  # a burst, as swarm's pull and a stack deploy look names up
    out = subprocess.run([{busybox!r}, "nslookup", "gpu-swarm.invalid", "127.0.0.1"], capture_output=True, text=True)
print(out.stdout + out.stderr)
print("seconds", time.monotonic() - started)
"""
    proc = subprocess.run(["unshare", "--net", sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "can't find gpu-swarm.invalid: NXDOMAIN" in proc.stdout, proc.stdout
    assert float(proc.stdout.split("seconds")[-1]) < 5  # one resolver timeout alone is 5 s


def query(ident: int, name: bytes, flags: int = 0x0100, qtype: int = 28) -> bytes:
    labels = b"".join(bytes([len(p)]) + p for p in name.split(b".")) + b"\0"
    return struct.pack("!HHHHHH", ident, flags, 1, 0, 0, 0) + labels + struct.pack("!HH", qtype, 1)


def test_the_reply_carries_the_question_back_and_nothing_else():
    q = query(0xBEEF, b"registry-1.docker.io")
    reply = dns.answer(q + b"\0\0\x29\x10\0\0\0\0\0\0\0")  # an EDNS record after the question is not echoed
    ident, flags, qd, an, ns, ar = struct.unpack_from("!HHHHHH", reply)
    assert (ident, flags & 0x8000, flags & 0x0100, flags & 0xF, qd, an, ns, ar) == (0xBEEF, 0x8000, 0x0100, 3, 1, 0, 0, 0)
    assert reply[12:] == q[12:]


def test_responses_are_never_answered_and_garbage_gets_formerr():
    assert dns.answer(query(1, b"a.b", flags=0x8180)) is None
    assert dns.answer(b"\0\1") is None
    truncated = dns.answer(query(7, b"gpu-swarm.invalid")[:20])
    assert struct.unpack_from("!HHH", truncated)[0] == 7 and struct.unpack_from("!H", truncated, 2)[0] & 0xF == 1
