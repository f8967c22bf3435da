"""The one durable-write helper: a file replaced atomically, and a directory entry made durable;
and the one file digest (`file_sha256`, used by the checkpoint manifest and the real-model cache).

`write_atomic` writes to a temporary file in the target's directory, fsyncs it and renames it
over the target, then fsyncs the directory: a reader (or a crash) sees the old file or the new
one, never a part. Used by the run config (configfile.py) and the checkpoint files
(mcore/ckpt_files.py). Pure standard library: importing it loads no torch.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

__all__ = ["file_sha256", "fsync_dir", "write_atomic"]


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync of a directory (its renames and new entries reach the disk); best effort."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Replaces `path` by `data`: temporary file beside it, fsync, rename, directory fsync."""
    target = Path(path)
    directory = target.parent
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(directory)
