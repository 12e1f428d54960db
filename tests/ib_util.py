"""Fixtures for the ckpt_ib unit tests: a private virtualized provider and a simulated restart, on a FakeRuntime."""

# The plugin is tested in one process, without a coordinator:
#
# * `ckpt.testing.FakeRuntime` stands for `ckpt.Runtime` (rank 0 of 1):
#   `allocate_global` with per-namespace counters kept across generations,
#   as the coordinator keeps them (from VIRTUAL_BASE here); `kv` that a new
#   generation empties (the real store is generation-scoped);
#   `coordinator_barrier` returning `[value]`.
#
# * Each test gets its own provider, `ibt_<letters>`: a fresh simib table
#   (`_simib.make_ops()`) under a unique name, registered with
#   `verbs.register_provider`, and wrapped by a fresh `Virtualizer` when the
#   table is built.  The process-wide `simib` table the other verbs tests use
#   is never wrapped.
#
# * Which HCA a device is.  simib's `open_device(name)` takes the process's HCA
#   for that *device name* (`_hca.hca(name)`, created on first use and never
#   released: it is the process's NIC, with its own threads, socket and LIDs).
#   A provider of our own would therefore create two new HCAs per test.  We
#   reuse the existing ones instead, deliberately: device `ibt_x<i>` opens the
#   HCA `simib<i>` (the one `Context(name="simib<i>")` uses in the other verbs
#   tests), and after a simulated restart it opens `ibrestart<i>`, another
#   HCA of this process, so the restarted objects get new qp_nums, keys *and*
#   LIDs, as on a new fabric.  The mapping sits under the Virtualizer (in the
#   table it wraps), so the program and the plugin only ever see `ibt_x<i>`.
#
# * `IbEnv.restart(state)` is the plugin's checkpoint/restart path without the
#   runtime: drain, pickle the registry together with the program's objects
#   (cloudpickle, as the image writer does), destroy every real resource (the
#   process dies), unpickle, then RESTART / REFRESH / RESUME (`rebuild`,
#   `reconnect`, `repost_sends`) on the same Virtualizer.

from __future__ import annotations

import contextlib
import itertools
import string
from collections.abc import Iterator
from typing import Any

import cloudpickle
from verbs_util import Endpoint, connect_rc

from ckpt import verbs as v
from ckpt.testing import FakeRuntime
from ckpt.verbs import _simib
from ckpt_ib import drain, rebuild, reconnect, repost_sends
from ckpt_ib._virtual import Virtualizer

#: First virtual ID of every namespace: above the unicast LID range (1..0xBFFF) the subnet manager
#: draws real LIDs from, so a virtual LID can never equal a real one by chance (real qp_nums start
#: at 0x100 + a random base, keys at 0x1000 + a random 31-bit base: no collision there either).
VIRTUAL_BASE = 0xC000
#: The real HCAs device index i opens, before and after a simulated restart (alternating).
HCA_GENERATIONS = (("simib0", "simib1"), ("ibrestart0", "ibrestart1"))


_provider_numbers = itertools.count()


def _letters(n: int) -> str:
    """0 -> 'a', 25 -> 'z', 26 -> 'ba': provider names take letters only (device names append a digit)."""
    out = ""
    while True:
        n, r = divmod(n, 26)
        out = string.ascii_lowercase[r] + out
        if not n:
            return out


class IbEnv:
    """One test's virtualized provider: `context(i)` opens its device i; `restart(state)` simulates a restart."""

    def __init__(self) -> None:
        self.provider = f"ibt_{_letters(next(_provider_numbers))}"
        self.rt = FakeRuntime(first_id=VIRTUAL_BASE)
        self.vz = Virtualizer(self.rt)
        self.hca_generation = 0
        self.contexts: list[v.Context] = []
        self.ops: v.VerbsOps | None = None
        v.register_provider(self.provider, self._make_ops)

    def _make_ops(self) -> v.VerbsOps:
        base = _simib.make_ops()
        entries = {name: getattr(base, name) for name in v.OPERATIONS}
        open_real = entries["open_device"]
        entries["open_device"] = lambda name: open_real(self.hca_name(name))
        ops = v.VerbsOps(self.provider, **entries)
        self.vz.install(ops)
        self.ops = ops
        return ops

    def hca_name(self, device: str) -> str:
        """The real HCA behind `device` (`<provider><i>`) in the current generation."""
        index = int(device.removeprefix(self.provider))
        return HCA_GENERATIONS[self.hca_generation % len(HCA_GENERATIONS)][index]

    def pair(self, **opts: Any) -> tuple[Endpoint, Endpoint]:
        """Two RC endpoints, on devices 0 and 1, connected and in RTS (options of `verbs_util.connect_rc`)."""
        return connect_rc(self.context(0), self.context(1), **opts)

    def context(self, index: int) -> v.Context:
        ctx = v.Context(name=f"{self.provider}{index}")
        self.contexts.append(ctx)
        return ctx

    def image(self, state: Any) -> bytes:
        """The plugin's part of an image (the registry) pickled with the program's objects, as the runtime does."""
        return bytes(cloudpickle.dumps((self.vz.registry, state, self.contexts)))

    def restart(self, state: Any, *, drained: bool = True) -> Any:
        """Drain, image, the process dies, a new one loads the image and restarts; returns the new `state`."""
        if drained:
            drain(self.vz, self.rt)
        blob = self.image(state)
        self.kill()
        self.hca_generation += 1
        self.rt.new_generation()
        registry, state, self.contexts = cloudpickle.loads(blob)
        self.vz.registry = registry
        rebuild(self.vz)  # RESTART
        reconnect(self.vz)  # REFRESH, after every rank published
        repost_sends(self.vz)  # RESUME, after every rank re-posted its receives
        return state

    def kill(self) -> None:
        """Destroy every real resource of the registry, children first, as the death of the process would."""
        destroy_real_resources(self.vz)


def destroy_real_resources(vz: Any) -> None:
    """Destroy every real resource behind `vz`'s shadows, children first, as a process's death would."""
    inner, reg = vz.inner, vz.registry
    if inner is None:
        return
    steps = [
        (reg.qps, inner.destroy_qp),
        (reg.ahs, inner.destroy_ah),
        (reg.srqs, inner.destroy_srq),
        (reg.mrs, inner.dereg_mr),
        (reg.cqs, inner.destroy_cq),
        (reg.channels, inner.destroy_comp_channel),
        (reg.pds, inner.dealloc_pd),
        (reg.devices, inner.close_device),
    ]
    for shadows, destroy in steps:
        for shadow in shadows:
            if shadow.real is not None:
                with contextlib.suppress(v.PyverbsError):
                    destroy(shadow.real)


def ib_env() -> Iterator[IbEnv]:
    """The body of the `ib` fixture (tests/conftest.py): an IbEnv, killed at teardown."""
    env = IbEnv()
    try:
        yield env
    finally:
        env.kill()


def virtual_of(obj: Any) -> Any:
    """The shadow the program's object holds (its `handle`)."""
    return obj.handle


def real_of(obj: Any) -> Any:
    """The provider's real handle behind a program object."""
    return obj.handle.real
