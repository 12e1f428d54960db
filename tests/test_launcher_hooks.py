"""The launcher-side hooks: what --transport accepts, job services around a job, commands plugins add."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
import pytest

from ckpt import _cli_plugins, _launcher
from ckpt import _jobdir as jobdir
from ckpt._errors import CkptError, CoordinatorError, PluginError
from ckpt.plugin import JobInfo, Transport, hookimpl
from ckpt.runtime.plugins import PluginHost

Log = list[str]


class _Plugin:
    """A plugin object: transports to declare, and job hooks that log (and may fail or return env)."""

    def __init__(self, log: Log, name: str, *transports: Transport, env: Any = None, fail: Exception | None = None):
        self.log, self.name, self.transports, self.env, self.fail = log, name, list(transports), env, fail

    @hookimpl
    def ckpt_transports(self) -> list[Transport]:
        return self.transports

    @hookimpl
    def ckpt_job_start(self, job: JobInfo) -> Any:
        self.log.append(f"start {self.name}")
        if self.fail is not None:
            raise self.fail
        return self.env

    @hookimpl
    def ckpt_job_stop(self, job: JobInfo) -> None:
        self.log.append(f"stop {self.name}")


def _host(*plugins: object) -> PluginHost:
    host = PluginHost()
    for number, plugin in enumerate(plugins):
        host.register(plugin, name=getattr(plugin, "name", f"p{number}"))
    return host


@pytest.fixture
def hosts(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[tuple[str, ...], PluginHost]]:
    """launcher_host() answers from this table, keyed by the --disable-plugin names."""
    table: dict[tuple[str, ...], PluginHost] = {}

    def launcher_host(with_plugins: tuple[str, ...] = (), disabled: tuple[str, ...] = ()) -> PluginHost:
        return table[disabled]

    monkeypatch.setattr(_cli_plugins, "launcher_host", launcher_host)
    monkeypatch.setattr(_launcher, "launcher_host", launcher_host)
    yield table


SIMIB = Transport("simib", default=True, native=True)
TCP = Transport("tcp")


# ------------------------------------------------------------------ transports
def test_the_default_transport_and_a_named_one(hosts: dict[tuple[str, ...], PluginHost]) -> None:
    log: Log = []
    hosts[()] = _host(_Plugin(log, "sim", SIMIB), _Plugin(log, "ip", TCP))
    assert _cli_plugins.resolve_transport((), (), None, native=False) == "simib"
    assert _cli_plugins.resolve_transport((), (), "tcp", native=False) == "tcp"
    assert _cli_plugins.resolve_transport((), (), None, native=True) == "simib"


def test_an_unknown_transport_is_one_line_listing_the_installed_ones(
    hosts: dict[tuple[str, ...], PluginHost],
) -> None:
    hosts[()] = _host(_Plugin([], "sim", SIMIB), _Plugin([], "ip", TCP))
    with pytest.raises(CkptError, match=r"^unknown transport 'pigeon' \(installed: simib, tcp\)$"):
        _cli_plugins.resolve_transport((), (), "pigeon", native=False)


def test_native_allows_only_native_transports(hosts: dict[tuple[str, ...], PluginHost]) -> None:
    hosts[()] = _host(_Plugin([], "sim", SIMIB), _Plugin([], "ip", TCP))
    with pytest.raises(CkptError, match=r"--transport tcp is provided by the ip plugin, and --native"):
        _cli_plugins.resolve_transport((), (), "tcp", native=True)


def test_a_disabled_plugins_transport_is_not_offered_and_the_line_says_why(
    hosts: dict[tuple[str, ...], PluginHost],
) -> None:
    hosts[()] = _host(_Plugin([], "sim", SIMIB), _Plugin([], "ip", TCP))
    hosts[("ip",)] = _host(_Plugin([], "sim", SIMIB))
    assert set(_cli_plugins.offered_transports(hosts[("ip",)])) == {"simib"}
    with pytest.raises(CkptError, match=r"provided by the ip plugin, which --disable-plugin turns off"):
        _cli_plugins.resolve_transport((), ("ip",), "tcp", native=False)
    hosts[("other",)] = _host(_Plugin([], "sim", SIMIB))
    with pytest.raises(CkptError, match=r"^unknown transport 'tcp' \(installed: simib\)$"):
        _cli_plugins.resolve_transport((), ("other",), "tcp", native=False)


def test_no_default_or_two_defaults(hosts: dict[tuple[str, ...], PluginHost]) -> None:
    hosts[()] = _host(_Plugin([], "ip", TCP))
    with pytest.raises(CkptError, match=r"no installed transport is the default \(installed: tcp\)"):
        _cli_plugins.resolve_transport((), (), None, native=False)
    assert _cli_plugins.resolve_transport((), (), "tcp", native=False) == "tcp"
    hosts[()] = _host(_Plugin([], "a", SIMIB), _Plugin([], "b", Transport("other", default=True)))
    with pytest.raises(CkptError, match=r"transports other, simib each say they are the default"):
        _cli_plugins.resolve_transport((), (), None, native=False)


def test_bad_declarations_name_the_plugin() -> None:
    with pytest.raises(PluginError, match=r"transport 'simib' is declared by two plugins, 'a' and 'b'"):
        _cli_plugins.offered_transports(_host(_Plugin([], "a", SIMIB), _Plugin([], "b", SIMIB)))
    word: Any = "simib"
    with pytest.raises(
        PluginError, match=r"plugin 'a': ckpt_transports returned 'simib', not a ckpt\.plugin\.Transport"
    ):
        _cli_plugins.offered_transports(_host(_Plugin([], "a", word)))
    with pytest.raises(PluginError, match=r"plugin 'a' declares transport 'Sim-IB': a provider name is lower-case"):
        _cli_plugins.offered_transports(_host(_Plugin([], "a", Transport("Sim-IB"))))


# ------------------------------------------------------------------ job services
def _job(tmp_path: Path) -> JobInfo:
    return JobInfo(job="0123456789ab", ckpt_dir=tmp_path, transport="simib", host="127.0.0.1")


def test_services_start_down_and_stop_up_with_their_environment(tmp_path: Path) -> None:
    log: Log = []
    host = _host(_Plugin(log, "a", env={"A": "1", "B": "a"}), _Plugin(log, "b"), _Plugin(log, "c", env={"B": "c"}))
    services = _cli_plugins.JobServices(host, _job(tmp_path))
    assert services.start() == {"A": "1", "B": "c"}  # a later plugin's value wins
    services.stop()
    services.stop()  # a second stop stops nothing twice
    assert log == ["start a", "start b", "start c", "stop c", "stop b", "stop a"]


def test_a_failed_start_stops_only_the_plugins_started_before_it(tmp_path: Path) -> None:
    log: Log = []
    failing = _Plugin(log, "b", fail=CkptError("no fabric for you"))
    host = _host(_Plugin(log, "a"), failing, _Plugin(log, "c"))
    with pytest.raises(CkptError, match=r"^no fabric for you$"):  # the plugin's own line, as it wrote it
        _cli_plugins.JobServices(host, _job(tmp_path)).start()
    assert log == ["start a", "start b", "stop a"]


def test_a_plugin_bug_in_a_start_names_the_plugin(tmp_path: Path) -> None:
    log: Log = []
    host = _host(_Plugin(log, "a"), _Plugin(log, "b", fail=KeyError("port")))
    with pytest.raises(PluginError, match=r"plugin 'b' failed in ckpt_job_start: KeyError: 'port'"):
        _cli_plugins.JobServices(host, _job(tmp_path)).start()
    assert log == ["start a", "start b", "stop a"]


def test_a_start_must_return_an_environment(tmp_path: Path) -> None:
    log: Log = []
    host = _host(_Plugin(log, "a"), _Plugin(log, "b", env={"PORT": 5}))
    with pytest.raises(PluginError, match=r"plugin 'b': ckpt_job_start returned .* not a dict of environment"):
        _cli_plugins.JobServices(host, _job(tmp_path)).start()
    assert log == ["start a", "start b", "stop b", "stop a"]  # b had started something before it answered wrong


def test_every_stop_runs_even_when_one_fails(tmp_path: Path) -> None:
    log: Log = []

    class FailingStop(_Plugin):
        @hookimpl
        def ckpt_job_stop(self, job: JobInfo) -> None:
            self.log.append(f"stop {self.name}")
            raise CkptError("already gone")

    host = _host(_Plugin(log, "a"), FailingStop(log, "b"), _Plugin(log, "c"))
    services = _cli_plugins.JobServices(host, _job(tmp_path))
    services.start()
    with pytest.raises(CkptError, match="already gone"):
        services.stop()
    assert log[3:] == ["stop c", "stop b", "stop a"]


class _FakeCoordinator:
    """Stands for the embedded coordinator: logs its start and stop; `fail` makes its start raise."""

    fail = False

    def __init__(self, log: Log, **kwargs: Any) -> None:
        self.log = log
        self.address = "127.0.0.1:1"
        self.ended = threading.Event()

    def start(self) -> _FakeCoordinator:
        self.log.append("coordinator start")
        if self.fail:
            raise CoordinatorError("port in use")
        return self

    def stop(self) -> None:
        self.log.append("coordinator stop")
        self.ended.set()

    def remove_aborted_images(self) -> None:
        pass

    def status(self) -> dict[str, Any]:
        return {}


@pytest.fixture
def job_with(
    hosts: dict[tuple[str, ...], PluginHost], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[Callable[[bool], tuple[Log, Callable[[], Any]]]]:
    """job_with(coordinator_fails) -> (log, make the launcher's _Job) with one logging plugin."""
    claims: list[jobdir.DirectoryClaim] = []

    def make(fails: bool) -> tuple[Log, Callable[[], Any]]:
        log: Log = []
        hosts[()] = _host(_Plugin(log, "svc", env={"SVC": "here"}))
        monkeypatch.setattr(_FakeCoordinator, "fail", fails)
        monkeypatch.setattr(_launcher, "Coordinator", lambda **kw: _FakeCoordinator(log, **kw))
        program = tmp_path / "prog.py"
        program.write_text("")
        claims.append(jobdir.claim(tmp_path / "ckpt"))
        opts = _launcher.JobOptions(
            program=str(program), argv=[], ranks=1, ckpt_dir=tmp_path / "ckpt", transport="simib", claim=claims[-1]
        )
        return log, lambda: _launcher._Job(opts)

    yield make
    for claim in claims:
        claim.release()


def test_the_launcher_starts_services_before_the_coordinator_and_stops_them_after(
    job_with: Callable[[bool], tuple[Log, Callable[[], Any]]],
) -> None:
    log, make = job_with(False)
    job = make()
    assert job.services_env == {"SVC": "here"}  # what every rank's environment gets
    assert job.services.job.job == job.job_id and job.services.job.owns_coordinator
    job.stop()
    assert log == ["start svc", "coordinator start", "coordinator stop", "stop svc"]


def test_a_coordinator_that_cannot_start_stops_the_services(
    job_with: Callable[[bool], tuple[Log, Callable[[], Any]]],
) -> None:
    log, make = job_with(True)
    with pytest.raises(CoordinatorError, match="port in use"):
        make()
    assert log == ["start svc", "coordinator start", "stop svc"]


# ------------------------------------------------------------------ commands
def _commands_plugin(*commands: object) -> object:
    class Commands:
        @hookimpl
        def ckpt_cli_commands(self) -> list[object]:
            return list(commands)

    return Commands()


@pytest.fixture
def command_host(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    def use(*plugins: object) -> None:
        host = _host(*plugins)
        monkeypatch.setattr(_cli_plugins, "launcher_host", lambda *args: host)

    return use


def test_plugin_commands_are_collected(command_host: Callable[..., None]) -> None:
    one, two = click.Command("one", help="1"), click.Group("two", help="2")
    command_host(_commands_plugin(one), _commands_plugin(two))
    assert _cli_plugins.plugin_commands({"launch"}) == {"one": one, "two": two}


@pytest.mark.parametrize("name", ["launch", "dup"])
def test_a_command_name_already_taken_is_refused(command_host: Callable[..., None], name: str) -> None:
    command_host(_commands_plugin(click.Command("dup")), _commands_plugin(click.Command(name)))
    with pytest.raises(PluginError, match=rf"plugin 'p1' adds the command '{name}', which is already taken"):
        _cli_plugins.plugin_commands({"launch"})


def test_a_command_must_be_a_click_command(command_host: Callable[..., None]) -> None:
    command_host(_commands_plugin(print))
    with pytest.raises(PluginError, match=r"plugin 'p0': ckpt_cli_commands returned .* not a named click command"):
        _cli_plugins.plugin_commands(set())


def test_ckpt_plugins_lists_what_each_plugin_contributes() -> None:
    class Commands:
        @hookimpl
        def ckpt_cli_commands(self) -> list[click.Command]:
            return [click.Command("hello")]

    log: Log = []
    host = _host(_Plugin(log, "fast", Transport("fast", default=True)), _Plugin(log, "slow", Transport("slow")))
    host.register(Commands(), name="cmds")
    assert _cli_plugins.contributions(host) == {
        "fast": {"transports": ["fast"], "default_transport": ["fast"], "commands": []},
        "slow": {"transports": ["slow"], "default_transport": [], "commands": []},
        "cmds": {"transports": [], "default_transport": [], "commands": ["hello"]},
    }
    assert not log, "listing contributions starts no service"


# ----------------------------------------------------------------- --on-failure recover: may this job run under it?
class _Answers:
    """A plugin answering ckpt_single_rank_recovery with `answer`, logging that it was asked."""

    def __init__(self, log: Log, name: str, answer: Any) -> None:
        self.log, self.name, self.answer = log, name, answer

    @hookimpl
    def ckpt_single_rank_recovery(self, job: JobInfo) -> Any:
        self.log.append(self.name)
        return self.answer


def test_every_plugin_is_asked_and_a_refusal_stands_unless_another_answers_for_that_plugin(tmp_path: Path) -> None:
    log: Log = []
    ib, dsm = _Answers(log, "ib", "no"), _Answers(log, "dsm", None)
    own = _Answers(log, "other", True)  # recovers its own state: says nothing about ib's
    # registered low to high; a True answer from above no longer silences the refusal below it
    with pytest.raises(CkptError, match="plugin 'ib' cannot recover a single rank: no") as refused:
        _cli_plugins.check_single_rank_recovery(_host(ib, dsm, own), _job(tmp_path))
    assert sorted(log) == ["dsm", "ib", "other"] and "\n" not in str(refused.value)
    log.clear()
    for_dsm = _Answers(log, "log", ["dsm"])  # answers for a plugin that did not refuse: ib's refusal stands
    with pytest.raises(CkptError, match="plugin 'ib' cannot recover a single rank"):
        _cli_plugins.check_single_rank_recovery(_host(ib, dsm, for_dsm, own), _job(tmp_path))
    for_both = _Answers(log, "log", ["ib", "dsm"])  # re-creates the connections and the shared memory
    _cli_plugins.check_single_rank_recovery(_host(ib, dsm, for_both, own), _job(tmp_path))
    _cli_plugins.check_single_rank_recovery(_host(for_both, ib), _job(tmp_path))  # registration order is moot
    _cli_plugins.check_single_rank_recovery(_host(dsm), _job(tmp_path))  # no answer: accepted
    # the first uncovered refusal, in the hook's order (up), is the one said
    with pytest.raises(CkptError, match="plugin 'dsm' cannot recover a single rank: shm"):
        _cli_plugins.check_single_rank_recovery(_host(ib, _Answers(log, "dsm", "shm")), _job(tmp_path))


@pytest.mark.parametrize("answer", [1, False, ["ib", 3], [""], ("ib",), "  "])
def test_an_answer_that_is_none_of_the_four_names_the_plugin(tmp_path: Path, answer: Any) -> None:
    with pytest.raises(PluginError, match=r"plugin 'odd': ckpt_single_rank_recovery returned .*, not True, a list"):
        _cli_plugins.check_single_rank_recovery(_host(_Answers([], "odd", answer)), _job(tmp_path))


def test_the_verbs_plugin_refuses_recover_in_one_line(tmp_path: Path) -> None:
    import ckpt_ib

    answer = ckpt_ib.ckpt_single_rank_recovery(_job(tmp_path))
    assert isinstance(answer, str) and "\n" not in answer and "--disable-plugin ib" in answer
    host = PluginHost()
    host.register(ckpt_ib, name="ib")  # its entry-point name: what a list answering for it names
    with pytest.raises(CkptError, match="plugin 'ib' cannot recover a single rank: the verbs plugin alone"):
        _cli_plugins.check_single_rank_recovery(host, _job(tmp_path))
    host.register(_Answers([], "remotelog", ["ib", "dsm"]), name="remotelog")
    _cli_plugins.check_single_rank_recovery(host, _job(tmp_path))
