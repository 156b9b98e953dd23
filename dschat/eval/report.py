"""The end-of-run report: is the RLHF actor better than the SFT actor, by how much, at what cost?

    python -m dschat.eval.report --sft OUT/actor-models/smollm2-135m \\
        --rlhf OUT/step3-models/smollm2-135m/actor --reward OUT/reward-models/smollm2-135m --out OUT

On the held-out prompts of the embedded dataset (``dschat/builtin`` eval split, deduplicated, in
file order) both actors answer with the SAME decoding settings and the same random stream (seeded
sampling; greedy with ``--greedy``). Every answer is scored by the gold judge (the labeller of the
embedded data, independent of any model) and by the step-2 reward model. Also measured:

- the reward model's held-out accuracy on the eval split's chosen/rejected pairs, with the gold
  judge deciding which answer is better;
- how well the reward model tracks the judge on the actors' own answers (Pearson r between its
  scores and the gold scores over both actors' answers): PPO optimises the reward model, so it can
  raise the gold score only as far as this holds;
- mean response length in tokens (EOS included when emitted);
- the KL of the RLHF actor to the SFT actor: the mean over answer tokens of
  ``log pi_rlhf(a_t) - log pi_sft(a_t)`` on the RLHF actor's own samples (a Monte-Carlo estimate of
  KL(pi_rlhf || pi_sft) per token);
- wall time per step (from ``e2e_rlhf.py``'s timings file).

Writes ``OUT/report.json`` and ``OUT/ppo_curves.png`` (reward, KL to the reference and response
length over PPO steps, read from step 3's ``metrics.jsonl``) and prints a summary. When step 3 ran
its held-out evaluation (``--eval_interval``), ``OUT/eval_curves.png`` shows it on one figure -- proxy,
judges, KL, answer length and entropy against the PPO step, the best evaluation and the
over-optimization alarm marked -- and the report says which step was best and whether the alarm fired.
``--curves_only`` draws the two figures from a ``metrics.jsonl`` alone, without any model.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from dschat.errors import UserError, cli_main
from dschat.paths import BEST_DIR, BEST_FILE, METRICS_FILE

# The "kind" of step 3's held-out evaluation records in metrics.jsonl (dschat.rlhf.evaluation writes them).
EVAL_KIND = "eval"

REPORT_FILE = "report.json"
PLOT_FILE = "ppo_curves.png"
EVAL_PLOT_FILE = "eval_curves.png"
ANSWERS_FILE = "report_answers.jsonl"
TIMINGS_FILE = "e2e_timings.json"

# Names accepted for each plotted field of metrics.jsonl (the first is the documented one).
METRIC_ALIASES: dict[str, tuple[str, ...]] = {
    # global_step first: step 3's per-epoch "step" restarts every epoch.
    "step": ("global_step", "step", "ppo_step", "iteration"),
    "reward": ("reward", "average_reward", "reward_score", "mean_reward", "reward_mean"),
    "kl_to_ref": ("kl_to_ref", "kl_ref", "ref_kl", "kl", "mean_kl"),
    "response_length": ("response_length", "mean_response_length", "response_len", "answer_length"),
}


# -------------------------------------------------------------------------------------------------
# Settings and held-out data
# -------------------------------------------------------------------------------------------------
@dataclass
class EvalSettings:
    """What the report evaluates and how both actors decode (identical for the two)."""

    max_prompts: int | None = None  # None: all 96 distinct held-out prompts
    max_pairs: int | None = None  # None: all 300 held-out pairs
    batch_size: int = 16
    max_new_tokens: int = 64
    max_seq_len: int = 512  # truncation of the reward model's pair texts, as step 2
    seed: int = 1234
    do_sample: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    device: str = "auto"
    n_examples: int = 3


def heldout_prompts(limit: int | None = None) -> list[str]:
    """Distinct prompts of the builtin eval split, in first-appearance order (the file is shuffled)."""
    from dschat.data.builtin import read_rows

    seen: dict[str, None] = {}
    for row in read_rows("eval"):
        seen.setdefault(row["prompt"], None)
    prompts = list(seen)
    return prompts[:limit] if limit else prompts


def heldout_pairs(limit: int | None = None) -> list[dict]:
    """The builtin eval split's (prompt, chosen, rejected) rows."""
    from dschat.data.builtin import read_rows

    rows = read_rows("eval")
    return rows[:limit] if limit else rows


# -------------------------------------------------------------------------------------------------
# Models
# -------------------------------------------------------------------------------------------------
def pick_device(name: str = "auto") -> Any:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _check_folder(path: str | Path, what: str) -> Path:
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise UserError(f"{what} {folder} is not a model folder (no config.json); pass the step's --output_dir")
    return folder


def _check_actor_folder(path: str | Path) -> Path:
    from dschat.models.reward_model import is_reward_model_folder

    folder = _check_folder(path, "actor folder")
    if is_reward_model_folder(folder):
        raise UserError(f"{folder} is a step-2 reward model, not an actor; pass a step-1 or step-3 actor folder")
    return folder


def _check_reward_folder(path: str | Path) -> Path:
    from dschat.models.reward_model import is_reward_model_folder, not_a_critic_message

    folder = _check_folder(path, "reward-model folder")
    if not is_reward_model_folder(folder):
        raise UserError(not_a_critic_message(str(folder), "--reward"))
    return folder


def load_actor(path: str | Path, device: Any) -> tuple[Any, Any]:
    """A causal LM (eval mode) and its tokenizer from a step-1 or step-3 actor folder."""
    import torch
    from transformers import AutoModelForCausalLM

    from dschat.models.registry import load_config
    from dschat.models.tokenizer import load_hf_tokenizer

    folder = _check_actor_folder(path)
    config = load_config(str(folder))  # refuses a model that needs its own code
    tokenizer = load_hf_tokenizer(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), config=config, dtype=torch.float32,
                                                 trust_remote_code=False).to(device).eval()
    return model, tokenizer


def load_reward(path: str | Path, device: Any) -> tuple[Any, Any]:
    """The step-2 reward model (strict load: body + value head) and its tokenizer."""
    from dschat.models.build import create_critic_model
    from dschat.models.tokenizer import load_hf_tokenizer

    folder = _check_reward_folder(path)
    tokenizer = load_hf_tokenizer(str(folder))
    model = create_critic_model(str(folder), tokenizer, None, rlhf_training=True)
    return model.to(device).eval(), tokenizer


def _batches(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _pad(rows: Sequence[Sequence[int]], pad_id: int, left: bool) -> tuple[Any, Any]:
    """(ids, attention_mask) tensors, padded on the left (generation) or right (scoring)."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if not row:
            continue
        sl = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, sl] = torch.tensor(row, dtype=torch.long)
        mask[i, sl] = 1
    return ids, mask


# -------------------------------------------------------------------------------------------------
# Generation, log-probs, reward scores
# -------------------------------------------------------------------------------------------------
@dataclass
class Samples:
    """One actor's answers. ``response_ids`` stop at (and include) the first EOS."""

    prompts: list[str]
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    texts: list[str]
    ended: list[bool]  # the answer ended with EOS (not cut at max_new_tokens)


def generate(model: Any, tokenizer: Any, prompts: Sequence[str], settings: EvalSettings) -> Samples:
    """Answer every prompt with ``settings``' decoding, seeded so both actors see the same randomness."""
    import torch
    from transformers import GenerationConfig

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    config = GenerationConfig(
        max_new_tokens=settings.max_new_tokens,
        do_sample=settings.do_sample,
        temperature=settings.temperature if settings.do_sample else None,
        top_k=settings.top_k if settings.do_sample else None,
        top_p=settings.top_p if settings.do_sample else None,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    device = next(model.parameters()).device
    torch.manual_seed(settings.seed)  # the same random stream for every actor evaluated
    out = Samples([], [], [], [], [])
    for chunk in _batches(list(prompts), settings.batch_size):
        # Phase-3 prompts are tokenised without truncation (dschat.data.prompt_dataset) and left-padded.
        rows = [tokenizer(p)["input_ids"] for p in chunk]
        ids, mask = _pad(rows, pad, left=True)
        with torch.no_grad():
            generated = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config
            )
        for prompt, row, gen in zip(chunk, rows, generated[:, ids.shape[1]:].tolist()):
            answer: list[int] = []
            ended = False
            for token in gen:
                answer.append(token)
                if token == eos:
                    ended = True
                    break
            if not ended:  # drop right padding after an early stop of other rows
                while answer and answer[-1] == pad and pad != eos:
                    answer.pop()
            out.prompts.append(prompt)
            out.prompt_ids.append(list(row))
            out.response_ids.append(answer)
            out.texts.append(tokenizer.decode(answer, skip_special_tokens=True))
            out.ended.append(ended)
    return out


def response_logprobs(model: Any, samples: Samples, batch_size: int, pad_id: int) -> list[list[float]]:
    """log pi(a_t | prefix) of every answer token of ``samples`` under ``model``."""
    import torch

    from dschat.rl_math import gather_log_probs

    device = next(model.parameters()).device
    result: list[list[float]] = []
    pairs = list(zip(samples.prompt_ids, samples.response_ids))
    for chunk in _batches(pairs, batch_size):
        rows = [p + r for p, r in chunk]
        ids, mask = _pad(rows, pad_id, left=False)
        ids, mask = ids.to(device), mask.to(device)
        with torch.no_grad():
            # Right padding: the default positions 0..len-1 are the real ones (no position_ids,
            # which some families' forward does not take).
            logits = model(input_ids=ids, attention_mask=mask).logits
            logp = gather_log_probs(logits[:, :-1].float(), ids[:, 1:])  # (B, T-1): logp of token t+1
        for i, (prompt, answer) in enumerate(chunk):
            start = len(prompt) - 1  # position predicting the first answer token
            result.append(logp[i, start : start + len(answer)].tolist())
    return result


def reward_scores(
    reward_model: Any, reward_tokenizer: Any, samples: Samples, actor_tokenizer: Any, batch_size: int
) -> list[float]:
    """The reward model's end score of each (prompt, answer), scored on the generated token ids as
    step 3 does when the tokenizers agree, else on the re-tokenised text."""
    same_vocab = reward_tokenizer.get_vocab() == actor_tokenizer.get_vocab()
    rows = []
    for prompt, p_ids, r_ids, text, ended in zip(
        samples.prompts, samples.prompt_ids, samples.response_ids, samples.texts, samples.ended
    ):
        if same_vocab:
            rows.append(p_ids + r_ids)
        else:
            suffix = reward_tokenizer.eos_token if ended and reward_tokenizer.eos_token else ""
            rows.append(reward_tokenizer(prompt + text + suffix)["input_ids"])
    return score_sequences(reward_model, rows, reward_tokenizer.pad_token_id, batch_size)


def score_sequences(reward_model: Any, rows: Sequence[Sequence[int]], pad_id: int, batch_size: int) -> list[float]:
    """End score (value at the last real token) of each token sequence."""
    import torch

    from dschat.models.reward_model import last_token_index

    device = next(reward_model.parameters()).device
    scores: list[float] = []
    for chunk in _batches(list(rows), batch_size):
        ids, mask = _pad(chunk, pad_id, left=False)
        ids, mask = ids.to(device), mask.to(device)
        with torch.no_grad():
            values = reward_model.forward_value(input_ids=ids, attention_mask=mask, return_value_only=True)
        end = last_token_index(mask)
        scores += values.float().gather(1, end.unsqueeze(1)).squeeze(1).tolist()
    return scores


def pairwise_accuracy(
    reward_model: Any, tokenizer: Any, pairs: Sequence[dict], settings: EvalSettings
) -> dict[str, float | int]:
    """Held-out accuracy of the reward model, with the gold judge deciding which answer is better.

    Texts are built as step 2 builds them: ``prompt + answer + EOS`` (dschat's default end of
    conversation), truncated at ``max_seq_len``. Pairs the judge scores equal are skipped.
    """
    from dschat.gold_judge import gold_score

    texts, labels, agree = [], [], 0
    for row in pairs:
        gold_c, gold_r = gold_score(row["prompt"], row["chosen"]), gold_score(row["prompt"], row["rejected"])
        if gold_c == gold_r:
            continue
        agree += gold_c > gold_r
        labels.append(gold_c > gold_r)  # True: the dataset's "chosen" is the judge's better answer
        eot = tokenizer.eos_token or ""
        for answer in (row["chosen"], row["rejected"]):
            texts.append(tokenizer(row["prompt"] + answer + eot, max_length=settings.max_seq_len, truncation=True)["input_ids"])
    if not labels:
        raise UserError("no held-out pair has distinct gold-judge scores; nothing to measure the reward model on")
    scores = score_sequences(reward_model, texts, tokenizer.pad_token_id, settings.batch_size)
    chosen, rejected = scores[0::2], scores[1::2]
    correct = sum((c > r) == label for c, r, label in zip(chosen, rejected, labels))
    return {
        "heldout_accuracy_vs_gold": correct / len(labels),
        "n_pairs": len(labels),
        "dataset_labels_agree_with_gold": agree / len(labels),
        "mean_chosen_score": statistics.fmean(chosen),
        "mean_rejected_score": statistics.fmean(rejected),
    }


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Pearson correlation of two equal-length samples (``statistics.correlation``); ``None`` when it
    is undefined (fewer than two points, or either sample constant)."""
    if len(xs) != len(ys):
        raise ValueError(f"pearson: {len(xs)} against {len(ys)} values")
    try:
        return statistics.correlation(xs, ys)
    except statistics.StatisticsError:
        return None


# -------------------------------------------------------------------------------------------------
# PPO metrics (step 3's metrics.jsonl) and the plot
# -------------------------------------------------------------------------------------------------
def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def read_eval_records(path: str | Path, keep: Callable[[dict], bool] | None = None) -> list[dict[str, Any]]:
    """The evaluation records of a ``metrics.jsonl`` (``"kind": "eval"``), by step; unreadable lines skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("kind") == EVAL_KIND and (keep is None or keep(record)):
            by_step[int(record.get("global_step", 0))] = record
    return [by_step[k] for k in sorted(by_step)]


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """Per-PPO-step records from ``metrics.jsonl``, tolerant of what a crash or a rename leaves.

    Reads ``global_step`` (else ``step``), ``reward``, ``kl_to_ref`` and ``response_length`` (or an
    alias in :data:`METRIC_ALIASES`); other keys are ignored. Blank, truncated or non-object lines and non-finite values are skipped;
    a missing step is the line's position; a repeated step keeps its last record. Sorted by step.
    """
    path = Path(path)
    if not path.is_file():
        return []
    by_step: dict[float, dict[str, float]] = {}
    for index, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines()):
        line = line.strip()
        if not line:
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(raw, dict) or raw.get("kind") == "eval":  # held-out evaluations: read_eval_records
            continue
        record: dict[str, float] = {}
        for name, aliases in METRIC_ALIASES.items():
            for alias in aliases:
                value = _number(raw.get(alias))
                if value is not None:
                    record[name] = value
                    break
        record.setdefault("step", float(index))
        if len(record) > 1:
            by_step[record["step"]] = record
    return [by_step[k] for k in sorted(by_step)]


def metrics_figure(records: Sequence[dict[str, float]], title: str = "PPO (step 3)") -> Any:
    """The figure of :func:`plot_metrics`: reward, KL to the reference and response length against
    PPO step, one panel each (a matplotlib ``Figure`` on an Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # Constrained layout places the titles, tick labels and axis labels at every draw (savefig
    # included), once their sizes are known, so every label stays inside the figure.
    fig = Figure(figsize=(7, 8), dpi=100, layout="constrained")
    fig.get_layout_engine().set(w_pad=0.1, h_pad=0.1)  # inches of margin around every panel
    FigureCanvasAgg(fig)
    panels = (("reward", "reward-model score"), ("kl_to_ref", "KL to reference"), ("response_length", "response length (tokens)"))
    axes = fig.subplots(len(panels), 1, sharex=True)
    for ax, (key, label) in zip(axes, panels):
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", markersize=2, linewidth=1)
        else:
            ax.text(0.5, 0.5, f"no '{key}' in metrics", ha="center", va="center", transform=ax.transAxes)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("PPO step")
    fig.suptitle(title if records else f"{title}: no metrics.jsonl records")
    return fig


def plot_metrics(records: Sequence[dict[str, float]], png: str | Path, title: str = "PPO (step 3)") -> Path:
    """Write :func:`metrics_figure` to ``png``."""
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    metrics_figure(records, title).savefig(png)
    return png


def plot_evaluation(records: Sequence[dict[str, Any]], png: str | Path,
                    title: str = "Held-out evaluation (step 3)") -> Path:
    """Step 3's held-out evaluations (``metrics.jsonl`` records of kind ``eval``) on one figure: the
    proxy and each judge (mean, +-1 standard error), KL to the reference, answer length and token
    entropy against the PPO step; the best evaluation (green) and the first over-optimization alarm
    (red) marked on every panel."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    judges = sorted({name for r in records for name in (r.get("judges") or {})})
    panels: list[tuple[str, list[tuple[str, str | None, str | None]]]] = [
        ("proxy (trained on)", [("proxy", "proxy", "proxy_se")])]
    panels += [(f"judge: {name}", [(name, f"judges.{name}", f"judges_se.{name}")]) for name in judges]
    panels += [("KL to reference", [("kl", "kl_to_ref", None)]), ("answer length (tokens)", [("len", "response_length", None)]),
               ("token entropy (nats)", [("ent", "entropy", None)])]

    def value(record: dict[str, Any], key: str | None) -> float | None:
        if key is None:
            return None
        head, _, tail = key.partition(".")
        got = record.get(head)
        return _number(got.get(tail) if tail and isinstance(got, dict) else got)

    fig = Figure(figsize=(7, 2.0 * len(panels) + 1), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    steps = [r.get("global_step", i) for i, r in enumerate(records)]
    best = next((r.get("best_step") for r in reversed(records) if r.get("best_step") is not None), None)
    alarm = next((r["alarm"] for r in records if r.get("alarm")), None)
    for ax, (label, series) in zip(axes, panels):
        for _, key, se_key in series:
            points = [(x, value(r, key), value(r, se_key)) for x, r in zip(steps, records) if value(r, key) is not None]
            if points:
                xs, ys, ses = zip(*points)
                ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.2)
                if all(e is not None for e in ses):
                    ax.fill_between(xs, [y - e for y, e in zip(ys, ses)], [y + e for y, e in zip(ys, ses)], alpha=0.2)
            else:
                ax.text(0.5, 0.5, f"no '{key}' in the records", ha="center", va="center", transform=ax.transAxes)
        if best is not None:
            ax.axvline(best, color="tab:green", linestyle="--", linewidth=1, label=f"best (step {best})")
        if alarm is not None:
            ax.axvline(alarm["step"], color="tab:red", linewidth=1.2, label=f"alarm (step {alarm['step']})")
        ax.set_ylabel(label, fontsize=8)
        ax.grid(True, alpha=0.3)
    if best is not None or alarm is not None:
        axes[0].legend(fontsize=7, loc="best")
    axes[-1].set_xlabel("PPO step")
    fig.suptitle(title if records else f"{title}: no evaluation records")
    fig.tight_layout()
    fig.savefig(png)
    return png


def evaluation_summary(records: Sequence[dict[str, Any]], best_file: Path | None = None) -> dict[str, Any] | None:
    """What the report says about step 3's held-out evaluation: steps, first and last scores, the
    best evaluation (``best/best.json`` when there is one) and the first alarm. None without records."""
    if not records:
        return None
    keys = ("global_step", "proxy", "judges", "kl_to_ref", "response_length", "eos_rate", "entropy")
    best = None
    if best_file is not None and best_file.is_file():
        try:
            best = json.loads(best_file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            best = None
    alarms = [r["alarm"] for r in records if r.get("alarm")]
    return {
        "n": len(records), "steps": [r.get("global_step") for r in records],
        "first": {k: records[0].get(k) for k in keys}, "last": {k: records[-1].get(k) for k in keys},
        "best": best or ({"step": records[-1].get("best_step")} if records[-1].get("best_step") is not None else None),
        "alarm": alarms[0] if alarms else None, "alarms": len(alarms),
        "eval_share": records[-1].get("eval_share"),
    }


def evaluation_lines(summary: dict[str, Any] | None) -> list[str]:
    """The evaluation's lines of the printed summary."""
    if not summary:
        return []

    def scores(part: dict[str, Any]) -> str:
        judges = ", ".join(f"{k} {v:.3f}" for k, v in (part.get("judges") or {}).items())
        return f"proxy {part['proxy']:.3f}" + (f", {judges}" if judges else "")

    first, last = summary["first"], summary["last"]
    lines = [f"held-out evaluation ({summary['n']} evaluations, steps {summary['steps'][0]}-{summary['steps'][-1]}): "
             f"step {first['global_step']} {scores(first)} -> step {last['global_step']} {scores(last)}"]
    best = summary.get("best")
    if best:
        detail = f" by {best['by']} ({best['score']:.3f})" if "by" in best else ""
        lines.append(f"best evaluation: step {best['step']}{detail}; its models are in <step-3 output>/best")
    alarm = summary.get("alarm")
    if alarm:
        lines.append(f"OVER-OPTIMIZATION alarm at step {alarm['step']}: proxy {alarm['proxy_change']:+.3f} while judge "
                     f"{alarm['judge']} {alarm['judge_change']:+.3f} (SE {alarm['judge_se']:.3f}) since step {alarm['since']}")
    else:
        lines.append("no over-optimization alarm")
    return lines


# -------------------------------------------------------------------------------------------------
# The report
# -------------------------------------------------------------------------------------------------
def _finite(value: Any) -> Any:
    """JSON has no NaN/inf: map them to null, recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _actor_summary(samples: Samples, gold: list[float], rewards: list[float]) -> dict[str, Any]:
    from dschat.gold_judge import gold_breakdown

    lengths = [len(r) for r in samples.response_ids]
    parts = [gold_breakdown(p, t) for p, t in zip(samples.prompts, samples.texts)]
    return {
        "gold_score": statistics.fmean(gold),
        "gold_score_std": statistics.pstdev(gold),
        "gold_components": {name: statistics.fmean(getattr(b, name) for b in parts) for name in parts[0]._fields},
        "reward_score": statistics.fmean(rewards),
        "mean_response_tokens": statistics.fmean(lengths),
        "eos_rate": sum(samples.ended) / len(samples.ended),
    }


def write_answers(path: Path, sft: Samples, rlhf: Samples, sft_gold: Sequence[float], rlhf_gold: Sequence[float],
                  sft_rewards: Sequence[float], rlhf_rewards: Sequence[float]) -> Path:
    """Every held-out prompt with both actors' answers and their scores, one JSON object per line."""
    from dschat.runtime.fs import atomic_file

    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for i, prompt in enumerate(sft.prompts):
            row = {"prompt": prompt, "sft": sft.texts[i], "rlhf": rlhf.texts[i], "sft_gold": sft_gold[i],
                   "rlhf_gold": rlhf_gold[i], "sft_reward": sft_rewards[i], "rlhf_reward": rlhf_rewards[i]}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def read_timings(path: str | Path | None) -> dict[str, float]:
    """``{"1": seconds, ...}`` from e2e's timings file (missing or unreadable: empty)."""
    if not path or not Path(path).is_file():
        return {}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return {str(k): float(v) for k, v in data.items() if _number(v) is not None} if isinstance(data, dict) else {}


def find_metrics_file(rlhf: str | Path) -> Path | None:
    """Step 3 writes ``metrics.jsonl`` in its --output_dir, the parent of ``actor/``."""
    rlhf = Path(rlhf)
    for candidate in (rlhf.parent / METRICS_FILE, rlhf / METRICS_FILE):
        if candidate.is_file():
            return candidate
    return None


def build_report(
    sft: str | Path,
    rlhf: str | Path,
    reward: str | Path,
    out: str | Path,
    settings: EvalSettings | None = None,
    *,
    metrics: str | Path | None = None,
    step_seconds: dict[str, float] | None = None,
    run_started: float | None = None,
    log: Any = print,
) -> dict[str, Any]:
    """Evaluate, write ``report.json`` and the plot into ``out``, return the report dict.

    ``total_seconds`` is the time since ``run_started`` (a ``time.monotonic()`` value; e2e passes
    its own start) or, run alone, the known step times plus this evaluation.
    """
    import torch

    from dschat.gold_judge import gold_score

    from dschat.runtime.fs import check_writable_dir

    settings = settings or EvalSettings()
    start = time.monotonic()
    # Every input is checked before anything is loaded or ``out`` is created.
    _check_actor_folder(sft)
    _check_actor_folder(rlhf)
    _check_reward_folder(reward)
    check_writable_dir(out, "--out")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    device = pick_device(settings.device)
    prompts = heldout_prompts(settings.max_prompts)
    pairs = heldout_pairs(settings.max_pairs)
    decoding = "greedy" if not settings.do_sample else (
        f"sampling (temperature {settings.temperature}, top_k {settings.top_k}, top_p {settings.top_p}, seed {settings.seed})")
    log(f"[report] {len(prompts)} held-out prompts, {settings.max_new_tokens} new tokens max, {decoding}, on {device}")

    log(f"[report] generating with the SFT actor {sft}")
    sft_model, sft_tok = load_actor(sft, device)
    sft_samples = generate(sft_model, sft_tok, prompts, settings)
    log(f"[report] generating with the RLHF actor {rlhf}")
    rlhf_model, rlhf_tok = load_actor(rlhf, device)
    rlhf_samples = generate(rlhf_model, rlhf_tok, prompts, settings)
    log("[report] KL of the RLHF actor to the SFT actor on the RLHF answers")
    logp_rlhf = response_logprobs(rlhf_model, rlhf_samples, settings.batch_size, rlhf_tok.pad_token_id)
    logp_sft = response_logprobs(sft_model, rlhf_samples, settings.batch_size, rlhf_tok.pad_token_id)
    token_kl = [a - b for row_a, row_b in zip(logp_rlhf, logp_sft) for a, b in zip(row_a, row_b)]
    per_response = [sum(a) - sum(b) for a, b in zip(logp_rlhf, logp_sft)]
    del sft_model, rlhf_model
    if device.type == "cuda":
        torch.cuda.empty_cache()

    log(f"[report] reward-model scores and held-out accuracy on {len(pairs)} pairs ({reward})")
    rm, rm_tok = load_reward(reward, device)
    sft_rewards = reward_scores(rm, rm_tok, sft_samples, sft_tok, settings.batch_size)
    rlhf_rewards = reward_scores(rm, rm_tok, rlhf_samples, rlhf_tok, settings.batch_size)
    rm_stats = pairwise_accuracy(rm, rm_tok, pairs, settings)
    del rm

    sft_gold = [gold_score(p, t) for p, t in zip(sft_samples.prompts, sft_samples.texts)]
    rlhf_gold = [gold_score(p, t) for p, t in zip(rlhf_samples.prompts, rlhf_samples.texts)]
    wins = sum((r > s) + 0.5 * (r == s) for r, s in zip(rlhf_gold, sft_gold)) / len(prompts)
    # How well the reward model tracks the judge on the actors' own answers (not the dataset's): PPO
    # can raise the gold score only as far as this holds.
    rm_stats["gold_correlation_on_answers"] = pearson(sft_rewards + rlhf_rewards, sft_gold + rlhf_gold)

    metrics_path = Path(metrics) if metrics else find_metrics_file(rlhf)
    records = read_metrics(metrics_path) if metrics_path else []
    png = plot_metrics(records, out / PLOT_FILE)
    evaluation = _evaluation_part(metrics_path, out)
    answers = write_answers(out / ANSWERS_FILE, sft_samples, rlhf_samples, sft_gold, rlhf_gold, sft_rewards, rlhf_rewards)

    eval_seconds = time.monotonic() - start
    steps = {k: {"seconds": (step_seconds or {}).get(k)} for k in ("1", "2", "3")}
    if run_started is not None:
        total_seconds = time.monotonic() - run_started
    else:  # run alone: everything measured (known step times + this evaluation)
        total_seconds = sum(v["seconds"] for v in steps.values() if v["seconds"] is not None) + eval_seconds
    report: dict[str, Any] = {
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "total_seconds": total_seconds,
        "steps": steps,
        "eval_seconds": eval_seconds,
        "models": {"sft": str(sft), "rlhf": str(rlhf), "reward": str(reward)},
        "settings": asdict(settings) | {"n_prompts": len(prompts), "device": str(device)},
        "reward_model": rm_stats,
        "sft_actor": _actor_summary(sft_samples, sft_gold, sft_rewards),
        "rlhf_actor": _actor_summary(rlhf_samples, rlhf_gold, rlhf_rewards) | {
            "kl_to_sft": statistics.fmean(token_kl) if token_kl else 0.0,
            "kl_to_sft_per_response": statistics.fmean(per_response),
        },
        "rlhf_vs_sft": {
            "gold_score_gain": statistics.fmean(rlhf_gold) - statistics.fmean(sft_gold),
            "gold_win_rate": wins,
            "reward_score_gain": statistics.fmean(rlhf_rewards) - statistics.fmean(sft_rewards),
        },
        "ppo_metrics": {
            "file": str(metrics_path) if metrics_path else None,
            "n_records": len(records),
            "first": records[0] if records else None,
            "last": records[-1] if records else None,
        },
        "plot": str(png),
        "evaluation": evaluation,
        "answers": str(answers),
        "examples": [
            {"prompt": p, "sft": s, "rlhf": r, "sft_gold": sg, "rlhf_gold": rg}
            for p, s, r, sg, rg in list(zip(prompts, sft_samples.texts, rlhf_samples.texts, sft_gold, rlhf_gold))[
                : settings.n_examples
            ]
        ],
    }
    report = _finite(report)
    write_report(report, out)
    return report


def write_report(report: dict[str, Any], out: str | Path) -> Path:
    from dschat.runtime.fs import atomic_file

    path = Path(out) / REPORT_FILE
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def _fmt_seconds(seconds: float | None) -> str:
    return str(datetime.timedelta(seconds=int(seconds))) if seconds is not None else "n/a"


def summary_text(report: dict[str, Any]) -> str:
    """A human summary of ``report`` (what e2e_rlhf.py prints at the end)."""
    sft, rlhf, rm, gain = report["sft_actor"], report["rlhf_actor"], report["reward_model"], report["rlhf_vs_sft"]

    def num(value: Any, fmt: str = "+.3f") -> str:
        return format(value, fmt) if isinstance(value, (int, float)) else "n/a"

    steps = ", ".join(f"step {k} {_fmt_seconds(v.get('seconds'))}" for k, v in report["steps"].items())
    lines = [
        "==================== dschat report ====================",
        f"held-out prompts: {report['settings']['n_prompts']} (dschat/builtin eval split); decoding identical for both actors",
        f"{'':24s}{'SFT actor':>12s}{'RLHF actor':>12s}{'change':>10s}",
        f"{'gold-judge score':24s}{num(sft['gold_score'], '.3f'):>12s}{num(rlhf['gold_score'], '.3f'):>12s}"
        f"{num(gain['gold_score_gain']):>10s}",
        f"{'reward-model score':24s}{num(sft['reward_score'], '.3f'):>12s}{num(rlhf['reward_score'], '.3f'):>12s}"
        f"{num(gain['reward_score_gain']):>10s}",
        f"{'mean response tokens':24s}{num(sft['mean_response_tokens'], '.1f'):>12s}"
        f"{num(rlhf['mean_response_tokens'], '.1f'):>12s}"
        f"{num(rlhf['mean_response_tokens'] - sft['mean_response_tokens'], '+.1f'):>10s}",
        f"RLHF beats SFT on the gold judge on {num(gain['gold_win_rate'] * 100, '.0f')}% of prompts (ties count half)",
        "gold components, RLHF - SFT: " + ", ".join(
            f"{name} {num(rlhf['gold_components'][name] - value, '+.2f')}"
            for name, value in sft.get("gold_components", {}).items() if name in rlhf.get("gold_components", {})),
        f"KL(RLHF || SFT): {num(rlhf['kl_to_sft'], '.4f')} nats per answer token, "
        f"{num(rlhf['kl_to_sft_per_response'], '.3f')} per answer",
        f"reward model: {num(rm['heldout_accuracy_vs_gold'] * 100, '.1f')}% held-out accuracy vs the gold judge "
        f"({rm['n_pairs']} pairs); on the actors' own answers its scores correlate "
        f"r = {num(rm.get('gold_correlation_on_answers'), '.2f')} with the gold judge",
        f"wall time: {steps}; evaluation {_fmt_seconds(report.get('eval_seconds'))}; "
        f"total {_fmt_seconds(report.get('total_seconds'))}",
        f"report: {Path(report['plot']).parent / REPORT_FILE}; PPO curves: {report['plot']}",
    ]
    if report["ppo_metrics"]["file"] is None:
        lines.append("(no metrics.jsonl from step 3: the PPO-curve plot is empty)")
    lines += evaluation_lines(report.get("evaluation"))
    if report.get("evaluation"):
        lines.append(f"held-out evaluation curves: {report['evaluation']['plot']}")
    return "\n".join(lines)


def _evaluation_part(metrics_path: Path | None, out: Path) -> dict[str, Any] | None:
    """Step 3's evaluation records (if any) as a figure in ``out`` and a summary (with its path)."""
    records = read_eval_records(metrics_path) if metrics_path else []
    if not records:
        return None
    summary = evaluation_summary(records, metrics_path.parent / BEST_DIR / BEST_FILE)
    summary["plot"] = str(plot_evaluation(records, out / EVAL_PLOT_FILE))
    return summary


def curves_only(metrics: str | Path, out: str | Path) -> list[str]:
    """``--curves_only``: the PPO and evaluation figures of a ``metrics.jsonl``, and the evaluation's lines."""
    from dschat.runtime.fs import check_writable_dir

    metrics = Path(metrics)
    if not metrics.is_file():
        raise UserError(f"--metrics {metrics} does not exist; pass step 3's <output_dir>/{METRICS_FILE}")
    check_writable_dir(out, "--out")
    png = plot_metrics(read_metrics(metrics), Path(out) / PLOT_FILE)
    evaluation = _evaluation_part(metrics, Path(out))
    lines = [f"PPO curves: {png}"] + evaluation_lines(evaluation)
    if evaluation:
        lines.append(f"held-out evaluation curves: {evaluation['plot']}")
    return lines


# -------------------------------------------------------------------------------------------------
# CLI
# -------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    d = EvalSettings()
    parser = argparse.ArgumentParser(
        prog="python -m dschat.eval.report",
        description="Compare the SFT and RLHF actors on held-out prompts (gold judge + reward model), "
                    "measure the reward model's held-out accuracy, plot the PPO curves.",
    )
    parser.add_argument("--sft", help="step-1 output folder (the SFT actor); required unless --curves_only")
    parser.add_argument("--rlhf", help="step-3 actor folder (<step-3 output>/actor); required unless --curves_only")
    parser.add_argument("--reward", help="step-2 output folder (the reward model); required unless --curves_only")
    parser.add_argument("--curves_only", action="store_true",
                        help="only draw the PPO and held-out evaluation curves of --metrics into --out (no model)")
    parser.add_argument("--out", required=True, help="folder for report.json and ppo_curves.png")
    parser.add_argument("--metrics", default=None, help="step 3's metrics.jsonl (default: next to the actor folder)")
    parser.add_argument("--timings", default=None,
                        help=f"e2e timings JSON for the per-step wall times (default: OUT/{TIMINGS_FILE})")
    parser.add_argument("--max_prompts", type=int, default=d.max_prompts, help="held-out prompts (default: all 96)")
    parser.add_argument("--max_pairs", type=int, default=d.max_pairs, help="held-out pairs (default: all 300)")
    parser.add_argument("--batch_size", type=int, default=d.batch_size, help="generation and scoring batch")
    parser.add_argument("--max_new_tokens", type=int, default=d.max_new_tokens, help="answer length limit")
    parser.add_argument("--max_seq_len", type=int, default=d.max_seq_len, help="truncation of pair texts (as step 2)")
    parser.add_argument("--seed", type=int, default=d.seed, help="sampling seed (the same for both actors)")
    parser.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    parser.add_argument("--temperature", type=float, default=d.temperature, help="sampling temperature")
    parser.add_argument("--top_k", type=int, default=d.top_k, help="top-k sampling (0: off)")
    parser.add_argument("--top_p", type=float, default=d.top_p, help="nucleus sampling (1.0: off)")
    parser.add_argument("--device", default=d.device, help="auto (CUDA when available), cpu, cuda, cuda:1, ...")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    # bitsandbytes (imported by transformers) warns on AVX-512 CPUs without the optional `kernels`.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    args = build_parser().parse_args(argv)
    if args.curves_only:
        if not args.metrics:
            raise UserError("--curves_only draws from a metrics file: give --metrics <step-3 output>/metrics.jsonl")
        print("\n".join(curves_only(args.metrics, args.out)))
        return
    missing = [f"--{name}" for name in ("sft", "rlhf", "reward") if not getattr(args, name)]
    if missing:
        raise UserError(f"{', '.join(missing)} required (or --curves_only with --metrics)")
    for name in ("max_prompts", "max_pairs", "batch_size", "max_new_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name} must be at least 1")
    settings = EvalSettings(
        max_prompts=args.max_prompts, max_pairs=args.max_pairs, batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens, max_seq_len=args.max_seq_len, seed=args.seed,
        do_sample=not args.greedy, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        device=args.device,
    )
    timings = read_timings(args.timings or Path(args.out) / TIMINGS_FILE)
    report = build_report(args.sft, args.rlhf, args.reward, args.out, settings, metrics=args.metrics,
                          step_seconds=timings)
    print(summary_text(report))


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
