"""The on-disk schemas: a checkpoint's manifest and an image's header, typed and versioned."""

# CRIU keeps its image formats as explicit schemas apart from the logic; these
# are ckpt's.  Both are JSON objects (the manifest a file of its own, the header
# inside an image's prefix), so they are `msgspec.Struct`s: one definition that
# types the call sites and validates what is read back.
#
# Versioning rule, the same for both: a format is (major, minor).
#   * A minor bump only adds optional fields.  A reader takes any minor of its
#     major, ignoring fields it does not know, so what this version writes
#     keeps working in the next one and the other way round.
#   * Anything else (a field removed, renamed or changed in meaning) bumps the
#     major; a reader refuses any major but its own with ONE line naming both
#     ("manifest X has format 3; this ckpt reads format 1").
# The major is `manifest_version` (a manifest) or `format_version` (an image,
# also in its binary prefix); files written before the minor existed have
# none, which reads as minor 0.  Those are format 1 with exactly today's fields.

from __future__ import annotations

from typing import Any, Final, TypeVar, final

import msgspec

__all__ = [
    "IMAGE_FORMAT",
    "IMAGE_MINOR",
    "MANIFEST_FORMAT",
    "MANIFEST_MINOR",
    "ImageHeader",
    "JobRecord",
    "Manifest",
    "ProgramInfo",
    "RankEntry",
    "SchemaError",
    "decode",
    "to_dict",
]

#: Format of a manifest this ckpt writes and reads (the major), and the minor it writes.
MANIFEST_FORMAT: Final[int] = 1
MANIFEST_MINOR: Final[int] = 1
#: Format of an image (its layout and its header) this ckpt writes and reads, and the header's minor.
IMAGE_FORMAT: Final[int] = 1
IMAGE_MINOR: Final[int] = 1


class SchemaError(ValueError):
    """What is read does not match its schema: one line, without the file's name (the caller adds it)."""


@final
class ProgramInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The program a job runs, as the rank that loaded it found it."""

    #: The program file, resolved.
    path: str
    #: Its stem: part of every image and manifest file name.
    name: str
    #: The one `ckpt.Program` subclass it defines.
    class_: str = msgspec.field(name="class")
    #: SHA-256 of the file, so a restart can warn that it changed.
    sha256: str


@final
class JobRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The job settings a manifest records for a restart to reuse (unless its command line gives them)."""

    interval: float | None = None
    keep: int = 0
    phase_timeout: float = 300.0
    #: ``--rank-interval``: independent checkpoints of each rank, staggered (minor 1).
    rank_interval: float | None = None
    #: What a lost rank does to the job (minor 1): "abort" (the job fails) or "recover" (the rank is
    #: respawned from its own latest image while the others run on).
    on_failure: str = "abort"


@final
class RankEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's image in a manifest."""

    rank: int
    #: The image's file name, in the manifest's directory.
    file: str
    host: str = ""
    pid: int = 0
    #: Size of the image file.
    bytes: int = 0
    #: Its content checksum (what its trailer records); "" when not recorded.
    sha256: str = ""
    #: Wall time of writing it.
    seconds: float = 0.0
    #: The step boundary it was taken at; None when not recorded.
    step: int | None = None
    #: The checkpoint this image was taken in when it is not the manifest's own (minor 1): an
    #: independent checkpoint's manifest lists every rank's latest image, most from earlier ones.
    number: int | None = None
    #: The rank's incarnation when it was taken (minor 1; see ``Runtime.incarnation``).
    incarnation: int = 0

    def image_number(self, manifest_number: int) -> int:
        """The checkpoint the image belongs to, in a manifest numbered ``manifest_number``."""
        return manifest_number if self.number is None else self.number


@final
class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """A checkpoint: which images make it up and what a restart needs to run the job again.

    A checkpoint exists once its manifest does (see ``ckpt._manifest``).
    """

    job: str
    program: ProgramInfo
    size: int
    #: The checkpoint number, counted over the job's whole life (restarts included).
    number: int
    #: "job": a coordinated checkpoint, every rank's image taken at one boundary -- what a
    #: whole-job restart (and ``latest``) uses.  "rank" (minor 1): written after an independent
    #: checkpoint of one rank; it lists every rank's latest image, for single-rank recovery only.
    kind: str = "job"
    #: The job's generation when it was taken (0 for the launch, one more per restart).
    generation: int
    ranks: list[RankEntry]
    #: The transport the job ran on (a ``ckpt.plugin.Transport`` name).
    transport: str
    argv: list[str] = []
    #: When its CHECKPOINT barrier completed (seconds since the epoch), and how long the checkpoint took.
    created: float = 0.0
    seconds: float = 0.0
    #: What each plugin reported about itself (`name`, `version`, `module`, ...).
    plugins: list[dict[str, Any]] = []
    #: The ``--with-plugin`` modules and every plugin option's value, reused on restart.
    with_plugins: list[str] = []
    options: dict[str, Any] = {}
    settings: JobRecord = JobRecord()
    #: The coordinator's address when it was taken.
    coordinator: str = ""
    #: The job's global id counters (virtual ids), continued on restart.
    id_counters: dict[str, int] = {}
    manifest_version: int = MANIFEST_FORMAT
    manifest_minor: int = MANIFEST_MINOR
    #: HMAC-SHA256 (keyed with the job's token) of the canonical JSON of every other field.
    hmac: str = ""

    def image_bytes(self) -> int:
        """The size of all its images together."""
        return sum(entry.bytes for entry in self.ranks)


@final
class ImageHeader(msgspec.Struct, frozen=True, kw_only=True):
    """What an image says about itself, readable without checking or unpickling the rest."""

    #: The program's name, its class and the SHA-256 of its file.
    program: str
    class_: str = msgspec.field(name="class", default="")
    program_sha256: str = ""
    job: str
    rank: int
    size: int
    number: int
    generation: int
    #: The step boundary the rank was parked at, whether it had finished, and its result if so.
    step: int = 0
    finished: bool = False
    result: str | None = None
    #: The rank's incarnation (minor 1; see ``Runtime.incarnation``): a whole-job restart keeps it.
    incarnation: int = 0
    format_version: int = IMAGE_FORMAT
    format_minor: int = IMAGE_MINOR
    #: Set when the image is written: when, and its largest objects (see ``describe_objects``).
    created: float = 0.0
    objects: list[dict[str, Any]] = []


_S = TypeVar("_S", Manifest, ImageHeader)
_MAJOR: Final[dict[type[msgspec.Struct], tuple[str, int]]] = {
    Manifest: ("manifest_version", MANIFEST_FORMAT),
    ImageHeader: ("format_version", IMAGE_FORMAT),
}
_MINOR: Final[dict[type[msgspec.Struct], str]] = {Manifest: "manifest_minor", ImageHeader: "format_minor"}


def decode(raw: Any, kind: type[_S], what: str) -> _S:
    """Check ``raw`` (a JSON object as read) against its format and schema; return it typed.

    Raises SchemaError with one line: ``what`` (e.g. "manifest ckpt_heat_3.json") and both formats
    when the major is not ours, or the first field that does not fit.
    """
    key, ours = _MAJOR[kind]
    if not isinstance(raw, dict):
        raise SchemaError(f"{what} is not a JSON object")
    version = raw.get(key)
    if type(version) is not int:
        raise SchemaError(f"{what} has no format version ({key})")
    if version != ours:
        raise SchemaError(f"{what} has format {version}; this ckpt reads format {ours}")
    try:  # a file written before minors existed is minor 0, not the minor this ckpt writes
        return msgspec.convert({_MINOR[kind]: 0, **raw}, kind)
    except msgspec.ValidationError as exc:
        raise SchemaError(f"{what} does not fit format {ours}: {exc}") from None


def to_dict(obj: msgspec.Struct) -> dict[str, Any]:
    """``obj`` as the JSON object it is stored as (field names as on disk, e.g. ``class``)."""
    data = msgspec.to_builtins(obj)
    assert isinstance(data, dict)
    return data
