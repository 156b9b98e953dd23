"""Steps 1 and 2 benchmark: samples/s and TFLOP/s per step at ZeRO 0/2/3, with and without LoRA.

    DS_ACCELERATOR=cpu python benchmarks/step12.py                       # SmolLM2-135M, CPU
    python benchmarks/step12.py --model opt-1.3b --dtype bf16 --batch 8 --max_seq_len 512

Each configuration runs the real step script (``training/step1_supervised_finetuning/main.py`` or
``training/step2_reward_model_finetuning/main.py``) in this process for ``--warmup + --steps``
optimizer steps on the embedded data and reports the measured steps: samples/s (sequences for
step 1, pairs for step 2) and achieved TFLOP/s from upstream's FLOP formula over the (rows, columns)
each step really fed the model (padding columns are dropped before the forward pass; for step 2's reward
model, which ends in a one-output value head, without the formula's LM-head term). The first
configuration is the baseline of the ratio column. Results are appended to ``benchmarks/results.md``.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

SCRIPTS = {"step1": "training/step1_supervised_finetuning/main.py",
           "step2": "training/step2_reward_model_finetuning/main.py"}
DEFAULT_CONFIGS = "zero0,zero2,zero3,zero0+lora,zero2+lora"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="model folder, short name, or opt-1.3b / opt-350m (random weights)")
    p.add_argument("--steps_to_run", default="step1,step2", help="comma-separated: step1, step2")
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help=f"comma-separated zero<stage>[+lora] (default {DEFAULT_CONFIGS}); the first is the baseline")
    p.add_argument("--batch", type=int, default=4, help="per-device train batch (step 2: pairs)")
    p.add_argument("--max_seq_len", type=int, default=128)
    p.add_argument("--lora_dim", type=int, default=128)
    p.add_argument("--steps", type=int, default=4, help="measured optimizer steps")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dtype", default=None, choices=("fp16", "bf16", "fp32"), help="default: fp32 on CPU, bf16 on GPU")
    p.add_argument("--results", default=str(REPO / "benchmarks" / "results.md"), help="append here ('' : don't)")
    args = p.parse_args(argv)
    args.steps_to_run = [s.strip() for s in args.steps_to_run.split(",") if s.strip()]
    if not args.steps_to_run or any(s not in SCRIPTS for s in args.steps_to_run):
        p.error(f"--steps_to_run takes step1 and/or step2, got {args.steps_to_run}")
    args.configs = [parse_config(c, p) for c in args.configs.split(",") if c.strip()]
    return args


def parse_config(text: str, parser: argparse.ArgumentParser) -> tuple[int, bool]:
    parts = text.strip().split("+")
    if not parts[0].startswith("zero") or not parts[0][4:].isdigit() or int(parts[0][4:]) > 3 \
            or any(x != "lora" for x in parts[1:]):
        parser.error(f"bad configuration {text!r}: write zero<0-3> or zero<0-3>+lora")
    return int(parts[0][4:]), len(parts) > 1


def load_step(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"dschat_bench_{name}_main", REPO / SCRIPTS[name])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def step_flops(shapes: Sequence[tuple[int, int]], config: Any, factor: float, lm_head: bool = True) -> list[float]:
    """Upstream's training FLOPs of each step, over the rows and columns it fed the model; without
    ``lm_head``, less the formula's LM-head term (``V / 16 l h``): step 2's reward model ends in a value
    head of one output, not a vocabulary-wide LM head."""
    from dschat.runtime.perf import calculate_flops, get_hf_configs

    layers, hidden, vocab = get_hf_configs(config)
    out = []
    for rows, cols in shapes:
        flops = calculate_flops(factor, rows, cols, config)
        if not lm_head:
            whole = 1.0 + cols / (6.0 * hidden) + vocab / (16.0 * layers * hidden)
            flops *= (whole - vocab / (16.0 * layers * hidden)) / whole
        out.append(flops)
    return out


def summarise(times: Sequence[float], shapes: Sequence[tuple[int, int]], config: Any, factor: float,
              samples_per_row: float, lm_head: bool = True) -> dict[str, float]:
    """Median step time, samples/s and TFLOP/s over the measured steps (pure arithmetic); ``lm_head``
    as in :func:`step_flops`."""
    flops = step_flops(shapes, config, factor, lm_head)
    total = sum(times)
    return {
        "median_s": statistics.median(times),
        "samples_per_s": sum(rows * samples_per_row for rows, _ in shapes) / total,
        "tflops": sum(flops) / total / 1e12,
        "columns": statistics.fmean(cols for _, cols in shapes),
    }


def main(argv: Sequence[str] | None = None) -> list[str]:
    args = parse_args(argv)
    from deepspeed.accelerator import get_accelerator
    from transformers import AutoConfig

    from dschat.models.families import family_of
    from dschat.models.registry import resolve_model_path
    from dschat.runtime.perf import checkpoint_activations_factor
    from step3 import materialise, publish, versions

    on_gpu = get_accelerator().device_name() != "cpu"
    dtype = args.dtype or ("bf16" if on_gpu else "fp32")
    lines = []
    with tempfile.TemporaryDirectory(prefix="dschat-bench12-") as tmp:
        model = materialise(args.model, Path(tmp))
        config = AutoConfig.from_pretrained(resolve_model_path(model))
        lora_modules = family_of(config).lora_module_name
        rows_out = []
        for step in args.steps_to_run:
            module = load_step(step)
            for zero, lora in args.configs:
                argv_step = [
                    "--model_name_or_path", model, "--data_path", "dschat/builtin",
                    "--data_output_path", str(Path(tmp) / "data"), "--per_device_train_batch_size", str(args.batch),
                    "--per_device_eval_batch_size", str(args.batch), "--max_seq_len", str(args.max_seq_len),
                    "--zero_stage", str(zero), "--dtype", dtype, "--max_train_steps", str(args.warmup + args.steps),
                    "--num_warmup_steps", "0", "--output_dir", str(Path(tmp) / f"{step}-z{zero}-{int(lora)}"),
                ]
                if step == "step2":
                    argv_step += ["--eval_iters", "1", "--num_padding_at_beginning", "0"]
                if lora:
                    argv_step += ["--lora_dim", str(args.lora_dim), "--lora_module_name", lora_modules,
                                  "--only_optimize_lora"]
                result = module.main(argv_step)
                times = result.step_times[args.warmup:]
                shapes = result.step_shapes[args.warmup:]
                factor = checkpoint_activations_factor(False, args.lora_dim if lora else 0, config.hidden_size)
                # Step 2 rows are 2 per pair (chosen and rejected): a sample is a pair; its reward model
                # has a value head, no LM head.
                stats = summarise(times, shapes, config, factor, 0.5 if step == "step2" else 1.0,
                                  lm_head=step != "step2")
                rows_out.append((step, f"ZeRO-{zero}" + (f" + LoRA {args.lora_dim}" if lora else ""), stats))

    base = {step: next(s for st, _, s in rows_out if st == step) for step in args.steps_to_run}
    device = get_accelerator().device_name()
    command = "python benchmarks/step12.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    lines += [
        f"### steps 1-2, {datetime.date.today().isoformat()}: {args.model}, batch {args.batch}, max_seq_len "
        f"{args.max_seq_len}, {dtype}",
        "",
        f"- device: {device}; {versions()}",
        f"- command: `{command}`",
        f"- {args.steps} measured optimizer steps after {args.warmup} warm-up; step-2 samples are pairs; "
        "step 2's TFLOP/s leave out the formula's LM-head term (a reward model has a value head)",
        "",
        "| step | configuration | median s/step | samples/s | TFLOP/s | columns/step | samples/s vs first |",
        "|---|---|---|---|---|---|---|",
    ]
    for step, name, s in rows_out:
        lines.append(f"| {step} | {name} | {s['median_s']:.2f} | {s['samples_per_s']:.2f} | {s['tflops']:.4f} | "
                     f"{s['columns']:.1f} | {s['samples_per_s'] / base[step]['samples_per_s']:.2f}x |")
    lines.append("")
    return publish(lines, args.results)


if __name__ == "__main__":
    main()
