"""A real DNS server on loopback (dnslib, UDP) whose zone tests change while it runs."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from dnslib import AAAA, QTYPE, RCODE, RR, SRV, A, DNSRecord
from dnslib.server import BaseResolver, DNSLogger, DNSServer


@dataclass
class Zone(BaseResolver):  # type: ignore[misc]
    """Names (lower case, no final dot) → IPv4/IPv6 addresses or SRV (target, port) records."""

    addresses: dict[str, list[str]] = field(default_factory=dict)
    srv: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    failing: bool = False
    queries: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def resolve(self, request: DNSRecord, handler: Any) -> DNSRecord:
        reply = request.reply()
        name = str(request.q.qname).rstrip(".").lower()
        kind = QTYPE[request.q.qtype]
        with self.lock:
            self.queries.append(f"{kind} {name}")
            if self.failing:
                reply.header.rcode = RCODE.SERVFAIL
                return reply
            if kind == "SRV" and name in self.srv:
                for target, port in self.srv[name]:
                    reply.add_answer(RR(request.q.qname, QTYPE.SRV, rdata=SRV(0, 0, port, target), ttl=1))
            elif kind in ("A", "AAAA") and name in self.addresses:
                for ip in self.addresses[name]:
                    if (":" in ip) == (kind == "AAAA"):
                        rdata = AAAA(ip) if kind == "AAAA" else A(ip)
                        reply.add_answer(RR(request.q.qname, QTYPE.reverse[kind], rdata=rdata, ttl=1))
            elif name not in self.addresses and name not in self.srv:
                reply.header.rcode = RCODE.NXDOMAIN
        return reply

    def set_addresses(self, name: str, ips: list[str]) -> None:
        with self.lock:
            self.addresses[name] = list(ips)


@contextmanager
def dns_server(zone: Zone) -> Iterator[str]:
    """Serve ``zone`` on 127.0.0.1 (ephemeral UDP port); yields ``HOST:PORT``."""
    server = DNSServer(zone, address="127.0.0.1", port=0, logger=DNSLogger(logf=lambda _s: None))
    server.start_thread()
    try:
        yield f"127.0.0.1:{server.server.server_address[1]}"
    finally:
        server.stop()
        server.server.server_close()
