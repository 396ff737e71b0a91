"""Which network interface holds an address: transports that bind per interface rather than per address (UCX,
gloo) are pinned to the interface of the host a flag configured, so they listen nowhere wider (Linux)."""
from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

_SIOCGIFADDR = 0x8915


def free_port() -> int:
    """A TCP port free on loopback now (the OS's pick), for a rendezvous this process is about to start."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_wildcard(host: str) -> bool:
    """0.0.0.0 / :: (every interface): the user asked for it explicitly."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def resolve(host: str) -> str:
    """An IP address for a host name or address (the first the resolver gives)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0]


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address on it
            return None
    return socket.inet_ntoa(raw[20:24])


def _ipv6_addresses() -> list[tuple[str, str]]:
    try:
        with open("/proc/net/if_inet6") as f:
            rows = [line.split() for line in f]
    except OSError:
        return []
    return [(str(ipaddress.IPv6Address(bytes.fromhex(r[0]))), r[5]) for r in rows if len(r) >= 6]


def interface_of(host: str) -> str | None:
    """The name of the interface that holds `host`'s address (lo for 127.x), None if no local one does."""
    addr = ipaddress.ip_address(resolve(host))
    if addr.version == 6 and addr.ipv4_mapped:
        addr = addr.ipv4_mapped
    if addr.version == 4:
        for _, name in socket.if_nameindex():
            if _ipv4_of(name) == str(addr) or (addr.is_loopback and _ipv4_of(name) == "127.0.0.1"):
                return name
        return None
    return next((name for a, name in _ipv6_addresses() if ipaddress.ip_address(a) == addr), None)


def rdma_devices() -> list[str]:
    """UCX names (device:port) of the RDMA ports here: kept when TCP is pinned to one interface."""
    root = "/sys/class/infiniband"
    try:
        return [f"{d}:{p}" for d in sorted(os.listdir(root)) for p in sorted(os.listdir(f"{root}/{d}/ports"))]
    except OSError:
        return []
