"""ckpt.testing: test doubles and helpers for ckpt programs and plugins -- public, for plugin authors too.

* In one process, without a coordinator: `FakeRuntime` and `FakeKeyValue` stand for the ``rt`` and
  ``rt.kv`` a plugin's hooks get (`ckpt.plugin.Runtime`, `ckpt.plugin.KeyValue`); `run_threads` /
  `run_program` run a function or a `ckpt.Program` on N thread-ranks (`ThreadRuntime`) with working
  collectives, key-value store and ID allocation.
* Through the CLI, as a user runs it: `run` a command, start a background `Job`, `checkpoint` it,
  compare `Jobs.restarted_results` (launch -> checkpoint --kill -> restart, k times) with
  `uninterrupted`; every process is reaped.  The fixtures ``start_job`` and ``ckpt_jobs`` come with
  ``pytest_plugins = ["ckpt.testing.pytest_plugin"]``.

Nothing else in ckpt imports this package: it is for tests only.
"""

from ckpt.testing._fakes import FakeKeyValue, FakeRuntime
from ckpt.testing._jobs import (
    BANNER,
    CKPT,
    Job,
    Jobs,
    add_pythonpath,
    checkpoint,
    env,
    kill_pids,
    one_error_line,
    results,
    run,
    uninterrupted,
    wait_for,
)
from ckpt.testing._threads import ThreadGroup, ThreadRuntime, run_program, run_threads

__all__ = [
    "BANNER",
    "CKPT",
    "FakeKeyValue",
    "FakeRuntime",
    "Job",
    "Jobs",
    "ThreadGroup",
    "ThreadRuntime",
    "add_pythonpath",
    "checkpoint",
    "env",
    "kill_pids",
    "one_error_line",
    "results",
    "run",
    "run_program",
    "run_threads",
    "uninterrupted",
    "wait_for",
]
