"""Where a driver run's iterations spend their time, from its own metrics (metrics.jsonl).

    python benchmarks/iteration_profile.py RUN_DIR [RUN_DIR ...] --out-dir results/real_profile

Per iteration (the row of its last optimizer step): rollout (the trainer waits for the engine),
forward + backward, the optimizer's update, the rest of the step (metric reduction), the weight
push, and what is left of the iteration (scoring, packing, logging); the engine is idle for
everything but the rollout (the driver does not overlap them unless rollout.overlap is set).
Writes `<out-dir>/profile.json` and `profile.md` (one table per run, then the medians).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

PHASES = ("rollout", "fwd_bwd", "optimizer", "step_rest", "push", "other", "iteration")


def iteration_phases(row: dict) -> dict:
    """The phases of one iteration (seconds) from its last row's `time/*` keys."""
    it = row["time/iteration_s"]
    step = row["time/train_step_s"]
    p = {"rollout": row["time/rollout_s"], "fwd_bwd": row["time/fwd_bwd_s"],
         "optimizer": row["time/optimizer_s"],
         "step_rest": step - row["time/fwd_bwd_s"] - row["time/optimizer_s"],
         "push": row["time/weight_sync_s"], "iteration": it}
    p["other"] = it - p["rollout"] - step - p["push"]
    p["engine_idle_frac"] = 1.0 - p["rollout"] / it
    p["pad_frac"] = row.get("rollout/pad_frac", float("nan"))
    p["response_len"] = row["rollout/response_len"]
    return p


def profile(run_dir: str) -> list[dict]:
    last: dict = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            last[r["iteration"]] = r
    return [{"index": k, **iteration_phases(last[k])} for k in sorted(last)]


def markdown(name: str, rows: list[dict]) -> str:
    head = ("| iteration | rollout (trainer waits) | forward + backward | optimizer | rest of step "
            "| push | other | total | engine idle | padded slots |")
    out = [f"**{name}**", "", head, "|" + "---|" * 10]

    def line(label, r):
        tot = r["iteration"]
        cells = [f"{r[k]:.1f} ({100 * r[k] / tot:.0f}%)" for k in PHASES[:-1]]
        return (f"| {label} | " + " | ".join(cells) + f" | {tot:.1f} | "
                f"{100 * r['engine_idle_frac']:.0f}% | {100 * r['pad_frac']:.0f}% |")

    for r in rows:
        out.append(line(str(r["index"]), r))
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "index"}
    out.append(line("median", med))
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dirs", nargs="+")
    p.add_argument("--out-dir", default="results/real_profile")
    a = p.parse_args(argv)
    res = {d: profile(d) for d in a.run_dirs}
    facts = {}
    for d in a.run_dirs:
        with open(os.path.join(d, "summary.json")) as f:
            s = json.load(f)
        facts[d] = {k: s.get(k) for k in ("preset", "seed", "torch_threads", "wall_s")}
    from megatron_pdm.hostinfo import cpu_model

    cpu = cpu_model()
    os.makedirs(a.out_dir, exist_ok=True)
    with open(os.path.join(a.out_dir, "profile.json"), "w") as f:
        json.dump({"runs": res, "facts": facts, "cpu": cpu, "cores": os.cpu_count(),
                   "command": "python benchmarks/iteration_profile.py " + " ".join(a.run_dirs)
                   + f" --out-dir {a.out_dir}", "load_avg_now": os.getloadavg()}, f, indent=1)
    md = "\n\n".join(markdown(d, rows) for d, rows in res.items())
    with open(os.path.join(a.out_dir, "profile.md"), "w") as f:
        f.write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
