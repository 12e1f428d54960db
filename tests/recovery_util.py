"""Single-rank recovery on thread-ranks: each rank a verbs "process" of its own, one killed and respawned alone."""

# What a respawned rank needs, and how each piece stands in for it here:
#
# * An image of its state.  Real verbs handles do not pickle; the program's
#   objects do under ckpt_ib, whose Virtualizer is one per process -- so every
#   thread-rank gets a provider of its own (`dsmrec_<letters>`: a fresh simib
#   table whose devices open one HCA, `simib<10 + rank>` as the other DSM
#   tests use), wrapped by an `IbPlugin` of its own, registered in a
#   `PluginHost` of its own (`rt.plugins`, where the DSM memory registers
#   itself as it does in a rank).  `snapshot` pickles the plugin's registry
#   with the given objects, as an image does.
# * Its death.  `kill` destroys every real resource of the rank (its QPs vanish
#   from its HCA: peers sending to them get RETRY_EXC_ERR, as from a dead host).
# * A new process.  `respawn` gives the rank a new `IbPlugin` over a fresh table
#   on another HCA (`dsmrecover<10 + rank>_<0|1>`, alternating with each
#   incarnation: new qp_nums, keys and LIDs), copied
#   into the provider's registered table (the table pickles by provider name,
#   so the image's objects find it), a new plugin host and a new runtime double
#   (`recovered`, `incarnation` 1); loads the image; runs RESTART.  `rt` pickles
#   by reference (as `ckpt.Runtime` does), so the image's objects that keep it
#   get the new one.
# * The runtime's notifications.  The test fires `ckpt_rank_failed` /
#   `ckpt_rank_recovered` through the survivors' plugin hosts and REFRESH /
#   RESUME through the respawned rank's, in the order the runtime does.

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable
from typing import Any

import cloudpickle
from dsm_util import FIRST_HCA
from ib_util import _letters, destroy_real_resources

from ckpt import verbs as v
from ckpt.plugin import ImageContents
from ckpt.runtime.plugins import PluginHost
from ckpt.testing import ThreadGroup, ThreadRuntime
from ckpt.verbs import _simib
from ckpt_ib import IbPlugin

_runtimes: dict[tuple[int, int], RecoverableRuntime] = {}
_jobs = itertools.count()
_providers = itertools.count()


def _runtime_of(job: int, rank: int) -> RecoverableRuntime:
    return _runtimes[job, rank]


class RecoverableRuntime(ThreadRuntime):
    """A thread-rank's ``rt`` that pickles by reference: whoever loads an image gets the rank's live one."""

    def __init__(self, group: ThreadGroup, rank: int, job: int, **kwargs: Any) -> None:
        super().__init__(group, rank, **kwargs)
        self.job_key = job
        _runtimes[job, rank] = self

    def __reduce__(self) -> tuple[Any, tuple[int, int]]:
        return (_runtime_of, (self.job_key, self.rank))


class RankProcess:
    """One thread-rank as a process: its provider, its ckpt_ib, its plugin host and its ``rt``."""

    def __init__(self, group: ThreadGroup, rank: int, job: int, options: dict[str, Any]) -> None:
        self.group, self.rank, self.job, self.options = group, rank, job, options
        self.provider = f"dsmrec_{_letters(next(_providers))}"
        self.table: v.VerbsOps | None = None
        self.incarnation = 0
        self._new_process(f"simib{FIRST_HCA + rank}")
        v.register_provider(self.provider, self._make_table)

    def _new_process(self, hca: str) -> None:
        self.hca = hca
        self.rt = RecoverableRuntime(self.group, self.rank, self.job, options=self.options, plugins=PluginHost())
        self.rt.device = f"{self.provider}0"
        self.rt.incarnation = self.incarnation
        self.rt.recovered = self.rt.restarted = self.incarnation > 0
        self.ib = IbPlugin()
        self.ib.ckpt_init(self.rt)
        assert self.rt.plugins is not None
        self.rt.plugins.register(self.ib, name="ckpt_ib")

    def _wrapped_table(self) -> v.VerbsOps:
        base = _simib.make_ops()
        entries = {name: getattr(base, name) for name in v.OPERATIONS}
        open_real, hca = entries["open_device"], self.hca
        entries["open_device"] = lambda name: open_real(hca)
        ops = v.VerbsOps(self.provider, **entries)
        assert self.ib.vz is not None
        self.ib.vz.install(ops)
        return ops

    def _make_table(self) -> v.VerbsOps:
        self.table = self._wrapped_table()
        return self.table

    @property
    def host(self) -> PluginHost:
        assert isinstance(self.rt.plugins, PluginHost)
        return self.rt.plugins

    def call(self, hook: str, **kwargs: Any) -> None:
        """Fire a ckpt hook on this rank's plugins, in the contract's order, as its runtime would."""
        self.host.call(hook, rt=self.rt, **kwargs)

    def snapshot(self, state: Any) -> bytes:
        """An image: ckpt_ib's registry pickled with `state` in one graph (quiesce what `state` runs first)."""
        assert self.ib.vz is not None
        return bytes(cloudpickle.dumps((self.ib.vz.registry, state)))

    def kill(self) -> None:
        """Destroy every real resource of this rank, children first, as its death would."""
        vz = self.ib.vz
        assert vz is not None and vz.inner is not None
        destroy_real_resources(vz)

    def respawn(self, image: bytes) -> Any:
        """The rank's next incarnation: a new process on another HCA loads `image` and runs RESTART; its state."""
        self.incarnation += 1
        self._new_process(f"dsmrecover{FIRST_HCA + self.rank}_{self.incarnation % 2}")
        fresh = self._wrapped_table()
        assert self.table is not None
        for name in v.OPERATIONS:  # the registered table (found by the image's objects) is the new process's
            setattr(self.table, name, getattr(fresh, name))
        registry, state = cloudpickle.loads(image)
        self.call("ckpt_restart", image=ImageContents({"ib": registry}))
        return state


class RecoveryJob:
    """`size` RankProcesses sharing one ThreadGroup (collectives, KV, ID allocation)."""

    def __init__(self, size: int, options: dict[str, Any]) -> None:
        self.group = ThreadGroup(size)
        job = next(_jobs)
        self.ranks = [RankProcess(self.group, rank, job, options) for rank in range(size)]
        self.finalizers: list[Callable[[], Any]] = []

    def run(self, bodies: list[Callable[[RankProcess], Any]], timeout: float = 60.0) -> list[Any]:
        """Run bodies[r](ranks[r]) on one thread per rank; their results; the first failure is re-raised."""
        results: list[Any] = [None] * len(bodies)
        errors: list[BaseException] = []

        def main(rank: int) -> None:
            try:
                results[rank] = bodies[rank](self.ranks[rank])
            except BaseException as exc:  # re-raised in the test's thread
                errors.append(exc)
                self.group.abort()

        threads = [threading.Thread(target=main, args=(r,), name=f"rank-{r}", daemon=True) for r in range(len(bodies))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout)
        try:
            if errors:
                raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
            if any(thread.is_alive() for thread in threads):
                raise TimeoutError(f"a thread-rank did not finish within {timeout:.0f} s")
        finally:
            for finalizer in self.finalizers:
                with contextlib.suppress(Exception):
                    finalizer()
        return results


def concurrently(*calls: Callable[[], Any], timeout: float = 60.0) -> None:
    """Run `calls` on threads of their own and wait for all (the first failure is re-raised)."""
    errors: list[BaseException] = []

    def run(call: Callable[[], Any]) -> None:
        try:
            call()
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(call,), daemon=True) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    if errors:
        raise errors[0]
    if any(thread.is_alive() for thread in threads):
        raise TimeoutError(f"a call did not return within {timeout:.0f} s")
