"""Where the other replicas are: a fixed list, or a headless Service's DNS records."""
from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass, field


def parse_peers(value: str) -> list[str]:
    """`host:port,host:port` -> ["host:port", ...] (each a replica's pick PUB port)."""
    out = []
    for item in (v.strip() for v in value.split(",")):
        if not item:
            continue
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"peer {item!r} is not host:port")
        out.append(item)
    return out


@dataclass(slots=True)
class DnsPeers:
    """`name:port` of a headless Service: one peer per A record, re-resolved."""

    name: str
    port: int
    addresses: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, value: str) -> "DnsPeers":
        host, _, port = value.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--peers-dns {value!r} is not name:port")
        return cls(host, int(port))

    async def resolve(self) -> list[str]:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(self.name, self.port, type=socket.SOCK_STREAM)
        except OSError:
            return self.addresses  # keep the last answer through a DNS hiccup
        self.addresses = sorted({f"{i[4][0]}:{self.port}" for i in infos})
        return self.addresses
