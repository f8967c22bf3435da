"""The file side of a checkpoint: temporary directory, manifest, publish, rotation, discovery.

Pure file operations (no torch.distributed); `checkpoint.py` calls them on rank 0 between its
barriers. Layout of `<save_dir>`:

    .tmp_iter_<NNNNNNN>/   a checkpoint being written (never loaded; removed by the next save)
    iter_<NNNNNNN>/        a published checkpoint: the dist-checkpoint files + manifest.json
    iter_<NNNNNNN>.prev/   the previous copy of an iteration being re-saved (until the new one
                           is published); a resume uses it when iter_<NNNNNNN>/ is missing
    latest                 the name of the newest published checkpoint (written with os.replace)

A save writes into `.tmp_iter_N`, then `manifest.json` (size and sha256 of every file, the run
id and iteration), fsyncs, renames the directory to `iter_N` and only then replaces `latest`.
Rotation (`keep_last`) orders checkpoints of this run (same run id in the manifest) by iteration
number and never deletes the one `latest` names or the one just written.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil

from megatron_pdm import fsutil

logger = logging.getLogger(__name__)

LATEST = "latest"
MANIFEST = "manifest.json"
FORMAT = "megatron_pdm.checkpoint/1"
_NAME = re.compile(r"^iter_(\d{7})(\.prev)?$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; the message names the file or directory."""


def ckpt_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def tmp_path(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, "." + ckpt_name(iteration) + ".tmp")


def prepare_tmp(save_dir: str, iteration: int) -> str:
    """Rank 0: an empty temporary directory for iteration's checkpoint (stale ones removed)."""
    os.makedirs(save_dir, exist_ok=True)
    for name in os.listdir(save_dir):
        if name.startswith(".iter_") and name.endswith(".tmp"):  # an interrupted save
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
    path = tmp_path(save_dir, iteration)
    os.makedirs(path)
    return path


def _files(path: str) -> list[str]:
    out = []
    for root, _, names in os.walk(path):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), path)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def write_manifest(path: str, *, run_id: str, iteration: int, identity: dict) -> dict:
    """Rank 0, after every rank has written: sizes and sha256 of every file, fsynced."""
    files = {}
    for rel in _files(path):
        full = os.path.join(path, rel)
        with open(full, "rb") as f:
            os.fsync(f.fileno())
        files[rel] = {"size": os.path.getsize(full), "sha256": fsutil.file_sha256(full)}
    manifest = {"format": FORMAT, "run_id": run_id, "iteration": int(iteration),
                "identity": identity, "files": files}
    out = os.path.join(path, MANIFEST)
    with open(out, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    fsutil.fsync_dir(path)
    return manifest


def read_manifest(path: str) -> dict:
    """The manifest of checkpoint directory `path`; CheckpointError when missing or unreadable."""
    file = os.path.join(path, MANIFEST)
    try:
        with open(file) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing (an incomplete checkpoint, or one written "
                              "before checkpoints carried a manifest)") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{file}: unreadable manifest: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(
            manifest.get("files"), dict):
        raise CheckpointError(f"{file}: not a {FORMAT} manifest")
    return manifest


def verify(path: str) -> dict:
    """Checks every file of the checkpoint against its manifest (set of files, sizes, sha256).

    Raises CheckpointError naming the first file that is missing, extra, of another size or
    with another digest. Returns the manifest."""
    manifest = read_manifest(path)
    expected = manifest["files"]
    present = set(_files(path))
    for rel in sorted(set(expected) | present):
        full = os.path.join(path, rel)
        if rel not in present:
            raise CheckpointError(f"{full}: listed in the manifest but missing")
        if rel not in expected:
            raise CheckpointError(f"{full}: not listed in the manifest")
        size = os.path.getsize(full)
        if size != expected[rel]["size"]:
            raise CheckpointError(f"{full}: {size} bytes, the manifest says "
                                  f"{expected[rel]['size']} (corrupt or truncated)")
        if fsutil.file_sha256(full) != expected[rel]["sha256"]:
            raise CheckpointError(f"{full}: sha256 differs from the manifest (corrupt)")
    return manifest


def _write_latest(save_dir: str, name: str) -> None:
    fsutil.write_atomic(os.path.join(save_dir, LATEST), name.encode())


def read_latest(save_dir: str) -> str | None:
    """The checkpoint name `latest` holds (None without a `latest`); a name that is not a
    checkpoint name of this directory (e.g. `../../x`) is a CheckpointError."""
    marker = os.path.join(save_dir, LATEST)
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        name = f.read().strip()
    if not _NAME.match(name) or name.endswith(".prev"):
        raise CheckpointError(f"{marker}: {name!r} is not a checkpoint name of this directory "
                              "(expected iter_NNNNNNN)")
    return name


def list_checkpoints(save_dir: str) -> list[tuple[int, str]]:
    """(iteration, path) of every published directory, oldest first; `iter_N` before
    `iter_N.prev` of the same iteration is preferred (the .prev only when iter_N is missing)."""
    if not os.path.isdir(save_dir):
        return []
    found: dict[int, str] = {}
    for name in sorted(os.listdir(save_dir)):
        m = _NAME.match(name)
        if m and os.path.isdir(os.path.join(save_dir, name)):
            it = int(m.group(1))
            if it not in found or not m.group(2):
                found[it] = os.path.join(save_dir, name)
    return sorted(found.items())


def publish(save_dir: str, iteration: int, tmp: str, *, run_id: str, keep_last: int,
            hook=None) -> str:
    """Rank 0: renames the finished `tmp` to `iter_N`, then `latest`, then rotation.

    Re-saving an existing iteration moves the old copy aside to `iter_N.prev` first and
    deletes it only once `latest` names the new one. `hook(phase)` is called between the
    steps (tests kill the process there)."""
    hook = hook or (lambda phase: None)
    name = ckpt_name(iteration)
    final = os.path.join(save_dir, name)
    prev = final + ".prev"
    if os.path.isdir(final):
        if os.path.isdir(prev):  # an earlier re-save got past its rename: final is complete
            shutil.rmtree(prev)
        os.rename(final, prev)
        fsutil.fsync_dir(save_dir)
        hook("moved_aside")
    os.rename(tmp, final)
    fsutil.fsync_dir(save_dir)
    hook("renamed")
    _write_latest(save_dir, name)
    hook("latest")
    if os.path.isdir(prev):
        shutil.rmtree(prev)
    rotate(save_dir, run_id=run_id, keep_last=keep_last, keep={name})
    return final


def rotate(save_dir: str, *, run_id: str, keep_last: int, keep: set[str]) -> list[str]:
    """Deletes this run's published checkpoints beyond the `keep_last` highest iterations.

    Only directories whose manifest carries `run_id` are candidates; `latest`'s target and the
    names in `keep` are never deleted. Returns the deleted paths."""
    if keep_last <= 0:
        return []
    try:
        latest = read_latest(save_dir)
    except CheckpointError:
        latest = None
    ours = []
    for it, path in list_checkpoints(save_dir):
        try:
            if read_manifest(path).get("run_id") == run_id:
                ours.append((it, path))
        except CheckpointError:
            continue  # not ours to judge: never deleted
    deleted = []
    for _, path in ours[:-keep_last]:
        base = os.path.basename(path)
        if base in keep or base == latest:
            continue
        shutil.rmtree(path, ignore_errors=True)
        deleted.append(path)
    return deleted


def find_resume(save_dir: str) -> str | None:
    """The checkpoint `--resume` loads: the highest-iteration published checkpoint, verified.

    None when the directory holds no published checkpoint. When `latest` names a missing
    directory, or an older one than the newest published, the newest is used with a warning.
    A newest checkpoint that fails verification is a CheckpointError (never a silent fallback
    to an older one: the user decides by moving the named directory away)."""
    latest = read_latest(save_dir)
    found = list_checkpoints(save_dir)
    if not found:
        if latest is not None:
            raise CheckpointError(f"{os.path.join(save_dir, LATEST)} names {latest}, which is "
                                  "missing, and no other checkpoint exists")
        return None
    _, path = found[-1]
    if latest is not None and os.path.basename(path) != latest:
        logger.warning("%s names %s; resuming from the newest complete checkpoint %s",
                       os.path.join(save_dir, LATEST), latest, path)
    verify(path)
    return path


def has_checkpoints(save_dir: str) -> bool:
    """True when `save_dir` holds a published checkpoint or a `latest` marker."""
    return bool(list_checkpoints(save_dir)) or os.path.exists(os.path.join(save_dir, LATEST))


def check_identity(saved: dict, current: dict, where: str) -> None:
    """CheckpointError naming every key whose value differs between the saved and this run."""
    keys = sorted(set(saved) | set(current))
    diff = [f"{k}: checkpoint {saved.get(k)!r}, this run {current.get(k)!r}"
            for k in keys if saved.get(k) != current.get(k)]
    if diff:
        raise CheckpointError(f"{where}: cannot resume a run with other settings ("
                              + "; ".join(diff) + ")")
