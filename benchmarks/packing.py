"""Sequence packing alone: one model's forward and backward over a step-3 batch, padded or packed.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python benchmarks/packing.py     # the embedded SmolLM2, fp32
    python benchmarks/packing.py --model tiny-llama --batches 2           # a smoke run

No DeepSpeed engine: the bare Hugging Face model computes the log-probs of ``--batches`` rollout-like
batches (``--batch`` rows: builtin held-out prompts, left-padded, then answers of random tokens with
lengths drawn from ``[(1 - --answer_spread) x --answer_len, --answer_len]``, EOS and padding after
them) and the backward of their sum, as step 3's PPO update does, in each layout:

* ``padded``: the batch as it is (``--sequence_packing off``);
* ``chosen``: :func:`dschat.models.packing.pack_rows` with the model's attention span (what
  ``--sequence_packing auto`` runs);
* ``fewest-slots``: the packed layout with the fewest slots, rows of any width (attention ignored:
  usually one row);
* ``padded-width``: the fewest slots in rows no wider than the padded batch (padded when no row can
  take two sequences).

The layouts take turns batch by batch, so a load that comes and goes (a shared machine) is spread
over all of them. Per layout it prints the mean process CPU time and wall time per batch and the
slots computed (rows x width). Results are appended to ``benchmarks/results.md`` (``--results``).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dschat.models.packing import attention_span, pack_rows  # noqa: E402
from dschat.models.reward_model import positions_from_mask  # noqa: E402
from dschat.rlhf.scoring_passes import token_log_probs  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from step3 import prompt_batches, publish  # noqa: E402  (one results format for every benchmark)

LAYOUTS = ("padded", "chosen", "fewest-slots", "padded-width")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a model folder or dschat short name")
    p.add_argument("--batch", type=int, default=8, help="rows per batch (the CPU demo's rollout: 8)")
    p.add_argument("--answer_len", type=int, default=48, help="the longest answer (the CPU demo's --max_answer_seq_len)")
    p.add_argument("--answer_spread", type=float, default=0.6, help="answers are (1 - F) x to 1 x --answer_len long")
    p.add_argument("--batches", type=int, default=8, help="measured batches per layout (after one warm-up)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--results", default=str(REPO / "benchmarks" / "results.md"), help="append here ('': don't)")
    args = p.parse_args(argv)
    if not 0.0 <= args.answer_spread <= 1.0 or min(args.batch, args.answer_len, args.batches) < 1:
        p.error("--answer_spread must be within [0, 1]; --batch, --answer_len and --batches >= 1")
    return args


def rollout_batch(prompts: torch.Tensor, prompt_mask: torch.Tensor, answer_len: int, spread: float, vocab: int,
                  eos: int, pad: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, position ids) of prompts (B, P) followed by answers of drawn lengths."""
    B = prompts.shape[0]
    shortest = max(2, int(round((1.0 - spread) * answer_len)))
    lengths = torch.randint(shortest, answer_len + 1, (B,), generator=generator)
    answers = torch.randint(3, vocab, (B, int(lengths.max())), generator=generator)
    cols = torch.arange(answers.shape[1])[None, :]
    answers = torch.where(cols == lengths[:, None] - 1, eos, torch.where(cols >= lengths[:, None], pad, answers))
    ids = torch.cat([prompts, answers], dim=1)
    mask = torch.cat([prompt_mask, (cols < lengths[:, None]).long()], dim=1)
    return ids, mask, positions_from_mask(mask)


def layouts(ids: torch.Tensor, mask: torch.Tensor, span: int | None) -> dict[str, Any]:
    return {"padded": None, "chosen": pack_rows(ids, mask, span=span),
            "fewest-slots": pack_rows(ids, mask, max_width=int(mask.sum())),
            "padded-width": pack_rows(ids, mask, max_width=1)}


def main(argv: Sequence[str] | None = None) -> list[str]:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM

    from dschat.data.collators import drop_padding_columns
    from dschat.models.registry import resolve_model_path
    from dschat.models.tokenizer import load_hf_tokenizer

    torch.manual_seed(args.seed)
    tokenizer = load_hf_tokenizer(args.model)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(args.model), dtype=torch.float32).train()
    span = attention_span(model)
    generator = torch.Generator().manual_seed(args.seed)
    batches = []
    for prompts, prompt_mask in prompt_batches(tokenizer, args.batch, 64, args.batches + 1):
        trimmed = drop_padding_columns({"prompt": prompts, "prompt_att_mask": prompt_mask}, "prompt_att_mask", side="left")
        batches.append(rollout_batch(trimmed["prompt"], trimmed["prompt_att_mask"], args.answer_len, args.answer_spread,
                                     model.config.vocab_size, tokenizer.eos_token_id, tokenizer.pad_token_id,
                                     generator))
    cpu: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    wall: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    slots: dict[str, list[int]] = {name: [] for name in LAYOUTS}
    real = padded_slots = 0
    for i, (ids, mask, positions) in enumerate(batches):
        options = layouts(ids, mask, span)
        order = LAYOUTS if i % 2 == 0 else LAYOUTS[::-1]  # the layouts take turns
        for name in order:
            packed = options[name]
            model.zero_grad(set_to_none=True)
            c, w = time.process_time(), time.perf_counter()
            log_probs = token_log_probs(model, ids, mask, positions, packed)
            log_probs[mask[:, 1:].bool()].sum().backward()
            c, w = time.process_time() - c, time.perf_counter() - w
            if i > 0:  # the first batch warms up
                cpu[name].append(c)
                wall[name].append(w)
                slots[name].append(ids.numel() if packed is None else packed.input_ids.numel())
            print(f"[{name}] batch {i}{' (warm-up)' if i == 0 else ''}: {c:.2f} s CPU, {w:.2f} s wall, "
                  f"{'padded' if packed is None else tuple(packed.input_ids.shape)}", flush=True)
        if i > 0:
            real += int(mask.sum())
            padded_slots += ids.numel()
    n = args.batches
    device = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    command = "python benchmarks/packing.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    base = sum(cpu["padded"]) / n
    import transformers

    lines = [
        f"### sequence packing, {datetime.date.today().isoformat()}: {args.model}, {args.batch} rows, answers "
        f"{1 - args.answer_spread:.0%}-100 % of {args.answer_len} tokens, fp32, forward + backward",
        "",
        f"- device: {device}; torch {torch.__version__}, transformers {transformers.__version__}",
        f"- command: `{command}`",
        f"- {n} batches per layout after 1 warm-up, the layouts taking turns; real tokens {real / n:.1f} of "
        f"{padded_slots / n:.1f} padded slots per batch; attention span of the model {span}",
        "",
        "| layout | slots per batch | CPU s per batch | wall s per batch | padded CPU time / this |",
        "|---|---|---|---|---|",
        *(f"| {name} | {sum(slots[name]) / n:.1f} | {sum(cpu[name]) / n:.2f} | {sum(wall[name]) / n:.2f} | "
          f"{base / (sum(cpu[name]) / n):.2f}x |" for name in LAYOUTS),
        "",
    ]
    return publish(lines, args.results)


if __name__ == "__main__":
    main()
