"""`free_port`: a TCP port for a job's rendezvous (``MASTER_PORT``, ``--master_port``)."""

import socket


def free_port() -> int:
    """A TCP port on this host that was free a moment ago (bound to port 0, the OS chose it; a
    race with another process remains, as with every such helper)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
