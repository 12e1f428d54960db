"""Checkpoint manifests on disk: atomic writes, the ``latest`` pointer, file names and pruning (schema: _schemas)."""

# A checkpoint exists once, and only once, its manifest exists: the images of
# all ranks are written first, then the coordinator writes the manifest
# (temp file -> fsync -> rename -> fsync of the directory), then moves the
# `latest` pointer the same way.  A crash at any point leaves either the old
# checkpoint or the new one fully visible, never half of one; stray images or
# temp files of an aborted checkpoint are garbage for `remove_unreferenced`.
# The manifest carries HMAC-SHA256(token, canonical JSON), so a restart can
# refuse a manifest that was edited or belongs to another job.
#
# Files in a checkpoint directory:
#   ckpt_<program>_<rank>_<n>.ckpt   image of one rank for checkpoint n
#   ckpt_<program>_<n>.json          manifest of checkpoint n
#   latest                           the file name of the newest coordinated ("job") manifest
#
# An independent checkpoint of one rank (single-rank recovery, DESIGN.md §8)
# writes a manifest of kind "rank" that names every rank's latest image (the
# others' from earlier checkpoints, `RankEntry.number`); `latest` keeps
# pointing at the newest coordinated one, the only kind a whole-job restart
# can use.  `rank_image` finds a rank's latest image in the newest manifest.
# Checkpoint numbers come from one counter and the coordinator runs one
# checkpoint at a time, so the newest manifest (by number) of any kind always
# names every rank's latest image.
#
# Pruning (`--keep K`, after each commit) keeps, of the committed manifests:
#   1. the newest K "job" manifests, and the one `latest` names;
#   2. the newest manifest of any kind: the images it names are *needed* (a
#      single-rank recovery of any rank would load one of them now);
#   3. every manifest whose own images (those numbered like it) include a
#      needed image -- an older coordinated checkpoint, or a superseded "rank"
#      manifest, whose rank has not checkpointed since -- so an image always
#      keeps a manifest of its number (`remove_uncommitted` relies on that).
# Every other manifest is deleted, then its own images, except those a kept
# manifest names (they go at a later prune, once none does: an image older
# than the newest manifest with no manifest of its number is such a one).  So
# "rank" manifests older than the newest go as soon as their rank checkpoints
# again, and no image some rank's recovery needs is ever deleted.  A whole-job
# restart from checkpoint J drops the "rank" manifests numbered above J
# (`abandon_after`): they are of the rolled-back run.

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
from pathlib import Path
from typing import Any, Final

from ckpt._errors import ImageError
from ckpt._schemas import MANIFEST_FORMAT, MANIFEST_MINOR, Manifest, SchemaError, decode, to_dict

__all__ = [
    "LATEST",
    "MANIFEST_VERSION",
    "abandon_after",
    "image_name",
    "latest_manifest",
    "manifest_name",
    "next_number",
    "prune",
    "rank_image",
    "read_manifest",
    "remove_uncommitted",
    "remove_unreferenced",
    "write_manifest",
]

#: The manifest format this ckpt writes and reads (its schema and compatibility rule: ckpt._schemas).
MANIFEST_VERSION: Final[int] = MANIFEST_FORMAT
LATEST: Final[str] = "latest"
_REQUIRED: Final = ("manifest_version", "program", "number", "ranks")


def image_name(program: str, rank: int, number: int) -> str:
    """File name of the image of ``rank`` in checkpoint ``number``."""
    return f"ckpt_{_checked(program)}_{rank}_{number}.ckpt"


def manifest_name(program: str, number: int) -> str:
    """File name of the manifest of checkpoint ``number``."""
    return f"ckpt_{_checked(program)}_{number}.json"


def write_manifest(ckpt_dir: str | os.PathLike[str], manifest: Manifest, *, token: bytes) -> Path:
    """Write ``manifest`` atomically, then point ``latest`` at it (a "job" manifest only); return its path.

    What is stored is ``manifest`` with this ckpt's format and a fresh ``hmac`` (HMAC-SHA256 of the
    canonical JSON of every other field), whatever the ones it carries.
    """
    directory = Path(ckpt_dir)
    try:
        stored = to_dict(manifest)
        del stored["hmac"]
        stored["manifest_version"], stored["manifest_minor"] = MANIFEST_VERSION, MANIFEST_MINOR
        name = manifest_name(manifest.program.name, manifest.number)
        stored["hmac"] = _mac(stored, token)
        text = json.dumps(stored, indent=2, sort_keys=True) + "\n"
    except (TypeError, ValueError) as exc:
        raise ImageError(f"cannot write manifest in {directory}: {_one_line(exc)}") from exc
    path = directory / name
    try:
        _replace_atomically(path, text.encode())
    except OSError as exc:
        raise ImageError(f"cannot write manifest {path}: {exc.strerror or exc}") from exc
    if manifest.kind != "job":
        return path  # an independent checkpoint's: no whole-job restart point, `latest` stays
    try:
        _replace_atomically(directory / LATEST, (name + "\n").encode())
    except OSError as exc:
        if _latest_name(directory) == name:
            return path  # renamed into place (only syncing the directory failed): it is the latest
        # Not committed after all: a manifest that `latest` does not name would count for --keep while its
        # images are deleted as an aborted checkpoint's.  Take it back; the previous checkpoint stays the latest.
        path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            _fsync_directory(directory)
        raise ImageError(f"cannot update {directory / LATEST}: {exc.strerror or exc}") from exc
    return path


def read_manifest(path: str | os.PathLike[str], *, token: bytes | None) -> Manifest:
    """Read and check a manifest; with a ``token``, also check its HMAC.

    Raises ImageError (one line naming the file) if it is missing, unreadable,
    not JSON, not a ckpt manifest, of another format, not authentic, or does
    not fit its format's schema.  The HMAC covers the file as written, fields
    this ckpt does not know (a newer minor's) included.
    """
    where = f"checkpoint manifest {os.fspath(path)}"
    try:
        text = Path(path).read_bytes()
    except FileNotFoundError as exc:
        raise ImageError(f"{where}: missing file") from exc
    except OSError as exc:
        raise ImageError(f"{where}: unreadable ({exc.strerror or exc})") from exc
    try:
        manifest = json.loads(text)
    except ValueError as exc:
        raise ImageError(f"{where}: not JSON") from exc
    if not isinstance(manifest, dict) or any(key not in manifest for key in _REQUIRED):
        raise ImageError(f"{where}: not a ckpt manifest")
    version = manifest["manifest_version"]
    if version != MANIFEST_VERSION:  # refused before its HMAC: another format may sign another way
        raise ImageError(f"manifest {os.fspath(path)} has format {version}; this ckpt reads format {MANIFEST_VERSION}")
    if token is not None:
        stored = manifest.get("hmac")
        unsigned = {key: value for key, value in manifest.items() if key != "hmac"}
        if not isinstance(stored, str) or not hmac.compare_digest(stored, _mac(unsigned, token)):
            raise ImageError(f"{where}: not authentic (HMAC mismatch: wrong CKPT_TOKEN or tampered manifest)")
    try:
        return decode(manifest, Manifest, where)
    except SchemaError as exc:
        raise ImageError(str(exc)) from None


def latest_manifest(ckpt_dir: str | os.PathLike[str]) -> Path:
    """The manifest ``latest`` points to; ImageError if there is no checkpoint."""
    directory = Path(ckpt_dir)
    pointer = directory / LATEST
    try:
        name = pointer.read_text().strip()
    except FileNotFoundError as exc:
        raise ImageError(f"no checkpoint in {directory}") from exc
    except UnicodeDecodeError:
        raise ImageError(f"{pointer} is damaged (it does not name a manifest)") from None
    except OSError as exc:
        raise ImageError(f"{pointer} is unreadable ({exc.strerror or exc})") from exc
    if not name or "/" in name or os.sep in name or name in (".", ".."):
        raise ImageError(f"{pointer} is damaged (it does not name a manifest)")
    path = directory / name
    if not path.is_file():
        raise ImageError(f"{pointer} names {name}, which does not exist")
    return path


def rank_image(
    ckpt_dir: str | os.PathLike[str], program: str, rank: int, *, token: bytes | None
) -> tuple[Manifest, int]:
    """The newest committed manifest of ``program`` (any kind) and the number of ``rank``'s latest image in it.

    What a single-rank recovery restarts ``rank`` from.  ImageError if there is none or it is damaged.
    """
    directory = Path(ckpt_dir)
    numbers = sorted(
        (n for n in _manifest_numbers(directory, program) if _complete(directory, program, n)), reverse=True
    )
    if not numbers:
        raise ImageError(f"no checkpoint of {program} in {directory}")
    manifest = read_manifest(directory / manifest_name(program, numbers[0]), token=token)
    for entry in manifest.ranks:
        if entry.rank == rank:
            return manifest, entry.image_number(manifest.number)
    raise ImageError(f"{manifest_name(program, numbers[0])} has no image of rank {rank}")


def next_number(ckpt_dir: str | os.PathLike[str], program: str) -> int:
    """One more than the highest manifest number of ``program`` in ``ckpt_dir`` (1 if none)."""
    return max(_manifest_numbers(Path(ckpt_dir), program), default=0) + 1


def prune(ckpt_dir: str | os.PathLike[str], program: str, keep: int) -> list[Path]:
    """Keep the newest ``keep`` coordinated checkpoints of ``program`` (0 keeps all) and what single-rank
    recovery still needs; delete the rest.  The rule is in this module's rationale comment.

    Only committed checkpoints count: a manifest whose images are not all there
    (a damaged directory) is neither counted nor deleted.  A checkpoint's
    manifest goes first, so a crash mid-prune leaves orphan images, never a
    manifest without its images.  Returns the deleted paths.
    """
    if keep < 0:
        raise ValueError(f"keep must be 0 or more, not {keep}")
    directory = Path(ckpt_dir)
    found = {n: _summary(directory, program, n) for n in _manifest_numbers(directory, program)}
    committed = {n: summary for n, summary in found.items() if summary is not None}
    jobs = sorted(n for n, (kind, _) in committed.items() if kind == "job")
    if keep == 0 or not committed:
        return []
    newest = max(committed)
    needed = committed[newest][1]  # the images some rank's recovery would use now
    kept = {newest, *jobs[-keep:]}
    protected = _latest_name(directory)
    kept |= {n for n in committed if manifest_name(program, n) == protected}
    # a manifest whose own images are still needed stays, so those images keep a manifest of their number
    kept |= {n for n, (_, files) in committed.items() if any(_number_of(program, f) == n for f in files & needed)}
    named = {file for n in kept for file in committed[n][1]}
    gone = set(committed) - kept
    deleted: list[Path] = []
    for number in sorted(gone):
        deleted += _unlink(directory / manifest_name(program, number))
    # the images of those, and of manifests deleted before while a kept one still named some of their images
    pattern = re.compile(rf"ckpt_{re.escape(_checked(program))}_\d+_(\d+)\.ckpt")
    for match in _matches(directory, pattern):
        number = int(match[1])
        if match[0] not in named and (number in gone or (number not in found and number < newest)):
            deleted += _unlink(directory / match[0])
    return deleted


def abandon_after(ckpt_dir: str | os.PathLike[str], program: str, number: int) -> list[Path]:
    """A whole-job restart from checkpoint ``number``: delete the independent checkpoints taken after it.

    They belong to the run that is rolled back, and the newest manifest must name each rank's image
    of the restarted run, so "rank" manifests numbered above ``number`` go, with the images no
    remaining manifest of their number names.  Coordinated ("job") manifests stay whatever their
    number (a user may restart from an older one on purpose).  Returns the deleted paths.
    """
    directory = Path(ckpt_dir)
    later = [n for n in _manifest_numbers(directory, program) if n > number and _kind(directory, program, n) == "rank"]
    deleted: list[Path] = []
    for n in sorted(later):
        deleted += _unlink(directory / manifest_name(program, n))
        deleted += _unlink(*_image_files(directory, program, n))
    return deleted


def remove_unreferenced(ckpt_dir: str | os.PathLike[str], program: str, number: int) -> list[Path]:
    """Delete the images and temp files of checkpoint ``number`` if it has no manifest.

    For the leftovers of an aborted checkpoint; returns the deleted paths.
    """
    directory = Path(ckpt_dir)
    name = manifest_name(program, number)
    if (directory / name).exists():
        return []
    return _unlink(directory / (name + ".tmp"), *_image_files(directory, program, number))


def remove_uncommitted(ckpt_dir: str | os.PathLike[str], program: str) -> list[Path]:
    """Delete every image (and image temp file) of ``program`` whose checkpoint has no manifest.

    For what a killed job leaves behind; only call it while no rank can be writing an image.
    """
    directory = Path(ckpt_dir)
    committed = set(_manifest_numbers(directory, program))
    pattern = re.compile(rf"ckpt_{re.escape(_checked(program))}_\d+_(\d+)\.ckpt(\.tmp)?")
    stray = [directory / m[0] for m in _matches(directory, pattern) if int(m[1]) not in committed]
    return _unlink(*stray)


def _complete(directory: Path, program: str, number: int) -> bool:
    """Are all the images the manifest of checkpoint ``number`` names in the directory?"""
    try:
        ranks = json.loads((directory / manifest_name(program, number)).read_bytes())["ranks"]
        return all((directory / str(entry["file"])).is_file() for entry in ranks)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _summary(directory: Path, program: str, number: int) -> tuple[str, set[str]] | None:
    """(kind, image files named) of the manifest of checkpoint ``number``; None unless it is committed.

    Committed: its own images (those numbered like it) are all there -- what a "rank" manifest names
    of other checkpoints may have been pruned since, once no longer any rank's latest.
    """
    try:
        raw = json.loads((directory / manifest_name(program, number)).read_bytes())
        kind, files = str(raw.get("kind", "job")), {str(entry["file"]) for entry in raw["ranks"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    own = [file for file in files if _number_of(program, file) == number]
    if not own or not all((directory / file).is_file() for file in own):
        return None
    return kind, files


def _kind(directory: Path, program: str, number: int) -> str | None:
    """The kind of the manifest of checkpoint ``number``, committed or not; None if it cannot be read."""
    try:
        return str(json.loads((directory / manifest_name(program, number)).read_bytes()).get("kind", "job"))
    except (OSError, ValueError, AttributeError):
        return None


def _number_of(program: str, image: str) -> int | None:
    """The checkpoint number in an image's file name (``ckpt_<program>_<rank>_<n>.ckpt``)."""
    match = re.fullmatch(rf"ckpt_{re.escape(_checked(program))}_\d+_(\d+)\.ckpt", image)
    return int(match[1]) if match else None


def _checked(program: str) -> str:
    if "/" in program or os.sep in program or "\0" in program:
        raise ValueError(f"program name {program!r} cannot be part of a file name")
    return program


def _mac(manifest: dict[str, Any], token: bytes) -> str:
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hmac.new(token, canonical.encode(), hashlib.sha256).hexdigest()


def _replace_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file: write, fsync, rename, fsync the directory."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        # 0600 like coordinator.json: the manifest names the job's whole state
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _manifest_numbers(directory: Path, program: str) -> list[int]:
    pattern = re.compile(rf"ckpt_{re.escape(_checked(program))}_(\d+)\.json")
    return [int(match[1]) for match in _matches(directory, pattern)]


def _image_files(directory: Path, program: str, number: int) -> list[Path]:
    pattern = re.compile(rf"ckpt_{re.escape(_checked(program))}_\d+_{number}\.ckpt(\.tmp)?")
    return [directory / match[0] for match in _matches(directory, pattern)]


def _matches(directory: Path, pattern: re.Pattern[str]) -> list[re.Match[str]]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return [match for name in names if (match := pattern.fullmatch(name))]


def _latest_name(directory: Path) -> str | None:
    try:
        return (directory / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _unlink(*paths: Path) -> list[Path]:
    deleted = []
    for path in paths:
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        deleted.append(path)
    return deleted


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
