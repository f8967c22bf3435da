"""Config yaml files on disk: the one place a config file is read or written.

Reading (`read_yaml`) refuses, with a `ConfigError` naming the file, what yaml itself would
accept silently:

* a file that changed while it was read (a regular file whose size or modification time differs
  before and after the read, or whose size is not the number of bytes read): something is still
  writing it;
* an empty file (0 bytes: the usual result of a crash between truncating and writing a file);
* a file whose last line has no newline. Editors and `yaml.safe_dump` end a file with one; a
  copy cut short by a full disk, an interrupted transfer or a crash usually ends mid-line, and
  yaml still parses the cut text as a valid, different value (`lr: 0.0003` cut to `lr: 0.00`,
  `iterations: 200` cut to `iterations: 2`). The error quotes the last line; the fix, once the
  line is checked, is to end the file with a newline;
* a key given twice in one mapping (yaml keeps the last silently), naming both lines;
* a file the driver wrote whose content no longer matches the digest in its first line (below).

Files the project writes (`write_yaml`: the run directory's `config.yaml`) start with one
comment line carrying the sha256 and byte count of the text below it, and are written to a
temporary file in the same directory, fsynced and renamed over the target (a reader sees the old
file or the new one, never a part). `read_yaml` checks that line, so a saved config cut exactly at
a line boundary (which the newline rule cannot see) or changed since it was written is refused.
A copy edited on purpose must drop the line; the line itself says so.

Known limit: a hand-written file cut exactly after a newline, whose remaining lines still parse,
cannot be told from a shorter file (nothing in it says how long it should be).
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from typing import Any

import yaml

from megatron_pdm import fsutil
from megatron_pdm.configtree import ConfigError

__all__ = ["read_yaml", "write_yaml"]

_HEADER = ("# written by megatron-pdm: sha256 {sha} of the {n} bytes below; delete this line "
           "before editing\n")
_HEADER_RE = re.compile(rb"# written by megatron-pdm: sha256 ([0-9a-f]{64}) of the (\d+) bytes "
                        rb"below")


class _DuplicateKey(ValueError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (yaml keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise _DuplicateKey(f"{key_node.start_mark.line + 1}: key {key!r} given twice "
                                    f"(first on line {seen[key]})")
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _read_all(f) -> bytes:
    return f.read()


def _read_stable(path: str | os.PathLike) -> bytes:
    """The file's bytes, read once; refused when it changed during the read."""
    try:
        with open(path, "rb") as f:
            before = os.fstat(f.fileno())
            data = _read_all(f)
            after = os.fstat(f.fileno())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory") from None
    except OSError as err:
        raise ConfigError(f"config file {path}: cannot be read: {err}") from None
    if stat.S_ISREG(before.st_mode) and (
            (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns)
            or len(data) != after.st_size):
        raise ConfigError(f"{path}: changed while it was read ({before.st_size} bytes before, "
                          f"{after.st_size} after, {len(data)} read); is something still "
                          "writing it? Read it again once it is complete")
    return data


def _check_complete(path, data: bytes) -> None:
    if not data:
        raise ConfigError(f"{path}: empty file (0 bytes; truncated?); pass no --config for the "
                          "defaults, or write the line `{}` in it")
    if not data.endswith(b"\n"):
        last = data.rsplit(b"\n", 1)[-1].decode("utf-8", "replace")
        shown = last if len(last) <= 80 else last[:77] + "..."
        raise ConfigError(
            f"{path}: the last line {shown!r} does not end with a newline: the file may be cut "
            "short (a truncated copy usually ends mid-line, and yaml would read the cut value as "
            "a valid one); check that line, then end the file with a newline")


def _check_digest(path, data: bytes) -> None:
    first, _, body = data.partition(b"\n")
    m = _HEADER_RE.match(first)
    if m is None:
        return
    sha, n = m.group(1).decode(), int(m.group(2))
    if len(body) != n:
        raise ConfigError(f"{path}: {len(body)} bytes below its first line, which says {n} "
                          "(written by the driver; truncated or edited since). An edited copy "
                          "must drop that first line")
    if hashlib.sha256(body).hexdigest() != sha:
        raise ConfigError(f"{path}: its content does not match the sha256 in its first line "
                          "(written by the driver; corrupted or edited since). An edited copy "
                          "must drop that first line")


def read_yaml(path: str | os.PathLike) -> Any:
    """Parses a config yaml file after the checks of the module docstring.

    Returns:
        What the file holds (None for a file of comments only).

    Raises:
        ConfigError: missing, unreadable, changing, empty, cut, not UTF-8, not yaml, a key given
            twice, or a driver-written file that no longer matches its digest; the message
            starts with the path.
    """
    data = _read_stable(path)
    _check_complete(path, data)
    _check_digest(path, data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start})") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except _DuplicateKey as err:
        raise ConfigError(f"{path}:{err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid yaml: {err}") from None


def write_yaml(path: str | os.PathLike, data: Any) -> None:
    """Writes `data` as yaml with the digest line, atomically (fsutil.write_atomic)."""
    body = yaml.safe_dump(data, sort_keys=False).encode("utf-8")
    header = _HEADER.format(sha=hashlib.sha256(body).hexdigest(), n=len(body)).encode()
    fsutil.write_atomic(path, header + body)
