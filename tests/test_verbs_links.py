"""The sockets under simib's links: Unix sockets between HCAs of one machine, TCP otherwise, and who may use them."""

from __future__ import annotations

import itertools
import os
import select
import signal
import socket
import subprocess
import sys
import threading
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


_fresh = itertools.count(50)


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[bool], v.Context]]:
    """fresh(same_host) -> a context of a new simib HCA, opened as with CKPT_SIMIB_UNIX=1 or 0; the contexts
    are closed after (the HCA stays, as every HCA stays for the life of its process)."""
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


class Child:
    """body(report_fd) in a forked child holding none of this process's files, as user nobody if `nobody`.

    `line()` is its next report line (a body may write "ready"; its return value or error comes last).
    Used as a context manager: the child is killed, if it still runs, and reaped.
    """

    def __init__(self, body: Callable[[int], str], nobody: bool) -> None:
        read_fd, write_fd = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: only system calls and os._exit
            try:
                os.dup2(write_fd, 3)  # the report pipe as fd 3; every other inherited file closed
                os.closerange(4, os.sysconf("SC_OPEN_MAX"))
                if nobody:
                    os.setgroups([])
                    os.setgid(NOBODY)
                    os.setuid(NOBODY)
                result = body(3)
            except BaseException as exc:
                result = f"error: {exc!r}"
            os.write(3, f"{result}\n".encode())
            os._exit(0)
        os.close(write_fd)
        self.reader = os.fdopen(read_fd)

    def line(self, timeout: float = 20.0) -> str:
        ready, _, _ = select.select([self.reader], [], [], timeout)
        assert ready, f"the child said nothing for {timeout} s"
        return self.reader.readline().strip()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.reader.close()
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(self.pid, 0)


def _squat(name: str) -> Callable[[int], str]:
    """A body that takes the Unix name `name`, says "ready", and reports how many bytes one connection brought."""

    def squat(report: int) -> str:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(name)
        sock.listen()
        os.write(report, b"ready\n")
        sock.settimeout(15.0)
        conn, _ = sock.accept()  # the HCA connects, finds that this is not the HCA it wants, and closes
        conn.settimeout(15.0)
        got = b""
        while chunk := conn.recv(65536):
            got += chunk
        return f"received {len(got)} bytes"

    return squat


@pytest.mark.parametrize("user", ["same", pytest.param("nobody", marks=as_root)])
def test_a_process_holding_an_hcas_name_gets_no_data(fresh: Callable[[bool], v.Context], user: str) -> None:
    # another user's process, or one of this user's that is not the HCA (it does not hold the HCA's TCP
    # listener), took the name first: peers see who is there and go over TCP
    target = fresh(False)  # its name is free to take
    with Child(_squat(_name(_hca.hca(target.name).endpoint)), nobody=user == "nobody") as squatter:
        assert squatter.line() == "ready"
        sender = fresh(True)
        a, b = connect_rc(sender, target)
        exchange(a, b, 8)  # over TCP: the squatter never gets a byte
        assert _family(sender, target) == socket.AF_INET
        assert squatter.line() == "received 0 bytes"


@as_root
def test_a_link_from_another_users_process_is_refused(fresh: Callable[[bool], v.Context]) -> None:
    target = fresh(True)
    name = _name(_hca.hca(target.name).endpoint)

    def intrude(_report: int) -> str:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(15.0)
        sock.connect(name)
        return "closed" if sock.recv(1) == b"" else "open"  # it sends nothing: only a refusal ends this

    with Child(intrude, nobody=True) as intruder:
        assert intruder.line() == "closed"
    peer = fresh(True)
    a, b = connect_rc(peer, target)  # the HCA still serves its own user's processes
    exchange(a, b, 9)
    assert _family(peer, target) == socket.AF_UNIX


def test_a_unix_listener_with_a_full_backlog_is_passed_over_for_tcp() -> None:
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
    got: list[socket.socket] = []
    connecting = threading.Thread(target=lambda: got.append(_links.connect(endpoint, same_host=True)), daemon=True)
    connecting.start()
    connecting.join(10.0)
    try:
        assert got, "the connect to a listener with a full backlog did not return"
        assert got[0].family == socket.AF_INET
    finally:
        for sock in (*got, stuck, tcp, *queued):
            sock.close()


def test_the_holder_of_an_endpoint_is_found_among_a_process_files() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    endpoint = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        assert _links._holds_listener(os.getpid(), endpoint)
        with Child(lambda _report: "holding nothing", nobody=False) as child:  # it closed its copies
            assert child.line() == "holding nothing"
            assert not _links._holds_listener(child.pid, endpoint)
        assert not _links._holds_listener(os.getpid(), "127.0.0.1:1")  # nobody listens there
        assert not _links._holds_listener(os.getpid(), "localhost:80")  # not numeric: never trusted
    finally:
        listener.close()
    v6 = socket.create_server(("::1", 0), family=socket.AF_INET6) if socket.has_ipv6 else None
    if v6 is not None:
        try:
            assert _links._holds_listener(os.getpid(), f"::1:{v6.getsockname()[1]}")
        finally:
            v6.close()


def test_same_host_links_can_be_turned_off_by_environment() -> None:
    code = "from ckpt.verbs import _links; print(_links.LOCAL_IPC)"
    for value, want in (("0", "False"), ("1", "True"), (None, "True")):
        env = {k: val for k, val in os.environ.items() if k != "CKPT_SIMIB_UNIX"}
        if value is not None:
            env["CKPT_SIMIB_UNIX"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == want, out.stderr
