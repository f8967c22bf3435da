"""Per-seed records on disk as each seed finishes, so a study that dies part-way (the OOM killer,
SIGKILL, a lost node) keeps every seed it measured.

`<out_dir>/per_seed.partial.jsonl`: one JSON line per finished seed (the dict results.json stores
under `per_seed`; design "runs" adds the seed's `per_step` rows), written by global rank 0,
flushed and fsynced before the next seed starts. results.json, written at the end, stays the
complete record; the partial file is left beside it. A study started in a directory that already
holds a partial file moves that file to `per_seed.partial.jsonl.old-<k>` (the lowest free k)
instead of appending to or deleting it: the lines of one file always belong to one study.
"""

from __future__ import annotations

import json
import os

from megatron_pdm.analysis.report import plain

__all__ = ["PARTIAL_NAME", "SeedLog", "read_partial"]

PARTIAL_NAME = "per_seed.partial.jsonl"


class SeedLog:
    """Appends one line per seed to `<out_dir>/per_seed.partial.jsonl` (a no-op when not
    `enabled`, i.e. on every rank but global rank 0)."""

    def __init__(self, out_dir: str, *, enabled: bool):
        self.path = os.path.join(out_dir, PARTIAL_NAME)
        self.enabled = enabled
        if not enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        if os.path.exists(self.path):
            k = 1
            while os.path.exists(f"{self.path}.old-{k}"):
                k += 1
            os.replace(self.path, f"{self.path}.old-{k}")
        # created empty now: an existing file means this study started
        with open(self.path, "x", encoding="utf-8"):
            pass

    def append(self, record: dict) -> None:
        if not self.enabled:
            return
        line = json.dumps(plain(record), sort_keys=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())


def read_partial(out_dir: str) -> list[dict]:
    """The records of a (possibly killed) study; a last line cut by a crash mid-write is
    dropped, any other unreadable line raises ValueError naming the file and line."""
    path = os.path.join(out_dir, PARTIAL_NAME)
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    records = []
    for i, line in enumerate(lines):
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1:  # no newline after it: the write was cut
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON record ({exc})") from None
    return records
