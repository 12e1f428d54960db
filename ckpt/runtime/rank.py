"""One rank: runs the program's steps on the main thread and walks checkpoint phases on a second thread."""

# The program thread and the checkpoint thread meet at step boundaries only.
# Under `_cv` the checkpoint thread raises `_hold` and reads how far the
# program thread can get on its own (`reach`: the boundary it holds at, or the
# end of the step it is in); the coordinator answers with the job-wide target
# (the maximum), and the program thread runs up to that boundary and parks.
# Everything the checkpoint needs from the program thread happens while it is
# parked, so program state is never pickled while it changes.  A rank that has
# finished counts as parked at its final boundary and keeps taking part.
# An independent checkpoint (this rank alone, DESIGN.md §8) walks the same phases
# in scope `rankR.ckptN` to its own reach as the target: the other ranks run on.
# Single-rank recovery (--on-failure recover), this side of it: _survivor.py.

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn, cast

import cloudpickle
import numpy as np

from ckpt import _manifest as manifest
from ckpt._errors import CheckpointAborted, CkptError, CoordinatorError, ImageError, PluginError
from ckpt._program import Program, Runtime, _set_current_runtime, load_program
from ckpt._schemas import ImageHeader
from ckpt.coordinator import protocol
from ckpt.coordinator.client import CoordinatorClient
from ckpt.plugin import ImageContents, Phase, _vid
from ckpt.runtime import images
from ckpt.runtime._process import _exit, _program_traceback, configure_logging, say
from ckpt.runtime._survivor import SurvivorHooks, incarnation
from ckpt.runtime.plugins import PluginHost

log = logging.getLogger(__name__)

SPEC_ENV = "CKPT_RANK_SPEC"
#: How long a rank that asked for a whole-job restart (rt.fall_back) waits to be stopped before it exits.
FALLBACK_WAIT = 60.0


class RankEngine:
    """The per-rank runtime: coordinator link, plugins, the program loop and the checkpoint thread."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.rank = int(spec["rank"])
        self.size = int(spec["size"])
        self.native = bool(spec.get("native"))
        self.token = str(spec["token"])
        self.step = 0
        self.finished = False
        self.result: str | None = None
        self._coll_seq = 0
        self._cv = threading.Condition()
        self._hold = False
        self._target: int | None = None
        self._parked = False
        self._in_step = False
        self._in_setup = False
        self._aborted: set[int] = set()
        self._done = threading.Event()
        self._suspends: queue.SimpleQueue[tuple[int, bool]] = queue.SimpleQueue()  # (number, independent)
        self._last_step_report = 0.0
        #: what the phase in progress is part of: "ckptN" during checkpoint N, "genG" during a restart,
        #: "rankR.ckptN" during independent checkpoint N of this rank
        self.barrier_scope = "job"
        # The active transport (the launcher always names one): Context(name=None) opens it, and an
        # image's verbs tables of any transport come back as its table (`ckpt restart --transport`),
        # so it is set before anything is loaded.
        self.transport = str(spec["transport"])
        os.environ["CKPT_VERBS_PROVIDER"] = self.transport
        self.program_class, self.program_info = load_program(spec["program"])
        self.program: Program | None = None
        self.plugins = (
            None if self.native else PluginHost().load(spec.get("with_plugins", []), spec.get("disabled", []))
        )
        self.image_header: ImageHeader | None = None
        restart = spec.get("restart")
        if restart:
            self.image_header = images.read_header(restart["image"])
            self._check_header(self.image_header)
        self.recovered, self.incarnation = incarnation(spec, self.image_header)
        self._survivor = SurvivorHooks(self.plugins)  # before the link: it may deliver pushes at once
        self.client = CoordinatorClient(
            spec["coordinator"], self.token, self._hello(), on_push=self._on_push, on_lost=self._on_lost
        )
        welcome = self.client.welcome
        self._hold_for_first_image(welcome)
        self.rt = Runtime(
            self,
            rank=self.rank,
            size=self.size,
            argv=list(spec.get("argv", [])),
            device=str(spec.get("device") or self.transport),
            options=dict(spec.get("options", {})),
            plugins=self.plugins,
        )
        self.rt.generation = int(welcome["generation"])
        self.rt.incarnation, self.rt.recovered = self.incarnation, self.recovered
        self.rt.job = str(welcome["job"])
        self.ckpt_dir = Path(spec.get("ckpt_dir") or welcome["ckpt_dir"])
        self.rt.ckpt_dir = str(self.ckpt_dir)
        _set_current_runtime(self.rt)
        _vid.set_global_allocator(self.rt.allocate_global)

    def _hold_for_first_image(self, welcome: dict[str, Any]) -> None:
        """Under recover, the job's first checkpoint is taken at the first step boundary (the welcome says so):
        hold there until it starts, however late its request comes (`_boundary` waits for its target)."""
        if welcome.get("first_image") and self.image_header is None and not self.native:
            with self._cv:
                self._hold = True

    def _check_header(self, header: ImageHeader) -> None:
        restart = self.spec["restart"]
        if header.program != self.program_info["name"] or header.job != restart["job"]:
            raise ImageError(
                f"image {restart['image']} belongs to program {header.program!r} of job "
                f"{header.job!r}, not to {self.program_info['name']!r} of job {restart['job']!r}"
            )
        if header.rank != self.rank or header.number != restart["number"]:
            raise ImageError(
                f"image {restart['image']} is rank {header.rank} of checkpoint {header.number}, "
                f"expected rank {self.rank} of checkpoint {restart['number']}"
            )

    def _hello(self) -> dict[str, Any]:
        hello: dict[str, Any] = {
            "role": "rank",
            "rank": self.rank,
            "size": self.size,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "job": self.spec.get("job"),
            "program": self.program_info,
            "argv": list(self.spec.get("argv", [])),
            "with_plugins": list(self.spec.get("with_plugins", [])),
            "options": dict(self.spec.get("options", {})),
            "transport": self.transport,
            "native": self.native,
            "plugins": [p.record() for p in self.plugins.plugins] if self.plugins else [],
            "on_failure": self.spec.get("on_failure", "abort"),
            "incarnation": self.incarnation,
        }
        if self.recovered:
            hello["recover"] = {"incarnation": self.incarnation}
        if self.image_header is not None:
            restart = self.spec["restart"]
            hello["restart"] = {
                k: restart.get(k) for k in ("job", "generation", "number", "id_counters", "last_checkpoint")
            }
            hello.update(
                step=self.image_header.step,
                finished=self.image_header.finished,
                result=self.image_header.result,
            )
        return hello

    # ----------------------------------------------------------- coordinator pushes
    def _on_push(self, message: dict[str, Any]) -> None:
        match protocol.parse_push(message):
            case protocol.Suspend(number=number, independent=independent):
                self._suspends.put((number, independent))
            case protocol.Abort(number=number):
                with self._cv:
                    self._aborted.add(number)
                    self._cv.notify_all()
            case protocol.Done():
                self._done.set()
            case protocol.KillRank(reason=reason):
                log.info("killed by the coordinator: %s", reason)
                _exit(0)
            case protocol.RankFailed() | protocol.RankRecovered() as push:
                self._survivor.offer(push)

    def _on_lost(self, reason: str) -> None:
        if not self._done.is_set():
            say(f"ckpt rank {self.rank}: {reason}; exiting")
            _exit(1)

    # ----------------------------------------------------------- program thread
    def run(self) -> int:
        try:
            if self.image_header is not None:
                self._restart()
            else:
                if self.plugins:
                    self.plugins.call("ckpt_init", rt=self.rt)
                    self._install_verbs()
                self.program = self.program_class()
            if not self.native:
                threading.Thread(target=self._checkpoint_loop, name="ckpt-checkpoint", daemon=True).start()
                self._survivor.start(self.rt, self._fatal)  # after ckpt_init
            if self.image_header is None:
                with self._cv:
                    self._in_setup = True
                assert self.program is not None
                self.program.setup(self.rt)
                # The program contract: say now which attribute will fail every checkpoint; the job runs on.
                culprit = None if self.native else images.find_unpicklable(self.program, "program")
                if culprit is not None:
                    say(
                        f"ckpt rank {self.rank}: warning: {culprit.name} cannot be pickled; "
                        "checkpoints of this job will fail"
                    )
                with self._cv:
                    self._in_setup = False
            if not self.finished:  # a rank restarted from its final boundary has nothing left to run
                self._loop()
        except CkptError as exc:
            self._fatal(str(exc))
        except Exception as exc:
            where = f"step {self.step}" if self.image_header or self.step else "setup or step 0"
            self._fatal(f"the program raised {type(exc).__name__} in {where}: {exc}", _program_traceback(exc))
        self._done.wait()
        with self._cv:  # a checkpoint being aborted as the job ends finishes its hooks first
            while self._hold:
                self._cv.wait()
        if self.spec.get("print_result"):  # no embedded coordinator to print it for this rank
            sys.stdout.flush()  # one write() per line: ranks share the launcher's stdout
            os.write(sys.stdout.fileno(), f"[rank {self.rank}] result: {self.result}\n".encode())
        if self.plugins:
            try:
                self.plugins.call("ckpt_exit", rt=self.rt)
            except PluginError as exc:
                log.warning("%s", exc)
        self.client.close()
        return 0

    def _loop(self) -> None:
        assert self.program is not None
        step = self.program.step
        while True:
            self._boundary()
            more = step(self.rt)
            if not isinstance(more, (bool, np.bool_)):  # None (a forgotten return) must not run on silently
                raise CkptError(
                    f"{type(self.program).__name__}.step() returned {more!r} in step {self.step}: it must return "
                    "True (more steps to run) or False (this rank is done)"
                )
            if not more:  # still "in the step" until the result is known: a checkpoint must not see
                value = self.program.result()  # finished=True with no result yet
            with self._cv:
                self.step += 1
                self._in_step = False
                if not more:
                    self.finished, self.result = True, None if value is None else str(value)
                    self._cv.notify_all()
                    break
            now = time.monotonic()
            if now - self._last_step_report >= 0.25:
                self._last_step_report = now
                self.client.notify("step", step=self.step)
        self.client.call("finished", result=self.result, step=self.step)

    def _boundary(self) -> None:
        with self._cv:
            # Parked means: held, and at (or past) *this* checkpoint's target.  _release clears
            # _parked, so a checkpoint that follows at once can never see the previous one's.
            while self._hold and (self._target is None or self.step >= self._target):
                if self._target is not None and not self._parked:
                    self._parked = True
                    self._cv.notify_all()
                self._cv.wait()
            self._parked = False
            self._in_step = True

    def _reach(self) -> int:
        if self._in_setup:
            return 0
        return self.step + 1 if self._in_step else self.step

    def collective(self, kind: str, obj: Any) -> list[Any]:
        self._coll_seq += 1
        data = cloudpickle.dumps(obj) if kind == "allgather" else None
        step = self.step if not self._in_setup else -1
        answer = self.client.call("collective", seq=self._coll_seq, kind=kind, step=step, data=data)
        if kind != "allgather":
            return []
        return [cloudpickle.loads(value) for value in answer["values"]]

    def request_checkpoint(self, rank: int | None = None) -> int:
        """A coordinated checkpoint, or with `rank` an independent one of that rank; its number (0: queued)."""
        if self.native:
            log.info("checkpoint request ignored: checkpoints are disabled under --native")
            return 0
        return int(self.client.call("checkpoint", **({} if rank is None else {"rank": rank}))["number"])

    def fall_back(self, reason: str) -> NoReturn:
        """rt.fall_back: the coordinator ends the job for a whole-job restart (or fails it), and the launcher
        (or a KillRank push) stops this process; it never runs on, whichever thread asked."""
        try:
            self.client.call("fall_back", reply_timeout=10.0, reason=reason)
        except CoordinatorError as exc:
            say(f"ckpt rank {self.rank}: cannot ask for a whole-job restart ({reason}): {exc}")
            _exit(1)
        threading.Event().wait(FALLBACK_WAIT)  # nothing sets it: the wait ends with this process
        say(f"ckpt rank {self.rank}: asked for a whole-job restart ({reason}), not stopped within {FALLBACK_WAIT:g} s")
        _exit(1)

    def hold_checkpoints(self, reason: str) -> None:
        if not self.native:  # --native takes no checkpoints: nothing to hold
            self.client.call("hold_checkpoints", reason=reason)

    def release_checkpoints(self) -> None:
        if not self.native:
            self.client.call("release_checkpoints")

    def _fatal(self, message: str, traceback_text: str = "") -> NoReturn:
        """Report why this rank cannot go on, and exit.  Under `ckpt launch` the launcher prints it, once
        for the job (with the program's traceback if it raised): not every rank that fails after the first."""
        reported = False
        try:
            self.client.call("fatal", reply_timeout=10.0, error=message, traceback=traceback_text)
            reported = True
        except CoordinatorError:
            pass
        if not reported or self.spec.get("print_result"):
            say(f"{traceback_text}ckpt rank {self.rank}: {message}")
        _exit(1)

    # ----------------------------------------------------------- restart
    def _install_verbs(self) -> None:
        """Register plugins' verbs providers and compose their ops-table wrappers, once, before any verbs call."""
        assert self.plugins is not None
        if not (self.plugins.has_impl("ckpt_verbs_providers") or self.plugins.has_impl("ckpt_wrap_verbs")):
            return
        from ckpt import verbs

        for declared in self.plugins.call("ckpt_transports"):  # what images of other transports map onto
            for transport in declared:
                verbs.register_transport(transport.name)
        for contributed in self.plugins.call("ckpt_verbs_providers"):
            for name, factory in dict(contributed or {}).items():
                verbs.register_provider(name, factory)
        plugins, rt = self.plugins, self.rt

        def wrap(ops: verbs.VerbsOps) -> None:
            plugins.call("ckpt_wrap_verbs", rt=rt, ops=ops)

        verbs.add_ops_wrapper(wrap)

    def _restart(self) -> None:
        restart = self.spec["restart"]

        def progress(done: int, total: int) -> None:
            self.client.notify("progress", done=done, total=total)

        # ckpt_init runs before the image is loaded (its verbs objects need the providers and the
        # wrappers), but already sees a restarted rank at the step the image was taken at.
        assert self.image_header is not None
        self.rt.restarted = True
        self.step = self.image_header.step
        if self.plugins:
            self.plugins.call("ckpt_init", rt=self.rt)
            self._install_verbs()
        _, loaded = images.read_image(
            restart["image"], token=self.token.encode(), progress=progress, expected_sha256=restart.get("sha256")
        )
        graph = cast(dict[str, Any], loaded)
        self.program = graph["program"]
        state = graph["runtime"]
        self.step, self.finished, self.result = state["step"], state["finished"], state["result"]
        self._coll_seq = state["coll_seq"]
        self.rt.restarted = True
        contents = ImageContents(graph["plugins"])
        # a recovered rank restarts alone, in its own scope; a whole-job restart in the generation's
        scope = Phase.rank_scope(self.rank, f"inc{self.incarnation}") if self.recovered else f"gen{self.rt.generation}"
        self.barrier_scope = scope
        self._hook(Phase.RESTART, image=contents)
        self._phase(Phase.RESTART, scope)
        self._hook(Phase.REFRESH)
        self._phase(Phase.REFRESH, scope)
        self._hook(Phase.RESUME, restarted=True, aborted=False, independent=False)
        if self.spec.get("debug"):
            self._debug_stop()
        self._phase(Phase.RESUME, scope)
        self.barrier_scope = "job"
        # a restarted rank hears of other failures too, but its hooks run only now: before, the image's
        # objects (a DSM memory registers itself while unpickled) are half restored (queued until then)
        self._survivor.start(self.rt, self._fatal)
        if self.finished:
            self.client.call("finished", result=self.result, step=self.step)

    def _debug_stop(self) -> None:
        """`ckpt restart --debug RANK`: pdb, in this rank, before its next step; the others wait at RESUME.

        The program is restored and its verbs objects rebuilt and reconnected; `program` is it.
        Set breakpoints in its code (`b file.py:LINE`, `b Class.step`) and `continue` to run on.
        """
        import pdb

        program = self.program
        print(
            f"ckpt: rank {self.rank} restarted before step {self.step}; the other ranks wait at RESUME.\n"
            f"ckpt: `program` is the restored {type(program).__name__}; `c` continues the job.",
            file=sys.stderr,
            flush=True,
        )
        pdb.Pdb().set_trace()  # the next line is where it stops: `program` is in scope
        del program

    def _hook(self, phase: Phase, **kwargs: Any) -> None:
        """Run ``phase``'s hook on every plugin (a rank without plugins has none to run)."""
        assert phase.hook is not None
        if self.plugins:
            self.plugins.call(phase.hook, rt=self.rt, **kwargs)

    def _phase(self, phase: Phase, scope: str, value: Any = None) -> dict[str, Any]:
        """Wait at ``phase``'s global barrier in ``scope`` (``ckptN`` for checkpoint N, ``genG`` for a restart)."""
        answer = self.client.call("barrier", name=phase.barrier(scope), value=value)
        if "abort" in answer:
            raise CheckpointAborted(answer["abort"])
        return answer

    # ----------------------------------------------------------- checkpoint thread
    def _checkpoint_loop(self) -> None:
        while True:
            self._checkpoint(*self._suspends.get())

    def _checkpoint(self, number: int, independent: bool = False) -> None:
        """Walk one checkpoint's phases; every way out releases the program thread."""
        assert self.plugins is not None
        suspended = written = False
        scope = self.barrier_scope = Phase.rank_scope(self.rank, f"ckpt{number}") if independent else f"ckpt{number}"
        image = self.ckpt_dir / manifest.image_name(self.program_info["name"], self.rank, number)
        try:
            self._park(number, scope)
            suspended = True
            self._hook(Phase.PRESUSPEND, independent=independent)
            self._phase(Phase.PRESUSPEND, scope, {"step": self.step})
            self._hook(Phase.DRAIN, independent=independent)
            self._phase(Phase.DRAIN, scope)
            contents = ImageContents()
            self._hook(Phase.CHECKPOINT, image=contents, independent=independent)
            answer = self._phase(Phase.CHECKPOINT, scope, self._write_image(number, contents))
            written = True
            info = {"number": number, "manifest": answer["manifest"], "independent": independent}
            self.plugins.call("ckpt_checkpointed", rt=self.rt, info=info)
            if answer.get("kill"):
                self._exit_after_checkpoint(number)
            self._hook(Phase.RESUME, restarted=False, aborted=False, independent=independent)
            self._phase(Phase.RESUME, scope)
        except (CheckpointAborted, CoordinatorError, PluginError) as exc:
            if written:  # the checkpoint exists; a rank whose plugins failed after it cannot go on safely
                self._fatal(f"after checkpoint {number} was written: {exc} (it can be restarted)")
            log.info("checkpoint %d aborted: %s", number, exc)
            if not isinstance(exc, CheckpointAborted):
                try:  # tell the others (a plugin failed here, or a barrier was refused)
                    self.client.call("abort_checkpoint", number=number, reason=f"rank {self.rank}: {exc}")
                except CoordinatorError:
                    pass
            image.unlink(missing_ok=True)  # written before the abort reached this rank
            if suspended:
                self._resume_after_abort(independent)
        finally:
            self.barrier_scope = "job"
            self._release()

    def _park(self, number: int, scope: str = "") -> None:
        """Agree on the target boundary, then wait until the program thread is parked there."""
        with self._cv:
            self._hold = True
            reach, finished = self._reach(), self.finished
        value = {"reach": reach, "finished": finished, "step": self.step}
        answer = self._phase(Phase.REACH, scope or f"ckpt{number}", value)
        reaches = [v["reach"] for v in answer["values"] if v and not v["finished"]]
        with self._cv:
            self._target = max(reaches, default=reach)
            self._cv.notify_all()
            while not (self._parked or self.finished) and number not in self._aborted:
                self._cv.wait()
            if number in self._aborted:
                raise CheckpointAborted(f"checkpoint {number} was aborted while rank {self.rank} was parking")

    def _exit_after_checkpoint(self, number: int) -> NoReturn:
        assert self.plugins is not None
        log.info("checkpoint %d written; exiting as asked (--kill)", number)
        try:
            self.plugins.call("ckpt_exit", rt=self.rt)
        except PluginError as exc:
            log.warning("%s", exc)
        _exit(0)

    def _resume_after_abort(self, independent: bool) -> None:
        assert self.plugins is not None
        try:
            self._hook(Phase.RESUME, restarted=False, aborted=True, independent=independent)
        except PluginError as exc:
            self._fatal(f"could not resume after an aborted checkpoint: {exc}")

    def _release(self) -> None:
        with self._cv:
            self._hold = False
            self._target = None
            self._parked = False
            self._cv.notify_all()

    def _write_image(self, number: int, contents: ImageContents) -> dict[str, Any]:
        name = self.program_info["name"]
        path = self.ckpt_dir / manifest.image_name(name, self.rank, number)
        header = ImageHeader(
            program=name,
            class_=self.program_info["class"],
            program_sha256=self.program_info["sha256"],
            job=self.rt.job,
            rank=self.rank,
            size=self.size,
            number=number,
            generation=self.rt.generation,
            step=self.step,
            finished=self.finished,
            result=self.result,
            incarnation=self.incarnation,
        )
        graph = {
            "program": self.program,
            "runtime": {
                "step": self.step,
                "finished": self.finished,
                "result": self.result,
                "coll_seq": self._coll_seq,
                "incarnation": self.rt.incarnation,
            },
            "plugins": contents.items,
        }
        try:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            info = images.write_image(path, graph, header=header, token=self.token.encode())
        except images.UnpicklableStateError as exc:
            return {"error": f"cannot pickle the program state: {exc.culprit}"}
        except CkptError as exc:  # an ImageError names the image and says why
            text = str(exc) if str(path) in str(exc) else f"cannot write {path}: {exc}"
            return {"error": text, "image": str(path)}
        except (OSError, TypeError, ValueError, AttributeError) as exc:
            return {"error": f"cannot write {path}: {type(exc).__name__}: {exc}", "image": str(path)}
        except Exception as exc:  # pickling arbitrary program state can fail in arbitrary ways
            return {"error": f"cannot pickle the program state: {type(exc).__name__}: {exc}"}
        return {
            "file": path.name,
            "bytes": info.bytes,
            "sha256": info.sha256,
            "seconds": info.seconds,
            "step": self.step,
            "incarnation": self.incarnation,
            "coll_seq": self._coll_seq,  # how far the coordinator's record of collectives must reach back
        }


def main(spec: dict[str, Any] | None = None) -> NoReturn:
    """Entry point of a rank process (`python -m ckpt.runtime.rank`, spec in $CKPT_RANK_SPEC)."""
    if spec is None:
        spec = json.loads(os.environ[SPEC_ENV])
    configure_logging(int(spec["rank"]), str(spec.get("log_level", "WARNING")))
    if spec.get("print_result"):  # under mpiexec / srun: Ctrl-C ends this rank quietly
        signal.signal(signal.SIGINT, lambda signum, frame: _exit(130))
    else:  # under ckpt launch, which catches Ctrl-C and ends the ranks itself
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = RankEngine(spec)
    except CkptError as exc:
        # refused as the job already ended (a rank failed first): under ckpt launch its error line is the one
        if spec.get("print_result") or "has already ended" not in str(exc):
            say(f"ckpt rank {spec['rank']}: {exc}")
        _exit(1)
    _exit(engine.run())


if __name__ == "__main__":
    main()
