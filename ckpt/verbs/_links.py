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
# even one named after another HCA's endpoint (taken before that HCA binds it),
# and would then receive what its peers send.  So a connector checks who is at
# the other end (SO_PEERCRED): a process of its own user that holds the TCP
# listener of that very endpoint (its socket among the process's open files,
# /proc), which only the HCA that registered the endpoint -- or a child that
# inherited its sockets -- can.  Anything else: it closes that socket and uses
# TCP.  A listener closes a connection from another user too, for symmetry, not
# for protection: the TCP endpoint stays open to every process of the
# namespace, like any loopback port (an InfiniBand link carries no token
# either: a packet is executed only if its QP number, PSN and keys are right).

from __future__ import annotations

import logging
import os
import socket
import struct
import sys

log = logging.getLogger(__name__)

#: CKPT_SIMIB_UNIX=0: simib HCAs on one machine talk over loopback TCP, not Unix sockets (for comparison).
LOCAL_IPC = os.environ.get("CKPT_SIMIB_UNIX", "1") != "0"
#: The abstract Unix socket name of the simib HCA whose TCP endpoint is "host:port" (after the NUL byte).
LOCAL_PREFIX = "ckpt-simib/"
#: Seconds a TCP connect may take.  (A Unix connect never waits: with a timeout set, a listener whose
#: backlog is full answers EAGAIN at once, and the link goes over TCP; without one it would block for good.)
CONNECT_TIMEOUT = 5.0

_CREDENTIALS = struct.Struct("iII")  # struct ucred: pid, uid, gid
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column


def listen(host: str, same_host: bool) -> tuple[list[socket.socket], str]:
    """(the listeners, the endpoint "host:port") of a new HCA: its TCP one, and its Unix one if it has one.

    `same_host`: the HCA links over Unix sockets where it can (simib's own HCAs, unless LOCAL_IPC is off).
    """
    tcp = socket.create_server((host, 0))
    endpoint = f"{host}:{tcp.getsockname()[1]}"
    local = _listen_local(endpoint) if same_host else None
    return ([tcp] if local is None else [tcp, local]), endpoint


def _listen_local(endpoint: str) -> socket.socket | None:
    sock = None
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind("\0" + LOCAL_PREFIX + endpoint)
        sock.listen()
    except OSError as exc:  # EADDRINUSE: some other process holds the name (peers see it is not this HCA)
        log.warning("HCA at %s: no same-host link (%s); peers reach it over TCP", endpoint, exc)
        if sock is not None:
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
    pid, uid = _peer(sock)
    if uid != os.geteuid() or not _holds_listener(pid, endpoint):
        log.warning("the Unix socket named after HCA %s is held by process %d, not that HCA: using TCP", endpoint, pid)
        sock.close()
        return None
    sock.settimeout(None)
    return sock


_refused = 0  # connections from other users a listener closed (the first is logged as a warning)


def accepted(sock: socket.socket) -> bool:
    """Ready a socket a listener accepted; False (and closed) if it is another user's Unix connection."""
    global _refused
    if sock.family == socket.AF_UNIX:
        pid, uid = _peer(sock)
        if uid == os.geteuid():
            return True
        _refused += 1
        (log.warning if _refused == 1 else log.debug)("refused a same-host link from pid %d (uid %d)", pid, uid)
        sock.close()
        return False
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return True


def local_peer(sock: socket.socket) -> int | None:
    """The pid at the other end of a same-host (Unix) link; None for a TCP one."""
    return _peer(sock)[0] if sock.family == socket.AF_UNIX else None


def _peer(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket (as it was when it connected or listened)."""
    pid, uid, _gid = _CREDENTIALS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size))
    return int(pid), int(uid)


def _holds_listener(pid: int, endpoint: str) -> bool:
    """Whether process `pid` has the listening TCP socket of `endpoint` ("address:port") among its open files."""
    inode = _listener_inode(endpoint)
    return inode is not None and open_file(pid, f"socket:[{inode}]") is not None


def open_file(pid: int, target: str) -> str | None:
    """The /proc path of a descriptor of process `pid` that links to `target`; None if it has none (or we may
    not look)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if os.readlink(path) == target:
                return path
        except OSError:  # closed meanwhile
            continue
    return None


def _listener_inode(endpoint: str) -> int | None:
    """The inode of the socket listening on TCP `endpoint` in this network namespace (None: none, or not numeric)."""
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    for family, table in ((socket.AF_INET, "/proc/net/tcp"), (socket.AF_INET6, "/proc/net/tcp6")):
        try:
            packed = socket.inet_pton(family, host)
        except OSError:
            continue
        # the kernel prints each 32-bit word of the address as a number in host byte order, then the port
        words = "".join(f"{int.from_bytes(packed[i : i + 4], sys.byteorder):08X}" for i in range(0, len(packed), 4))
        local = f"{words}:{int(port):04X}"
        try:
            with open(table) as rows:
                next(rows, None)  # the heading
                for row in rows:
                    fields = row.split()
                    if len(fields) > 9 and fields[1] == local and fields[3] == _LISTEN:
                        return int(fields[9])
        except (OSError, ValueError):
            return None
    return None
