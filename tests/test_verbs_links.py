"""The sockets under simib's links: Unix sockets between HCAs of one machine, TCP otherwise, and who may use them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from verbs_util import connect_rc, exchange

from ckpt import verbs as v
from ckpt.verbs import _hca, _links

pytestmark = pytest.mark.timeout(60)

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")


def _family(sender: v.Context, receiver: v.Context) -> socket.AddressFamily:
    """The address family of the connection `sender`'s HCA opened to `receiver`'s (after they exchanged)."""
    return _hca.hca(sender.name)._conns[_hca.hca(receiver.name).endpoint].sock.family


def _name(endpoint: str) -> str:
    return "\0" + _links.LOCAL_PREFIX + endpoint


_fresh = iter(range(50, 100))


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[bool], v.Context]]:
    """fresh(same_host) -> a context of a new simib HCA, opened as with CKPT_SIMIB_UNIX=1 or 0; closed after."""
    opened: list[v.Context] = []

    def open_one(same_host: bool) -> v.Context:
        monkeypatch.setattr(_links, "LOCAL_IPC", same_host)
        while (name := f"simib{next(_fresh)}") in _hca._hcas:
            pass
        opened.append(v.Context(name=name))
        return opened[-1]

    yield open_one
    for ctx in reversed(opened):
        ctx.close()


def test_simib_hcas_on_one_machine_link_over_unix_sockets_tcp_over_tcp(
    ctxs: tuple[v.Context, ...], provider: str
) -> None:
    if provider == "simib" and not _links.LOCAL_IPC:
        pytest.skip("CKPT_SIMIB_UNIX=0: same-host links are off in this run")
    a, b = connect_rc(*ctxs)
    exchange(a, b, 5)
    want = socket.AF_UNIX if provider == "simib" else socket.AF_INET  # ib2tcp's provider is TCP by definition
    assert _family(*ctxs) == want and _family(ctxs[1], ctxs[0]) == want
    names = [s.getsockname() for s in _hca.hca(ctxs[1].name).listeners if s.family == socket.AF_UNIX]
    # named after its TCP endpoint: how its peers find it
    assert names == ([_name(_hca.hca(ctxs[1].name).endpoint).encode()] if provider == "simib" else [])


def test_a_peer_without_a_unix_listener_is_reached_over_tcp(fresh: Callable[[bool], v.Context]) -> None:
    without, with_ = fresh(False), fresh(True)  # as a process started with CKPT_SIMIB_UNIX=0, and one without
    assert [s.family for s in _hca.hca(without.name).listeners] == [socket.AF_INET]
    a, b = connect_rc(with_, without)
    exchange(a, b, 6)  # both ways: one found no Unix listener, the other never looks for one
    assert _family(with_, without) == socket.AF_INET and _family(without, with_) == socket.AF_INET
    c, d = connect_rc(with_, with_)  # loopback on the HCA that listens: over its Unix socket
    exchange(c, d, 7)
    assert _family(with_, with_) == socket.AF_UNIX


class Nobody:
    """body(report_fd) run in a forked child as user nobody; its return value (or error) is `result()`."""

    def __init__(self, body: Callable[[int], str]) -> None:
        read_fd, write_fd = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: only system calls and os._exit
            os.close(read_fd)
            try:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                result = body(write_fd)
            except BaseException as exc:
                result = f"error: {exc!r}"
            os.write(write_fd, f"{result}\n".encode())
            os._exit(0)
        os.close(write_fd)
        self.reader = os.fdopen(read_fd)

    def line(self) -> str:
        """The child's next report line ("ready" from a body that says so, or its result)."""
        return self.reader.readline().strip()

    def result(self) -> str:
        try:
            return self.line()
        finally:
            self.reader.close()
            os.waitpid(self.pid, 0)


@as_root
def test_another_users_process_holding_an_hcas_name_gets_no_data(fresh: Callable[[bool], v.Context]) -> None:
    target = fresh(False)  # its name is free: another user's process takes it
    name = _name(_hca.hca(target.name).endpoint)

    def squat(ready_fd: int) -> str:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(name)
        sock.listen()
        os.write(ready_fd, b"ready\n")
        sock.settimeout(10.0)
        conn, _ = sock.accept()  # the HCA connects, finds another user here and closes
        conn.settimeout(10.0)
        got = b""
        while chunk := conn.recv(65536):
            got += chunk
        return f"received {len(got)} bytes"

    squatter = Nobody(squat)
    assert squatter.line() == "ready"
    sender = fresh(True)
    a, b = connect_rc(sender, target)
    exchange(a, b, 8)  # over TCP: the squatter never gets a byte
    assert _family(sender, target) == socket.AF_INET
    assert squatter.result() == "received 0 bytes"


@as_root
def test_a_link_from_another_users_process_is_refused(fresh: Callable[[bool], v.Context]) -> None:
    target = fresh(True)
    name = _name(_hca.hca(target.name).endpoint)

    def intrude(_fd: int) -> str:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10.0)
        sock.connect(name)
        try:
            sock.sendall(b"\0" * 200)  # never executed: the HCA closes the connection first
            return "closed" if sock.recv(1) == b"" else "open"
        except (ConnectionResetError, BrokenPipeError):  # closed with those bytes unread
            return "closed"

    assert Nobody(intrude).result() == "closed"
    peer = fresh(True)
    a, b = connect_rc(peer, target)  # the HCA still serves its own user's processes
    exchange(a, b, 9)
    assert _family(peer, target) == socket.AF_UNIX


def test_a_unix_listener_that_never_accepts_is_passed_over_for_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_links, "CONNECT_TIMEOUT", 0.3)
    tcp = socket.create_server(("127.0.0.1", 0))
    endpoint = f"127.0.0.1:{tcp.getsockname()[1]}"
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stuck.bind(_name(endpoint))
    stuck.listen(0)
    queued = []
    try:
        while True:  # fill its backlog: a blocking connect would now wait for good
            extra = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            extra.setblocking(False)
            queued.append(extra)
            extra.connect(_name(endpoint))
    except BlockingIOError:
        pass
    started = time.monotonic()
    sock = _links.connect(endpoint, same_host=True)
    try:
        assert sock.family == socket.AF_INET
        assert time.monotonic() - started < 5.0
    finally:
        for s in (sock, stuck, tcp, *queued):
            s.close()


def test_same_host_links_can_be_turned_off_by_environment() -> None:
    code = "from ckpt.verbs import _links; print(_links.LOCAL_IPC)"
    for value, want in (("0", "False"), ("1", "True"), (None, "True")):
        env = {k: val for k, val in os.environ.items() if k != "CKPT_SIMIB_UNIX"}
        if value is not None:
            env["CKPT_SIMIB_UNIX"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == want, out.stderr
