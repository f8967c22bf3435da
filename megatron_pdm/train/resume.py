"""Resume rules of the driver: which checkpoint `--resume` loads, what a fresh start may overwrite,
and the run identity a checkpoint cannot be loaded across (docs/checkpoints.md).

* `--resume` loads the newest published checkpoint of `<output_dir>/checkpoints`, verified
  against its manifest (mcore/ckpt_files.find_resume); with no checkpoint at all it starts fresh.
  `latest` naming a missing directory resumes from the newest complete one with a warning.
* A fresh start (no `--resume`) in a directory that already holds checkpoints is refused unless
  `checkpoint.allow_fresh_start=true`; then the old run's output directory is moved aside to
  `<output_dir>.old-<k>` (nothing is deleted) and the new run starts in an empty one.
* Identity: the task section, the model architecture and the optimizer layout must equal the
  checkpoint's; the error names every differing key. Model fields added later (the dense
  families' `LATER_MODEL_FIELDS`) absent from an older manifest read as their defaults (the
  Qwen3-MoE shape every older checkpoint has).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import uuid

from megatron_pdm.configtree import ConfigError
from megatron_pdm.mcore import ckpt_files as files

LATER_MODEL_FIELDS = ("ffn_hidden_size", "qk_layernorm", "tie_word_embeddings")


def saved_identity(saved: dict) -> dict:
    """A manifest's identity with the later model fields it predates set to their defaults."""
    from megatron_pdm.arch import ModelArch

    defaults = {f"model.{f.name}": f.default for f in dataclasses.fields(ModelArch)
                if f.name in LATER_MODEL_FIELDS}
    return {**defaults, **saved}


def checkpoint_dir(cfg) -> str:
    return os.path.join(cfg.output_dir, "checkpoints")


def identity(cfg, world_size: int) -> dict:
    """The keys a resumed run must share with its checkpoint (flat, dotted)."""
    out = {f"task.{k}": v for k, v in cfg.task.__dict__.items()}
    out.update({f"model.{k}": getattr(cfg.model, k) for k in cfg.model.checkpoint_fields()})
    p = cfg.parallel
    out["parallel.use_distributed_optimizer"] = p.use_distributed_optimizer
    if p.use_distributed_optimizer:  # its optimizer shards follow the layout (dp_reshardable)
        out.update({"parallel.tp": p.tp, "parallel.pp": p.pp, "parallel.ep": p.ep,
                    "world_size": world_size})
    out["precision.params_dtype"] = cfg.precision.params_dtype
    return out


def check_before_start(cfg, *, resume: bool, world_size: int) -> None:
    """Every rank, before any process group forms: the resume/fresh-start rules as ConfigErrors."""
    d = checkpoint_dir(cfg)
    try:
        if resume:
            path = files.find_resume(d)
            if path is not None:
                saved = saved_identity(files.read_manifest(path).get("identity", {}))
                files.check_identity(saved, identity(cfg, world_size), path)
        elif files.has_checkpoints(d) and not cfg.checkpoint.allow_fresh_start:
            raise ConfigError(
                f"{d} already holds checkpoints: pass --resume to continue that run, or "
                "--set checkpoint.allow_fresh_start=true to start fresh (the old run's directory "
                "is moved to <output_dir>.old-<k>), or choose another --output-dir")
    except files.CheckpointError as err:
        raise ConfigError(f"--resume: {err}") from None


def move_aside(cfg) -> str | None:
    """Rank 0, fresh start allowed over old checkpoints: the previous run's whole output
    directory (checkpoints, metrics, summary, TensorBoard, saved rollouts) is renamed to
    `<output_dir>.old-<k>` and the new run starts in an empty one, so nothing the old run
    could resume from is lost or mixed with the new run's files. When the output directory is
    the working directory (or above it), only `checkpoints/` is renamed (`checkpoints.old-<k>`)."""
    d = checkpoint_dir(cfg)
    if not files.has_checkpoints(d):
        return None
    out = os.path.abspath(cfg.output_dir)
    cwd = os.getcwd()
    src = d if (cwd == out or cwd.startswith(out + os.sep)) else out
    k = 1
    while os.path.exists(f"{src}.old-{k}"):
        k += 1
    os.rename(src, f"{src}.old-{k}")
    os.makedirs(cfg.output_dir, exist_ok=True)
    return f"{src}.old-{k}"


def new_run_id() -> str:
    return uuid.uuid4().hex


KILL_ENV = "PDM_TEST_KILL_AT_SAVE_PHASE"
"""Test hook: `<phase>@<iteration>` (phases: tmp, written, manifest, moved_aside, renamed,
latest) makes rank 0 SIGKILL every rank and torchrun at that phase of that save."""


def _run_processes() -> list[int]:
    """Other processes of this torchrun job: the same MASTER_PORT and TORCHELASTIC_RUN_ID."""
    mine = (os.environ.get("MASTER_PORT"), os.environ.get("TORCHELASTIC_RUN_ID"))
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        theirs = tuple(env.get(k.encode(), b"").decode() or None
                       for k in ("MASTER_PORT", "TORCHELASTIC_RUN_ID"))
        if theirs == mine:
            out.append(int(name))
    return out


def _torchrun() -> int | None:
    """The nearest ancestor whose command line names torchrun."""
    pid = os.getppid()
    while pid > 1:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"torchrun" in f.read():
                    return pid
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return None
    return None


def save_hook(iteration: int):
    """The hook of KILL_ENV for the save of `iteration` (None when it does not apply)."""
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return None
    phase, _, it = spec.partition("@")
    if it and int(it) != iteration:
        return None

    def hook(name: str) -> None:
        if name != phase:
            return
        torchrun = _torchrun()
        for pid in _run_processes() + ([torchrun] if torchrun else []):
            try:  # the other ranks (each in its own session), then torchrun
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        os.kill(os.getpid(), signal.SIGKILL)
    return hook
