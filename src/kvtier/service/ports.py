"""Ports for servers kvtier starts: the benchmarks' servers, and Serve's proxy when the router takes the
service port itself (`server.ingress: direct`)."""

from __future__ import annotations


# The servers' ports come from below the kernel's ephemeral range (ip_local_port_range, 32768-60999 by
# default) and above Ray's worker ports (10002-19999): an OS-chosen free port is ephemeral, and while a
# local Ray starts its processes bind ephemeral ports of their own, so one could take it before Serve's
# proxy binds it (seen: "Failed to bind to address '127.0.0.1:42341'"). Ray's fixed ports (GCS 6379,
# dashboard 8265, client 10001, agents 52365-52367) are outside this range too.
PORT_RANGE = range(21000, 30000)


def free_port(host: str = "127.0.0.1") -> int:
    import random
    import socket

    tries = min(200, len(PORT_RANGE))
    for port in random.sample(PORT_RANGE, tries):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {PORT_RANGE.start}-{PORT_RANGE.stop - 1} after {tries} tries")


