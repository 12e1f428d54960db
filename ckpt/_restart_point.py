"""The checkpoint a restart starts from: where it is, its manifest and token, and whether its images are its own."""

# Used by `ckpt restart`, by a launcher falling back to a whole-job restart, and by `ckpt inspect`
# of a manifest: a damaged or foreign image is named in one line before any process starts.

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpt import _manifest as manifests
from ckpt import _wire as wire
from ckpt._errors import ImageError
from ckpt._jobdir import read_job_file
from ckpt._schemas import Manifest, RankEntry, to_dict
from ckpt.runtime import images


def last_checkpoint(manifest: dict[str, Any], directory: Path) -> dict[str, Any]:
    """What `ckpt status` shows as the last checkpoint, for the checkpoint a job restarts from."""
    return {
        "number": manifest["number"],
        "manifest": str(directory / manifests.manifest_name(manifest["program"]["name"], manifest["number"])),
        "bytes": sum(int(r.get("bytes", 0)) for r in manifest["ranks"]),
        "seconds": float(manifest.get("seconds", 0.0)),
    }


def restart_directory(target: str | None, ckpt_dir: Path) -> tuple[Path, Path | None]:
    """(the checkpoint directory, the manifest asked for or None for the latest) of a restart's TARGET."""
    if target is None:
        return ckpt_dir.resolve(), None
    path = Path(target)
    if path.is_dir():
        return path.resolve(), None
    if not path.exists():
        raise ImageError(f"no checkpoint at {target}: no such file or directory")
    return path.resolve().parent, path.resolve()


def prepare_restart(manifest_path: Path | None, directory: Path, token: str | None) -> tuple[dict[str, Any], str]:
    """Find, authenticate and sanity-check a checkpoint: (manifest, token).

    Every check that needs no full read happens here, before any process starts: each image must be
    the one the manifest names (program, job, rank, checkpoint, step, size and the checksum its
    trailer records); the ranks verify each image's content against that checksum and its HMAC
    while loading it.
    """
    path = manifest_path if manifest_path is not None else manifests.latest_manifest(directory)
    if token is None:
        job = read_job_file(directory)
        token = job["token"] if job else None
    if token is None:
        raise ImageError(f"no token to authenticate {path}: set CKPT_TOKEN (or keep coordinator.json beside it)")
    manifest = manifests.read_manifest(path, token=wire.token_bytes(token))
    if manifest.kind != "job":  # its images are of different moments: no whole-job restart point
        raise ImageError(f"{path.name} is an independent checkpoint's (of one rank): restart a coordinated one")
    program = manifest.program
    if not Path(program.path).is_file():
        raise ImageError(f"the checkpointed program {program.path} no longer exists")
    if len(manifest.ranks) != manifest.size:
        raise ImageError(f"manifest {path} lists {len(manifest.ranks)} images for {manifest.size} ranks")
    for entry in manifest.ranks:
        check_image(directory / entry.file, entry, manifest, path.name)
    return to_dict(manifest), token


def check_image(image: Path, entry: RankEntry, manifest: Manifest, manifest_name: str) -> None:
    """Is `image` the one `entry` of the manifest names? Identity first, so a wrong image is called wrong."""
    if not image.is_file():
        raise ImageError(f"image {image} of checkpoint {manifest.number} is missing")
    header = images.read_header(image)
    program = manifest.program
    if (header.program, header.job) != (program.name, manifest.job):
        raise ImageError(
            f"image {image} belongs to program {header.program!r} (job {header.job}), "
            f"not to {program.name!r} (job {manifest.job}) of manifest {manifest_name}"
        )
    if (header.rank, header.number) != (entry.rank, entry.image_number(manifest.number)):
        raise ImageError(
            f"image {image} is rank {header.rank} of checkpoint {header.number}, "
            f"the manifest expects rank {entry.rank} of checkpoint {entry.image_number(manifest.number)}"
        )
    if entry.step is not None and header.step != entry.step:
        raise ImageError(
            f"image {image} was taken at step {header.step}, the manifest's at step {entry.step}: "
            "it is another checkpoint's image with the same name (from a copy of this directory?)"
        )
    size = image.stat().st_size
    if size != entry.bytes:
        raise ImageError(f"image {image} is truncated or damaged: {size} bytes, the manifest says {entry.bytes}")
    if entry.sha256 and images.stored_checksum(image) != entry.sha256:
        raise ImageError(
            f"image {image} is not the one manifest {manifest_name} names (its checksum differs): "
            "another checkpoint's image with the same name (from a copy of this directory?)"
        )
