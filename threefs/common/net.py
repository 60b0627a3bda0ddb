"""Picking ports for services that are started later (local clusters, test etcd, test process groups).

A port the kernel hands out for `bind(port 0)` comes from the ephemeral range, the same range it draws from
for every outgoing connection; between picking such a port and the service binding it, another process's
connect() can take it (CI saw a service die with "Address already in use" this way). So ports are picked
*below* the ephemeral range, where the kernel never assigns one by itself, and checked free by binding.
"""

from __future__ import annotations

import random
import socket

_LOW = 10000  # clear of the well-known and the usual fixed service ports
_given: set[int] = set()  # handed out by this process (not bound yet, so a bind test cannot see them)
_random = random.SystemRandom()


def ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on now and that outgoing connections will not take."""
    low, high = ephemeral_range()
    candidates = (_LOW, low - 1) if low - 1 - _LOW >= 1000 else (high + 1, 65535)
    for _ in range(200):
        port = _random.randint(*candidates)
        if port in _given:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _given.add(port)
        return port
    with socket.socket() as sock:  # a crowded host: let the kernel pick (the old way, racy but works)
        sock.bind((host, 0))
        return sock.getsockname()[1]
