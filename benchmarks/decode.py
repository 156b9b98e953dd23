"""Decoding alone: dschat's CPU/GPU sampling loop against dschat's Hybrid Engine, on one model.

    DS_ACCELERATOR=cpu python benchmarks/decode.py --model smollm2-135m   # the embedded SmolLM2, fp32
    DS_ACCELERATOR=cpu python benchmarks/decode.py --model tiny-llama

No DeepSpeed engine and no training: the bare Hugging Face model decodes the builtin held-out
prompts (``--batch`` rows, left-padded) greedily for exactly ``--new_tokens`` tokens with

* ``loop``: today's module path -- :func:`dschat.rlhf.rollout.sample_loop.sample_loop` on the module, with
  oneDNN decode linears on a CPU (``--cpu_decode_linear onednn``, packed at each rollout), or
* ``engine``: :class:`dschat.rlhf.rollout.dschat_engine.DschatHybridEngine` (weights refreshed into the
  inference layout at each rollout, prefill, static-cache decode steps).

Each mode runs ``--warmup`` + ``--repeats`` rollouts, the modes taking turns; per mode it prints the median rollout time,
the median time per decode step (rollout minus refresh and prefill, over ``new_tokens - 1`` steps)
and that of the fastest rollout (on a shared machine, the one least slowed by other loads),
and whether the greedy tokens equal the other mode's. Results are appended to
``benchmarks/results.md`` (``--results``).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dschat.rlhf.rollout.dschat_engine import DschatHybridEngine  # noqa: E402
from dschat.rlhf.rollout.sample_loop import onednn_decode_linears, onednn_decode_supported, sample_loop  # noqa: E402
from dschat.rlhf.rollout.sampling import DecodingSettings  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from step3 import publish  # noqa: E402  (one results format for every benchmark)

MODES = ("loop", "engine")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a model folder or dschat short name")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default=None, choices=("fp32", "bf16", "fp16"), help="default: fp32 on CPU, bf16 on GPU")
    p.add_argument("--modes", default="loop,engine", help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--results", default=str(REPO / "benchmarks" / "results.md"), help="append here ('': don't)")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in MODES for m in args.modes):
        p.error(f"--modes must list some of {', '.join(MODES)}, got {args.modes!r}")
    if min(args.batch, args.new_tokens, args.repeats) < 1 or args.warmup < 0:
        p.error("--batch, --new_tokens and --repeats must be >= 1, --warmup >= 0")
    return args


def prompts_for(tokenizer: Any, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    from dschat.eval.heldout import heldout_prompts

    rows = [tokenizer(t)["input_ids"] for t in heldout_prompts()[:batch]]
    width = max(map(len, rows))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_loop(model: Any, ids: torch.Tensor, mask: torch.Tensor, n: int, eos: int, pad: int) -> tuple[torch.Tensor, float, float]:
    """One rollout with today's loop: (sequences, total s, s before the first decode step)."""
    device = ids.device
    onednn = onednn_decode_supported(model) is None
    _sync(device)
    t0 = time.perf_counter()
    with onednn_decode_linears(model, ids.shape[0]) if onednn else nullcontext():
        t_pack = time.perf_counter()
        # The prefill is the first forward; time it apart with a 1-token rollout.
        sample_loop(model, ids, mask, decoding=DecodingSettings("greedy"), max_new_tokens=1, eos_token_id=eos,
                    pad_token_id=pad)
        _sync(device)
        t_prefill = time.perf_counter() - t_pack
        t1 = time.perf_counter()
        out = sample_loop(model, ids, mask, decoding=DecodingSettings("greedy"), max_new_tokens=n, min_new_tokens=n,
                          eos_token_id=eos, pad_token_id=pad)
        _sync(device)
    total = (t_pack - t0) + time.perf_counter() - t1
    return out.sequences, total, (t_pack - t0) + t_prefill


def time_engine(engine: DschatHybridEngine, model: Any, ids: torch.Tensor, mask: torch.Tensor, n: int) -> tuple[torch.Tensor, float, float]:
    device = ids.device
    _sync(device)
    t0 = time.perf_counter()
    engine.refresh(model)
    engine.max_new_tokens = 1
    engine.decode(ids, mask, min_new_tokens=1)  # refresh + prefill (+ packing on a CPU), timed apart
    _sync(device)
    before_steps = time.perf_counter() - t0
    engine.max_new_tokens = n
    t1 = time.perf_counter()
    out = engine.rollout(model, ids, mask, min_new_tokens=n)
    _sync(device)
    return out.sequences, time.perf_counter() - t1, before_steps


def main(argv: Sequence[str] | None = None) -> list[str]:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM

    from dschat.models.registry import resolve_model_path
    from dschat.models.tokenizer import load_hf_tokenizer

    device = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu" else "cpu")
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    path = resolve_model_path(args.model)
    tokenizer = load_hf_tokenizer(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    ids, mask = prompts_for(tokenizer, args.batch, device)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    engine = DschatHybridEngine(model.config, decoding=DecodingSettings("greedy"), max_new_tokens=args.new_tokens,
                                eos_token_id=eos, pad_token_id=pad)
    seqs: dict[str, torch.Tensor] = {}
    totals: dict[str, list[float]] = {m: [] for m in args.modes}
    befores: dict[str, list[float]] = {m: [] for m in args.modes}
    # The modes take turns, rollout by rollout, so a load that comes and goes (a shared machine) is
    # spread over both.
    for i in range(args.warmup + args.repeats):
        for mode in args.modes:
            with torch.no_grad():
                if mode == "loop":
                    seq, total, before = time_loop(model, ids, mask, args.new_tokens, eos, pad)
                else:
                    seq, total, before = time_engine(engine, model, ids, mask, args.new_tokens)
            seqs[mode] = seq
            if i >= args.warmup:
                totals[mode].append(total)
                befores[mode].append(before)
            print(f"[{mode}] rollout {i}{' (warm-up)' if i < args.warmup else ''}: {total:.3f} s, "
                  f"before the first decode step {before:.3f} s", flush=True)
    rows = []
    steps = max(args.new_tokens - 1, 1)
    for mode in args.modes:
        total, before = statistics.median(totals[mode]), statistics.median(befores[mode])
        # The fastest rollout (on a shared machine, the one least slowed by other loads) less the median
        # time before its first decode step.
        best = min(totals[mode]) - before
        rows.append((mode, total, before, 1000 * (total - before) / steps, 1000 * best / steps))
    same = len(seqs) == 2 and torch.equal(*seqs.values())
    device_name = (torch.cuda.get_device_name(device) if device.type == "cuda" else
                   f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)")
    command = "python benchmarks/decode.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    import transformers

    lines = [
        f"### decoding, {datetime.date.today().isoformat()}: {args.model}, {args.batch} rows x {args.new_tokens} "
        f"greedy tokens, prompt width {ids.shape[1]}, {dtype_name}",
        "",
        f"- device: {device_name}; torch {torch.__version__}, transformers {transformers.__version__}",
        f"- command: `{command}`",
        f"- median of {args.repeats} rollouts after {args.warmup} warm-up; greedy tokens of the two modes "
        + ("equal" if same else "differ" if len(seqs) == 2 else "not compared"),
        "- loop: dschat's sample_loop on the module (oneDNN decode linears on a CPU); engine: dschat's Hybrid Engine "
        "(in-place refresh into the inference layout, prefill, static KV cache)",
        "",
        "| mode | rollout s (median) | refresh + pack + prefill s (median) | ms per decode step (median) | "
        "ms per decode step (fastest rollout) |",
        "|---|---|---|---|---|",
        *(f"| {m} | {t:.3f} | {b:.3f} | {s:.1f} | {f:.1f} |" for m, t, b, s, f in rows),
        "",
    ]
    return publish(lines, args.results)


if __name__ == "__main__":
    main()
