"""The converted checkpoint's directory layout: Megatron-LM's `--load` layout plus our metadata.

    <dir>/latest_checkpointed_iteration.txt   "release" (Megatron-LM's tracker file)
    <dir>/release/                            the torch_dist dist checkpoint (metadata.json, ...)
    <dir>/pdm_model.json                      architecture, layout at import, dtype, key style
    <dir>/hf_assets/                          tokenizer and generation config of the source

Megatron-LM (`megatron/training/checkpointing.py` of https://github.com/NVIDIA/Megatron-LM at
d98e8a64) reads a
`--load` directory as follows, and this layout is what its weights-only (converted) checkpoints
look like; slime's converter (https://github.com/THUDM/slime/blob/main/tools/convert_hf_to_torch_dist.py)
writes the same (it moves `iter_0000001`
to `release` and writes "release" into the tracker):
- `get_checkpoint_tracker_filename` (l. 375): the tracker is
  `<load>/latest_checkpointed_iteration.txt`;
- `read_metadata` (l. 388): its content is an iteration number or the word "release";
- `get_checkpoint_name` (l. 230): "release" -> `<load>/release`, N -> `<load>/iter_{N:07d}`;
- `_get_checkpoint_format` (l. 1974): a directory with `metadata.json` is a torch_dist checkpoint;
- `load_checkpoint` (l. 2452; l. 2852 and the optimizer/RNG conditions above it): a release checkpoint
  starts at iteration 0 and never loads optimizer or RNG state, so `--load <dir>` works without
  `--finetune --no-load-optim --no-load-rng` (an `iter_0000000` with tracker "0" would need
  them, and a stored `iteration`).

The tensors are keyed exactly as megatron-core's `GPTModel.sharded_state_dict()`, which is what
Megatron-LM's `generate_state_dict` puts under `model`.

`weights_dir` resolves any of: this layout's top directory (what `--load` is given), an
`iter_NNNNNNN` tracker, the inner `release/` directory, or a flat dist checkpoint (converter
output before this layout, and the trainer's weight-sync scratch directories). `meta_dir` finds
`pdm_model.json` next to the tracker or in the checkpoint directory itself.
"""

from __future__ import annotations

from pathlib import Path

TRACKER_FILE = "latest_checkpointed_iteration.txt"
META_FILE = "pdm_model.json"  # our metadata beside the tracker (checkpoint.py writes it)
RELEASE = "release"
DIST_METADATA = "metadata.json"  # megatron.core.dist_checkpointing.core.CONFIG_FNAME


def release_dir(top: str | Path) -> Path:
    """Where the converter writes the dist checkpoint inside `top`."""
    return Path(top) / RELEASE


def write_tracker(top: str | Path) -> None:
    """Marks `top` as a Megatron-LM release checkpoint (write it after the save completed)."""
    path = Path(top) / TRACKER_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(RELEASE + "\n")
    tmp.replace(path)


def _tracked(top: Path) -> Path | None:
    tracker = top / TRACKER_FILE
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if text == RELEASE:
        return top / RELEASE
    try:
        return top / f"iter_{int(text):07d}"
    except ValueError:
        raise ValueError(f"{tracker}: expected an iteration number or 'release' (Megatron-LM's "
                         f"tracker format), got {text!r}") from None


def weights_dir(path: str | Path) -> str:
    """The dist-checkpoint directory behind `path` (see the module docstring)."""
    top = Path(path)
    tracked = _tracked(top)
    if tracked is not None:
        if not (tracked / DIST_METADATA).is_file():
            raise FileNotFoundError(f"{top / TRACKER_FILE} points to {tracked}, which holds no "
                                    f"dist checkpoint ({DIST_METADATA} missing)")
        return str(tracked)
    if (top / DIST_METADATA).is_file():
        return str(top)
    raise FileNotFoundError(
        f"{top}: no dist checkpoint here: expected {TRACKER_FILE} (+ {RELEASE}/ or iter_*/) as "
        f"written by megatron-pdm-convert-hf-to-megatron, or {DIST_METADATA} of a dist checkpoint")


def meta_dir(path: str | Path) -> Path:
    """The directory holding pdm_model.json: `path` itself, or the top directory above an inner
    `release/` / `iter_*` directory."""
    top = Path(path)
    if (top / META_FILE).is_file():
        return top
    if (top.parent / TRACKER_FILE).is_file() and (top.parent / META_FILE).is_file():
        return top.parent
    return top
