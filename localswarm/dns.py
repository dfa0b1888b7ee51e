"""The rehearsal's resolver on the bridge: every name is NXDOMAIN, answered at once.

The machines have no way out, and the names they need are in their /etc/hosts. A resolver
that is not there was tried first: the bridge refused port 53 with ICMP port-unreachable. But
the kernel sends at most about six of those a second to one machine (net.ipv4.icmp_ratelimit),
so a node that looked names up in a burst waited out the resolver's 5 s timeout: swarm's pull of
the GPU check's local image (gpu-swarm.invalid, which swarm always tries) took 10-15 s per node,
and `docker stack deploy` waited 5 s to resolve a Docker Hub digest. In a VPC, the resolver
answers every lookup, as this one does.
"""
from __future__ import annotations

import socket
import struct
import threading

from localswarm.network import BRIDGE_ADDR

PORT = 53
_NXDOMAIN = 3
_FORMERR = 1


def answer(query: bytes) -> bytes | None:
    """The reply to one DNS query (RFC 1035): its question back, no answer, NXDOMAIN. None: not a query."""
    if len(query) < 12:
        return None
    ident, flags, qdcount = struct.unpack_from("!HHH", query)
    if flags & 0x8000:  # a response, not a query: never answer those (no loops)
        return None
    end = 12
    try:
        for _ in range(qdcount):
            while query[end]:
                if query[end] & 0xC0:  # a compression pointer has no place in a question
                    raise IndexError
                end += query[end] + 1
            end += 1 + 4  # the root label, QTYPE, QCLASS
        if end > len(query):
            raise IndexError
    except IndexError:
        return struct.pack("!HHHHHH", ident, 0x8000 | (flags & 0x7900) | 0x0080 | _FORMERR, 0, 0, 0, 0)
    # QR, the query's opcode and RD, RA (we "recurse": there is nothing to find), and the rcode.
    reply_flags = 0x8000 | (flags & 0x7900) | 0x0080 | _NXDOMAIN
    return struct.pack("!HHHHHH", ident, reply_flags, qdcount, 0, 0, 0) + query[12:end]


def serve_in_background(address: str = BRIDGE_ADDR, port: int = PORT) -> int:
    """Bind now (a bind error is the caller's), then answer in a daemon thread of this process; the port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((address, port))

    def loop() -> None:
        while True:
            query, client = sock.recvfrom(4096)
            reply = answer(query)
            if reply is not None:
                sock.sendto(reply, client)

    threading.Thread(target=loop, name="dns", daemon=True).start()
    return sock.getsockname()[1]
