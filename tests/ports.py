"""Loopback ports for the tests' own servers, chosen below the kernel's ephemeral range.

A port from ``bind(0)`` comes from the ephemeral range, where any process's outgoing connection or
listener (gloo pairs, ZMQ, the servers' own KV listeners) may take it before the server under test
binds it. Ports below that range are handed out only on request, so a checked one stays free."""

import random
import socket

_given: set[int] = set()


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback TCP port nothing listens on now, outside the ephemeral range, never given twice in
    this process."""
    high = _ephemeral_start()
    low = max(1024, min(10000, high - 2000))
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(low, high)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free loopback port in [{low}, {high})")
