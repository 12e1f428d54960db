"""The sockets under an HCA's links: a TCP endpoint, and for simib a same-host Unix socket beside it."""

# Every HCA listens on a TCP endpoint ("host:port", registered with its
# directory).  A simib HCA also listens on an abstract Unix stream socket named
# after that endpoint, and a simib HCA on the same machine reaches it there:
# loopback TCP is the dearer pipe (a raw 8-byte round trip about twice as long
# on the machine of docs/benchmarks.md), and MPI libraries use shared memory
# within a node for the same reason.  An HCA that finds nothing at the name --
# another machine, another network namespace, a peer started with
# CKPT_SIMIB_UNIX=0 -- uses TCP.
#
# Abstract names belong to nobody: any process of the namespace may bind one,
# even one named after another HCA's endpoint (taken before that HCA binds it).
# So both ends check who is at the other end (SO_PEERCRED): a Unix link joins
# processes of the same user only.  A connector that finds another user's
# process at the name closes that socket and uses TCP; a listener closes a
# connection from another user.  That makes the Unix side narrower than the TCP
# endpoint, which any local process may reach (an InfiniBand link carries no
# token either: a packet is executed only if its QP number, PSN and keys are
# right).

from __future__ import annotations

import logging
import os
import socket
import struct

log = logging.getLogger(__name__)

#: CKPT_SIMIB_UNIX=0: simib HCAs on one machine talk over loopback TCP, not Unix sockets (for comparison).
LOCAL_IPC = os.environ.get("CKPT_SIMIB_UNIX", "1") != "0"
#: The abstract Unix socket name of the simib HCA whose TCP endpoint is "host:port" (after the NUL byte).
LOCAL_PREFIX = "ckpt-simib/"
#: Seconds a connect may take (a Unix listener whose backlog is full would otherwise block it for good).
CONNECT_TIMEOUT = 5.0

_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def listen(host: str, same_host: bool) -> tuple[socket.socket, socket.socket | None, str]:
    """(the TCP listener, the Unix one or None, the endpoint "host:port") of a new HCA.

    `same_host`: the HCA links over Unix sockets where it can (simib's own HCAs, unless LOCAL_IPC is off).
    """
    tcp = socket.create_server((host, 0))
    endpoint = f"{host}:{tcp.getsockname()[1]}"
    return tcp, (_listen_local(endpoint) if same_host else None), endpoint


def _listen_local(endpoint: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + LOCAL_PREFIX + endpoint)
        sock.listen()
    except OSError as exc:  # EADDRINUSE: some other process holds the name (peers then check who: `_same_user`)
        log.warning("HCA at %s: no same-host link (%s); peers reach it over TCP", endpoint, exc)
        sock.close()
        return None
    return sock


def connect(endpoint: str, same_host: bool) -> socket.socket:
    """A connected socket to the HCA at `endpoint`: its Unix socket if `same_host` and it is here, else TCP.

    OSError if it cannot be reached at all.
    """
    if same_host:
        sock = _connect_local(endpoint)
        if sock is not None:
            return sock
    host, _, port = endpoint.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _connect_local(endpoint: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(CONNECT_TIMEOUT)
    try:
        sock.connect("\0" + LOCAL_PREFIX + endpoint)
    except OSError:  # nothing listens there (another machine, an HCA without one), or it never accepted
        sock.close()
        return None
    if not _same_user(sock):
        log.warning("the Unix socket named after HCA endpoint %s is held by another user: using TCP", endpoint)
        sock.close()
        return None
    sock.settimeout(None)
    return sock


def accepted(sock: socket.socket) -> bool:
    """Ready a socket a listener accepted; False (and closed) if it is another user's Unix connection."""
    if sock.family == socket.AF_UNIX:
        if _same_user(sock):
            return True
        log.warning("refused a same-host link from another user's process")
        sock.close()
        return False
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return True


def _same_user(sock: socket.socket) -> bool:
    _pid, uid, _gid = _CREDENTIALS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size))
    return bool(uid == os.geteuid())
