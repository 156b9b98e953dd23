"""Preference pairs from an actor's own answers, labelled by the gold judge: the embedded
``dschat/builtin-samples`` data, and the script that makes it.

``dschat/builtin``'s pairs come from a template grammar. A reward model trained on them alone
ranks the grammar's answers well but tracks the judge poorly on the text an SFT actor writes,
which is what step 3 scores (docs/demo_experiments.md). These pairs are drawn the way InstructGPT
drew its comparisons: several answers of the SFT actor to each training prompt, compared by the
labeller (here the gold judge; the answer it scores higher by at least
:data:`dschat.data.builtin.MIN_MARGIN` is ``chosen``).

The shipped files were made from the CPU recipe's step-1 actor trained with ``--seed 3``, a seed
the demo's table (docs/getting-started.md) does not measure, on the prompts of ``dschat/builtin``'s train split only, so the
held-out prompts stay unseen. Regenerate (its time: benchmarks/results.md)::

    python e2e_rlhf.py --step 1 --seed 3 --output-dir /tmp/s3
    python -m dschat.eval.sample_pairs --actor /tmp/s3/actor-models/smollm2-135m \\
        --out dschat/data/builtin_prefs/samples
"""
from __future__ import annotations

import argparse
import itertools
import math
import random
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from dschat.data.builtin import MIN_MARGIN, distinct_prompts, samples_dir, write
from dschat.errors import UserError, cli_main
from dschat.eval import scoring
from dschat.eval.heldout import EvalSettings
from dschat.gold_judge import gold_score
from dschat.runtime.fs import check_writable_dir

DEFAULT_DRAWS = 4
DEFAULT_SEED = 500  # the shipped files: draws seeded 500-503
DEFAULT_TEMPERATURE = 0.7  # the CPU recipe's step-3 and report temperature
DEFAULT_MAX_NEW_TOKENS = 48  # the CPU recipe's --max_answer_seq_len
DEFAULT_PAIRS_PER_PROMPT = 6  # every pair of 4 draws
DEFAULT_EVAL_PROMPTS = 40


def train_prompts() -> list[str]:
    """Distinct prompts of ``dschat/builtin``'s train split, in first-appearance order."""
    return distinct_prompts("train")


def make_pairs(
    answers: Iterable[Mapping[str, str]], *, per_prompt: int = DEFAULT_PAIRS_PER_PROMPT,
    margin: float = MIN_MARGIN, seed: int = 0,
) -> list[dict[str, str]]:
    """Pairs of distinct answers to the same prompt that the gold judge separates by ``margin``.

    ``answers``: dicts with ``prompt`` and ``answer``. Per prompt, at most ``per_prompt`` pairs,
    drawn at random among the qualifying ones; blank answers are skipped. Returns shuffled rows
    ``{"prompt", "chosen", "rejected"}`` with ``chosen`` the judge's better answer.
    """
    by_prompt: dict[str, list[str]] = defaultdict(list)
    for item in answers:
        if item["answer"].strip() and item["answer"] not in by_prompt[item["prompt"]]:
            by_prompt[item["prompt"]].append(item["answer"])
    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    for prompt, texts in by_prompt.items():
        scored = [(text, gold_score(prompt, text)) for text in texts]
        candidates = [(a, b) for a, b in itertools.combinations(scored, 2) if abs(a[1] - b[1]) >= margin]
        rng.shuffle(candidates)
        for a, b in candidates[:per_prompt]:
            (chosen, _), (rejected, _) = (a, b) if a[1] > b[1] else (b, a)
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    rng.shuffle(rows)
    return rows


def split_by_prompt(rows: Sequence[Mapping[str, str]], eval_prompts: int, seed: int = 0) -> dict[str, list]:
    """``train`` and ``eval`` rows on disjoint prompts: the pairs of ``eval_prompts`` prompts are held out."""
    prompts = sorted({row["prompt"] for row in rows})
    held = set(random.Random(seed).sample(prompts, min(eval_prompts, len(prompts))))
    return {
        "train": [dict(row) for row in rows if row["prompt"] not in held],
        "eval": [dict(row) for row in rows if row["prompt"] in held],
    }


def sample_answers(actor: str | Path, prompts: Sequence[str], *, draws: int, seed: int, temperature: float,
                   max_new_tokens: int, batch_size: int = 32, device: str = "auto") -> list[dict[str, str]]:
    """``draws`` seeded samples of the actor's answer to every prompt (the report's decoding)."""
    model, tokenizer = scoring.load_actor(actor, scoring.pick_device(device))
    answers = []
    for draw in range(draws):
        settings = EvalSettings(batch_size=batch_size, max_new_tokens=max_new_tokens, seed=seed + draw,
                                temperature=temperature, device=device)
        samples = scoring.generate(model, tokenizer, prompts, settings)
        answers += [{"prompt": p, "answer": t} for p, t in zip(samples.prompts, samples.texts)]
        print(f"draw {draw + 1}/{draws}: {len(samples.texts)} answers", flush=True)
    return answers


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dschat.eval.sample_pairs",
        description="Make gold-labelled preference pairs from an actor's answers to dschat/builtin's train prompts.",
    )
    parser.add_argument("--actor", required=True, help="the actor's folder (a step-1 output)")
    parser.add_argument("--out", type=Path, default=samples_dir(), help="output folder (train.jsonl, eval.jsonl)")
    parser.add_argument("--draws", type=int, default=DEFAULT_DRAWS, help="answers per prompt")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="sampling seed of the first draw")
    parser.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE)
    parser.add_argument("--max_new_tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    parser.add_argument("--pairs_per_prompt", type=int, default=DEFAULT_PAIRS_PER_PROMPT)
    parser.add_argument("--eval_prompts", type=int, default=DEFAULT_EVAL_PROMPTS,
                        help="prompts whose pairs go to eval.jsonl instead of train.jsonl")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    # eval.jsonl must hold pairs too: the dataset's held-out split (step 2's evaluation) reads it.
    for name in ("draws", "max_new_tokens", "pairs_per_prompt", "eval_prompts"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be at least 1")
    if not 0 < args.temperature < math.inf:
        raise UserError(f"--temperature must be above 0 and finite (got {args.temperature}): the answers are sampled")
    prompts = train_prompts()
    if args.eval_prompts >= len(prompts):
        raise UserError(f"--eval_prompts {args.eval_prompts} holds out every one of the {len(prompts)} train prompts, "
                        f"leaving no train pairs; give at most {len(prompts) - 1}")
    check_writable_dir(args.out, "--out")
    scoring.check_actor_folder(args.actor)
    answers = sample_answers(args.actor, prompts, draws=args.draws, seed=args.seed,
                             temperature=args.temperature, max_new_tokens=args.max_new_tokens, device=args.device)
    rows = split_by_prompt(make_pairs(answers, per_prompt=args.pairs_per_prompt), args.eval_prompts)
    empty = [split for split, split_rows in rows.items() if not split_rows]
    if empty:
        raise UserError(
            f"no {' or '.join(empty)} pairs: the judge separated too few of the {len(answers)} answers by "
            f"{MIN_MARGIN}; nothing written. Sample more (--draws) or hold out fewer prompts (--eval_prompts)"
        )
    write(args.out, rows)
    for split, split_rows in rows.items():
        print(f"wrote {len(split_rows)} {split} pairs to {args.out / (split + '.jsonl')}")


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
