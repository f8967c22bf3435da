"""The benchmark's grid: methods (loss presets), stress settings (driver config overrides), sizes.

Every stress setting is plain driver config keys (train.epochs_per_batch, rollout.local.staleness,
rollout.rollout_precision, train.lr), so any cell can be rerun by hand with `--set`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# method name -> loss preset (megatron_pdm/config.py PRESETS; thresholds as the papers recommend)
METHODS: dict[str, str] = {
    "no-trust-region": "is-pg",
    "grpo-clip-higher": "grpo",
    "dppo-binary-tv": "dppo-binary-tv",
    "dppo-topk-tv": "dppo-topk-tv",
    "dppo-topk-kl": "dppo-topk-kl",
    "pdm-agg": "pdm-agg",
    "pdm-uniform": "pdm-uniform",
    "pdm-exact": "pdm-exact",
    "drpo": "drpo",
    # the off-policy corrections of docs/math.md §10 (no trust region), as verl 0.9.1 presets them
    "tis": "tis",
    "icepop": "icepop",
    "geo-rs": "geo-rs",
}

BASE_LR = 3e-4  # examples/tiny_cpu/config.yaml train.lr

# setting name -> driver overrides. "base": one epoch, on-policy, bf16 engine, 1x lr.
SETTINGS: dict[str, list[str]] = {
    "base": [],
    "epochs4": ["train.epochs_per_batch=4"],
    "epochs16": ["train.epochs_per_batch=16"],
    "stale2": ["rollout.local.staleness=2"],
    "stale8": ["rollout.local.staleness=8"],
    "engine-fp32": ["rollout.rollout_precision=fp32"],
    "engine-fp8": ["rollout.rollout_precision=fp8"],
    "lr4x": [f"train.lr={4 * BASE_LR}"],
    # the real vLLM CPU server in bf16 behind an fp32 trainer (needs .venv-vllm: make vllm-venv);
    # the server is started per run by SERVER_SETTINGS' launcher, `{vllm_url}` filled in by it
    "engine-vllm-bf16": ["rollout.engine=vllm", "rollout.vllm.url={vllm_url}"],
    # the real model's steps-per-batch stress (--model real, stability/profiles.py: its lr is
    # 5e-6, one step per batch): the batch in 4 minibatches (4 optimizer steps per rollout batch,
    # the same compute as one) at a larger lr
    "real-mb4-lr2e-5": ["train.minibatches_per_iteration=4", "train.lr=2e-5"],
    "real-mb4-lr5e-5": ["train.minibatches_per_iteration=4", "train.lr=5e-5"],
    # the smoke setting: both queue-based keys at once, measurable within 2 iterations
    "smoke-stale1-epochs2": ["rollout.local.staleness=1", "train.epochs_per_batch=2"],
}
# settings whose runs need a real engine server: setting -> vLLM launcher args
# (megatron_pdm.train.rollout.vllm_server)
SERVER_SETTINGS: dict[str, list[str]] = {"engine-vllm-bf16": ["--dtype", "bfloat16"]}
# the default grid needs no server (the vLLM setting is asked for by name: --settings ...)
# (and the real model's settings, "real-...", are asked for by name too)
DEFAULT_SETTINGS = [s for s in SETTINGS if not s.startswith(("smoke", "real-"))
                    and s not in SERVER_SETTINGS]
SMOKE_METHODS = ["no-trust-region", "pdm-agg"]
SMOKE_SETTINGS = ["smoke-stale1-epochs2"]

# Sizes of every run (TP=1, one process: cheaper than TP=2 for the tiny model). 12 iterations:
# every grid and confirmatory run of docs/stability.md; the no-trust-region row collapses within
# them at epochs16, and the default grid (12 methods x 8 settings x 3 seeds) fits about 2 h on
# 2 cores with two cells side by side (--jobs).
SIZES: list[str] = [
    "parallel.tp=1", "train.iterations=12", "train.minibatches_per_iteration=1",
    "rollout.prompts_per_iteration=16", "rollout.group_size=8", "train.eval_prompts=128",
    "log.plot=false", "log.progress=false", "log.tensorboard=false",
    "checkpoint.save_interval=0", "checkpoint.allow_fresh_start=true",
]
SMOKE_SIZES: list[str] = [
    "parallel.tp=1", "train.iterations=2", "train.minibatches_per_iteration=1",
    "rollout.prompts_per_iteration=4", "rollout.group_size=4", "train.eval_prompts=16",
    "log.plot=false", "log.progress=false", "log.tensorboard=false",
    "checkpoint.save_interval=0", "checkpoint.allow_fresh_start=true",
]
SMOKE_WARMUP: list[str] = ["warmup.steps=10", "warmup.batch_size=16",
                           "warmup.stop_at_accuracy=null"]


@dataclass(frozen=True)
class Cell:
    method: str
    setting: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.method}__{self.setting}__s{self.seed}"


@dataclass
class Grid:
    methods: list[str]
    settings: list[str]
    seeds: list[int]
    sizes: list[str] = field(default_factory=lambda: list(SIZES))
    # launcher arguments for every cell's own vLLM server (the real-model profile,
    # stability/profiles.py); None: only the SERVER_SETTINGS cells get a server
    server: list[str] | None = None

    def __post_init__(self) -> None:
        for kind, names, known in (("method", self.methods, METHODS),
                                   ("setting", self.settings, SETTINGS)):
            bad = [n for n in names if n not in known]
            if bad:
                raise ValueError(f"unknown {kind}(s) {bad}; known: {sorted(known)}")
        if not self.seeds:
            raise ValueError("the grid needs at least one seed")

    def cells(self) -> list[Cell]:
        """Seed-major order: a grid stopped early has complete method sets for its first seeds."""
        return [Cell(m, s, seed) for seed in self.seeds for s in self.settings
                for m in self.methods]

    def overrides(self, cell: Cell) -> list[str]:
        return [*self.sizes, *SETTINGS[cell.setting], f"seed={cell.seed}"]

    def launcher(self, cell: Cell, config: str) -> list[str]:
        """The command prefix that starts this cell's engine server around its driver run
        (megatron_pdm.train.rollout.vllm_server ... --), or [] when the cell needs no server."""
        if self.server is None and cell.setting not in SERVER_SETTINGS:
            return []
        import sys

        return [sys.executable, "-m", "megatron_pdm.train.rollout.vllm_server", "--config",
                config, "--set", f"seed={cell.seed}", *(self.server or []),
                *SERVER_SETTINGS.get(cell.setting, []), "--"]
