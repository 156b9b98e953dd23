#!/usr/bin/env python
"""GRPO, GRPO with DAPO's options, and GSPO on the CPU RLVR demo, over several seeds.

For each seed this runs e2e's step 1 once (the SFT actor, ``python e2e_rlhf.py --step 1 --seed S``),
then step 3 of the RLVR demo (``--algorithm grpo --reward-fn dschat.rewards:gold``: the recipe of
``configs/step3.yaml``, 20 steps of 2 prompts x 4 answers) once per configuration, with
``--eval_prompts 64 --eval_interval 20`` so that step 3's own held-out evaluation (the gold judge,
before the first step and after the last) measures the gain. The configurations:

* ``grpo``: the recipe as it is;
* ``dapo``: ``--cliprange_high 0.28 --loss_aggregation token --dynamic_sampling --max_sampling_rounds 3
  --overlong_buffer_len 12 --overlong_penalty_factor 1.0`` (DAPO's four techniques; its buffer is
  a quarter of the 48-token answer budget);
* ``gspo``: ``--importance_sampling_level sequence --cliprange 3e-4 --cliprange_high 4e-4`` (GSPO's
  clip range).

Prints one Markdown row per configuration: the held-out gold gain from the evaluation before the
first step to the last one, in paired standard errors (per seed and pooled), the mean seconds per
step, and the groups dynamic sampling dropped and the rounds it used. Also writes ``OUT/table.json``.

Usage: ``OMP_NUM_THREADS=1 python benchmarks/rlvr_options.py --out DIR [--seeds 1234 42 7] [--configs grpo dapo
gspo]`` (about 2 minutes per step 1 and 5 per step 3 on a quiet 2-core CPU; on a shared one, one
thread per run avoids OpenMP's spinning when the cores are oversubscribed). A configuration whose
``metrics.jsonl`` already holds the final evaluation is not run again.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIGS: dict[str, list[str]] = {
    "grpo": [],
    "dapo": ["--cliprange_high", "0.28", "--loss_aggregation", "token", "--dynamic_sampling",
             "--max_sampling_rounds", "3", "--overlong_buffer_len", "12", "--overlong_penalty_factor", "1.0"],
    "gspo": ["--importance_sampling_level", "sequence", "--cliprange", "3e-4", "--cliprange_high", "4e-4"],
}
EVAL_PROMPTS = 64


def e2e_runs(seed: int, out: Path):
    """e2e's three step runs for the RLVR demo at ``seed`` under ``out``."""
    import e2e_rlhf

    config = e2e_rlhf.load_e2e_config()
    args = e2e_rlhf.parse_args(["--algorithm", "grpo", "--reward-fn", e2e_rlhf.GOLD_REWARD_FN, "--seed", str(seed),
                                "--output-dir", str(out), "--deployment-type", "cpu"], config)
    dep = e2e_rlhf.pick_deployment(args, config)
    args.actor_model = args.actor_model or dep.default_actor or config.default_actor
    args.reward_model = args.reward_model or dep.default_reward or config.default_reward
    return e2e_rlhf.build_steps(args, dep)


def launch(recipe, params, extra, log: Path, unset: tuple[str, ...] = ()) -> float:
    from dschat.launch import plan, run

    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    step = plan(recipe, params, extra, unset=unset, repo_root=REPO)
    print(f"  running {step.command_line()}\n  log: {log}", flush=True)
    with log.open("wb") as f:
        result = run(step, sink=f.write, log=False)
    if result.returncode != 0:
        raise SystemExit(f"the run failed (exit {result.returncode}); see {log}")
    return time.monotonic() - start


def finished(metrics: Path, last_step: int) -> bool:
    return metrics.is_file() and any(r.get("kind") == "eval" and r.get("global_step") == last_step
                                     for r in map(json.loads, metrics.read_text().splitlines()))


def summarise(metrics: Path) -> dict[str, float]:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    evals = [r for r in records if r.get("kind") == "eval"]
    steps = [r for r in records if r.get("kind") != "eval" and "time_training" in r]
    first, last = evals[0]["per_prompt"]["gold"], evals[-1]["per_prompt"]["gold"]
    diffs = [b - a for a, b in zip(first, last)]
    n = len(diffs)
    mean = sum(diffs) / n
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n) if n > 1 else math.nan
    seconds = [r["time_generation"] + r["time_experience"] + r["time_training"] for r in steps]
    return {"gold_before": sum(first) / n, "gold_after": sum(last) / n, "gain": mean, "gain_se": se, "prompts": n,
            "diffs": diffs, "seconds_per_step": sum(seconds) / len(seconds) if seconds else math.nan,
            "dropped_groups": sum(r.get("dropped_groups", 0) for r in steps),
            "sampling_rounds": sum(r.get("sampling_rounds", 1) for r in steps) / max(len(steps), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, 42, 7])
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=["grpo", "dapo", "gspo"])
    parser.add_argument("--summary_only", action="store_true",
                        help="run nothing: the table of the runs already finished under --out")
    cli = parser.parse_args()
    table: dict[str, dict[int, dict[str, float]]] = {c: {} for c in cli.configs}
    for seed in cli.seeds:
        root = cli.out / f"seed{seed}"
        runs = e2e_runs(seed, root)
        sft = runs[0]
        step3 = runs[2]
        last = int(step3.recipe.flag("test_stop_step") or 0)
        if cli.summary_only:
            for name in cli.configs:
                if finished(root / name / "metrics.jsonl", last):
                    table[name][seed] = summarise(root / name / "metrics.jsonl")
            continue
        if not (sft.output_dir / "config.json").is_file():
            print(f"seed {seed}: step 1", flush=True)
            launch(sft.recipe, sft.params, sft.extra, root / "step1.log")
        for name in cli.configs:
            out = root / name
            params = {**step3.params, "output_dir": str(out), "critic_model": str(sft.output_dir)}
            if not finished(out / "metrics.jsonl", last):
                print(f"seed {seed}: step 3, {name}", flush=True)
                # Scored by the gold judge alone, without a critic: no step-2 model is read.
                launch(step3.recipe, params, [*step3.extra, "--eval_prompts", str(EVAL_PROMPTS),
                                              "--eval_interval", str(last), *CONFIGS[name]],
                       root / f"{name}.log", unset=("critic_model_name_or_path",))
            table[name][seed] = summarise(out / "metrics.jsonl")
    cli.out.mkdir(parents=True, exist_ok=True)  # --summary_only on a folder no run has made yet
    (cli.out / "table.json").write_text(json.dumps(table, indent=1))
    print("| configuration | " + " | ".join(f"seed {s}" for s in cli.seeds)
          + " | pooled | s/step | dropped groups (rounds/step) |")
    print("|---" * (len(cli.seeds) + 4) + "|")
    for name, per_seed in table.items():
        if not per_seed:
            print(f"| {name} | " + " | ".join("not run" for _ in cli.seeds) + " | | | |")
            continue
        cells = [(f"{r['gold_before']:.3f} -> {r['gold_after']:.3f} ({r['gain'] / r['gain_se']:+.1f} SE)"
                  if r["gain_se"] > 0 else f"{r['gain']:+.3f}") if (r := per_seed.get(s)) else "not run"
                 for s in cli.seeds]
        diffs = [d for r in per_seed.values() for d in r["diffs"]]
        mean = sum(diffs) / len(diffs)
        se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))
        secs = sum(r["seconds_per_step"] for r in per_seed.values()) / len(per_seed)
        dropped = sum(r["dropped_groups"] for r in per_seed.values())
        rounds = sum(r["sampling_rounds"] for r in per_seed.values()) / len(per_seed)
        print(f"| {name} | " + " | ".join(cells) + f" | {mean:+.3f} ± {se:.3f} | {secs:.1f} | {dropped} ({rounds:.2f}) |")


if __name__ == "__main__":
    main()
