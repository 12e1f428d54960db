"""ckpt.plugin: the whole plugin contract -- what a plugin author reads, and all a plugin may import.

Hooks and their order (:mod:`ckpt.plugin.hookspecs`), the phases (:class:`Phase`), what hooks are
handed (:class:`Runtime`, :class:`KeyValue`, :class:`ImageContents`, :class:`JobInfo`), what they
contribute (:class:`PluginOption`, :class:`Transport`, verbs providers typed by
:class:`VerbsOpsTable`, peers found through a :class:`Directory`), :class:`VirtualIdTable`, and the
contract's version, :data:`CKPT_PLUGIN_API`.  Built-in plugins use nothing of ckpt but ``ckpt``,
``ckpt.plugin``, ``ckpt.verbs`` and ``ckpt.testing``; docs/plugins.md is checked against this package.
"""

from ckpt.plugin import hookspecs
from ckpt.plugin._api import (
    CKPT_PLUGIN_API,
    PROJECT,
    Direction,
    ImageContents,
    JobInfo,
    Phase,
    PluginOption,
    Transport,
    hookimpl,
    hookspec,
)
from ckpt.plugin._lazy import lazy_exports
from ckpt.plugin._runtime import KeyValue, PluginCalls, Runtime
from ckpt.plugin._verbs import Directory, DirectoryFactory, ProviderFactory, VerbsOpsTable
from ckpt.plugin._vid import VirtualIdTable

#: The entry-point group through which installed plugins are found.
ENTRY_POINT_GROUP = "ckpt.plugins"

#: The key-value namespace where the coordinator says which ranks failed and came back
#: (``--on-failure recover``): ``failed/<rank>`` = the incarnation that was lost, published when
#: the coordinator notices; ``incarnation/<rank>`` = the rank's new incarnation, published once it
#: has run ``ckpt_restart`` (just before ``ckpt_rank_recovered`` fires on the survivors).  A rank
#: replaying its logs after a recovery publishes ``replay/<rank>`` = ``[done, total]`` (operations
#: replayed, operations logged; a few times a second at most: each publish is a round trip), and
#: ``ckpt status`` shows "replaying done/total" while done < total (``--json``: ``ranks[i].replay``);
#: the coordinator clears it (None) when that rank is lost.
RANKS_NS = "ckpt.ranks"
#: The key-value namespace where a rank's plugins publish their statistics for ``ckpt status --json``:
#: key ``<rank>/<plugin>``, any msgpack-able value (a dict of counters); ``ranks[i].plugins`` shows
#: ``{plugin: value}``.  Like every value it is the current generation's: republish after a restart.
STATS_NS = "ckpt.stats"

__all__ = [
    "CKPT_PLUGIN_API",
    "ENTRY_POINT_GROUP",
    "PROJECT",
    "RANKS_NS",
    "STATS_NS",
    "Direction",
    "Directory",
    "DirectoryFactory",
    "ImageContents",
    "JobInfo",
    "KeyValue",
    "Phase",
    "PluginCalls",
    "PluginOption",
    "ProviderFactory",
    "Runtime",
    "Transport",
    "VerbsOpsTable",
    "VirtualIdTable",
    "hookimpl",
    "hookspec",
    "hookspecs",
    "lazy_exports",
]
