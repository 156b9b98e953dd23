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
  KL(pi_rlhf || pi_sft) per token), both actors' logits divided by the sampling temperature (as step 3's KL);
- wall time per step (from ``e2e_rlhf.py``'s timings file).

Writes ``OUT/report.json`` and ``OUT/ppo_curves.png`` (reward, KL to the reference and response
length over PPO steps, read from step 3's ``metrics.jsonl``) and prints a summary. When step 3 ran
its held-out evaluation (``--eval_interval``), ``OUT/eval_curves.png`` shows it on one figure -- proxy,
judges, KL, answer length and entropy against the PPO step, the best evaluation and the
over-optimization alarm marked -- and the report says which step was best and whether the alarm fired.
``--curves_only`` draws the two figures from a ``metrics.jsonl`` alone, without any model.

When step 3 played multi-turn episodes (``--env``: its records carry ``turns``), the report adds a
multi-turn section (``report.json`` → ``episodes``): turns, actor tokens and environment tokens per
episode, the share of episodes cut and the environment's seconds per iteration at the start and the
end of training, and the held-out episode return at the first and the last evaluation with its
paired standard error; the PPO figure gains a turns and a cut-share panel. Without ``--env`` none of
it appears.

The pieces live in their own modules: the held-out data and settings (:mod:`.heldout`), the models
and their scores (:mod:`.scoring`), ``metrics.jsonl`` (:mod:`.metrics_file`) and the figures
(:mod:`.plots`); their names stay importable from here.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from dschat.errors import UserError, cannot_read, cli_main
from dschat.eval.heldout import EvalSettings, check_sampling, heldout_pairs, heldout_prompts
from dschat.eval.metrics_file import (
    EVAL_KIND,
    METRIC_ALIASES,
    find_metrics_file,
    finite_number,
    metrics_argument,
    read_eval_records,
    read_metrics,
)
from dschat.eval.paired import paired_change
from dschat.gold_judge import gold_breakdown, gold_score
from dschat.models.registry import check_pair_seq_len, check_seq_len_fits_positions
from dschat.paths import BEST_DIR, BEST_FILE, METRICS_FILE
from dschat.runtime.fs import atomic_file, check_writable_dir

if TYPE_CHECKING:
    from dschat.eval.scoring import Samples

REPORT_FILE = "report.json"
PLOT_FILE = "ppo_curves.png"
EVAL_PLOT_FILE = "eval_curves.png"
ANSWERS_FILE = "report_answers.jsonl"
TIMINGS_FILE = "e2e_timings.json"

__all__ = [
    "EVAL_KIND", "METRIC_ALIASES", "REPORT_FILE", "PLOT_FILE", "EVAL_PLOT_FILE", "ANSWERS_FILE", "TIMINGS_FILE",
    "EvalSettings", "heldout_prompts", "heldout_pairs", "read_eval_records", "read_metrics", "find_metrics_file",
    "evaluation_summary", "evaluation_lines", "EPISODE_WINDOW", "episode_summary", "episode_lines",
    "write_answers", "read_timings", "build_report", "write_report",
    "summary_text", "curves_only", "check_sampling", "build_parser", "main",
]


# -------------------------------------------------------------------------------------------------
# Step 3's held-out evaluation in the report
# -------------------------------------------------------------------------------------------------
def evaluation_summary(records: Sequence[dict[str, Any]], best_file: Path | None = None) -> dict[str, Any] | None:
    """What the report says about step 3's held-out evaluation: steps, first and last scores, the
    best evaluation (``best/best.json`` when its step is the last record's ``best_step``: else another
    run's, and only that step is told) and the first alarm. None without records."""
    if not records:
        return None
    keys = ("global_step", "proxy", "judges", "kl_to_ref", "response_length", "eos_rate", "entropy")
    best = None
    if best_file is not None and best_file.is_file():
        try:
            best = json.loads(best_file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            best = None
    step = records[-1].get("best_step")
    best = best if isinstance(best, dict) and step is not None and best.get("step") == step else None
    alarms = [r["alarm"] for r in records if r.get("alarm")]
    return {
        "n": len(records), "steps": [r.get("global_step") for r in records],
        "first": {k: records[0].get(k) for k in keys}, "last": {k: records[-1].get(k) for k in keys},
        "best": best or ({"step": step} if step is not None else None),
        "alarm": alarms[0] if alarms else None, "alarms": len(alarms),
        "eval_share": records[-1].get("eval_share"),
    }


def evaluation_lines(summary: dict[str, Any] | None) -> list[str]:
    """The evaluation's lines of the printed summary."""
    if not summary:
        return []

    def score(value: Any) -> str:  # NaN reaches the report as null (its JSON has no NaN)
        return f"{value:.3f}" if isinstance(value, (int, float)) else "nan"

    def scores(part: dict[str, Any]) -> str:
        judges = ", ".join(f"{k} {score(v)}" for k, v in (part.get("judges") or {}).items())
        return f"proxy {score(part.get('proxy'))}" + (f", {judges}" if judges else "")

    first, last = summary["first"], summary["last"]
    lines = [f"held-out evaluation ({summary['n']} evaluations, steps {summary['steps'][0]}-{summary['steps'][-1]}): "
             f"step {first['global_step']} {scores(first)} -> step {last['global_step']} {scores(last)}"]
    if best := summary.get("best"):
        detail = f" by {best['by']} ({score(best.get('score'))})" if "by" in best else ""
        lines.append(f"best evaluation: step {best['step']}{detail}; its models are in <step-3 output>/best")
    if alarm := summary.get("alarm"):
        lines.append(f"OVER-OPTIMIZATION alarm at step {alarm['step']}: proxy {alarm['proxy_change']:+.3f} while judge "
                     f"{alarm['judge']} {alarm['judge_change']:+.3f} (SE {alarm['judge_se']:.3f}) since step {alarm['since']}")
    else:
        lines.append("no over-optimization alarm")
    return lines

# -------------------------------------------------------------------------------------------------
# Multi-turn episodes (step 3's --env) in the report
# -------------------------------------------------------------------------------------------------
#: Iterations averaged at each end of training in the multi-turn section (fewer in a short run).
EPISODE_WINDOW = 3

#: The multi-turn section's fields and the metrics.jsonl keys they are the means of.
_EPISODE_FIELDS = {"turns": "turns", "actor_tokens": "response_length", "environment_tokens": "observation_tokens",
                   "cut_share": "cut_share", "environment_seconds": "time_env"}


def episode_summary(records: Sequence[dict[str, float]],
                    eval_records: Sequence[dict[str, Any]] = ()) -> dict[str, Any] | None:
    """The multi-turn section: None unless some PPO record (:func:`read_metrics`) carries ``turns``
    (step 3 ran with ``--env``).

    Over the records with ``turns``, ``first`` and ``last`` hold the means over the first and the
    last ``window`` = min(:data:`EPISODE_WINDOW`, n // 2) iterations (at least 1; the two ends share
    no iteration unless there is only one) of: actor ``turns`` per episode, ``actor_tokens``
    (``response_length``) and ``environment_tokens`` (``observation_tokens``) per episode,
    ``cut_share`` and ``environment_seconds`` per iteration (``time_env``), with the ``steps`` they
    span. ``heldout_return``: :func:`_heldout_return` of the evaluation records.
    """
    episodes = [r for r in records if "turns" in r]
    if not episodes:
        return None
    window = max(1, min(EPISODE_WINDOW, len(episodes) // 2))

    def means(part: Sequence[dict[str, float]]) -> dict[str, Any]:
        values = {name: [r[key] for r in part if key in r] for name, key in _EPISODE_FIELDS.items()}
        return {"steps": [int(part[0]["step"]), int(part[-1]["step"])],
                **{name: statistics.fmean(v) if v else None for name, v in values.items()}}

    return {"iterations": len(episodes), "window": window, "first": means(episodes[:window]),
            "last": means(episodes[-window:]), "heldout_return": _heldout_return(eval_records)}


def _heldout_return(records: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The held-out episode return (an evaluation record's ``proxy`` under ``--env``) at the first
    and the last evaluation; ``change`` and ``change_se`` are the paired mean change over the same
    prompts and its standard error (:func:`paired_change` of the records' ``per_prompt`` proxies), None
    with fewer than two evaluations. None without evaluation records."""
    if not records:
        return None
    first, last = records[0], records[-1]
    held: dict[str, Any] = {"evaluations": len(records), "before_step": first.get("global_step"),
                            "after_step": last.get("global_step"), "before": finite_number(first.get("proxy")),
                            "after": finite_number(last.get("proxy")), "change": None, "change_se": None}
    if len(records) < 2:
        return held
    before, after = ((r.get("per_prompt") or {}).get("proxy") for r in (first, last))
    if isinstance(before, list) and isinstance(after, list) and before and len(before) == len(after):
        held["change"], held["change_se"] = paired_change(before, after)
    elif held["before"] is not None and held["after"] is not None:
        held["change"] = held["after"] - held["before"]
    return held


def episode_lines(summary: dict[str, Any] | None) -> list[str]:
    """The multi-turn section's lines of the printed summary (none without ``--env``)."""
    if not summary:
        return []

    def num(value: Any, fmt: str) -> str:
        return format(value, fmt) if isinstance(value, (int, float)) else "n/a"

    first, last, window = summary["first"], summary["last"], summary["window"]

    def span(part: dict[str, Any]) -> str:
        a, b = part["steps"]
        return f"step {a}" if a == b else f"steps {a}-{b}"

    def change(key: str, fmt: str, scale: float = 1.0, unit: str = "") -> str:
        a, b = first[key], last[key]
        return (f"{num(a * scale if a is not None else None, fmt)}{unit} -> "
                f"{num(b * scale if b is not None else None, fmt)}{unit}")

    ends = "first -> last iteration" if window == 1 else f"mean of the first {window} -> last {window} iterations"
    lines = [f"multi-turn episodes (--env), {ends} ({span(first)} -> {span(last)}): "
             f"turns per episode {change('turns', '.2f')}; actor tokens per episode {change('actor_tokens', '.1f')}; "
             f"environment tokens per episode {change('environment_tokens', '.1f')}; "
             f"episodes cut {change('cut_share', '.0f', 100, '%')}; "
             f"environment time per iteration {change('environment_seconds', '.2f', unit=' s')}"]
    held = summary.get("heldout_return")
    if not held:
        lines.append("held-out episode return: not measured (step 3 ran no held-out evaluation; --eval_interval)")
        return lines
    line = (f"held-out episode return: {num(held['before'], '.3f')} (step {held['before_step']}) -> "
            f"{num(held['after'], '.3f')} (step {held['after_step']})")
    if held["change"] is not None:
        se = held["change_se"]
        line += f", change {held['change']:+.3f}"
        if isinstance(se, (int, float)) and math.isfinite(se) and se > 0:
            line += f" (paired SE {se:.3f}, {held['change'] / se:+.1f} standard errors)"
        else:
            line += " (paired SE n/a)"
    lines.append(line)
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
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for i, prompt in enumerate(sft.prompts):
            row = {"prompt": prompt, "sft": sft.texts[i], "rlhf": rlhf.texts[i], "sft_gold": sft_gold[i],
                   "rlhf_gold": rlhf_gold[i], "sft_reward": sft_rewards[i], "rlhf_reward": rlhf_rewards[i]}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def read_timings(path: str | Path | None, given: bool = False) -> dict[str, float]:
    """``{"1": seconds, ...}`` from e2e's timings file (missing or unreadable: empty; a file the user
    named, ``given``, that is missing or is not a JSON object is one :class:`UserError` line)."""
    if not path or not Path(path).is_file():
        if given:
            raise UserError(f"--timings {path} does not exist; pass e2e_rlhf.py's {TIMINGS_FILE} or leave it out")
        return {}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        data = err
    if given and not isinstance(data, dict):
        raise UserError(f"--timings {path} cannot be read as a JSON object of step -> seconds ({type(data).__name__}); "
                        f"pass e2e_rlhf.py's {TIMINGS_FILE} or leave it out")
    return {str(k): float(v) for k, v in data.items() if finite_number(v) is not None} if isinstance(data, dict) else {}


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
    # lazy: dschat.eval.scoring imports torch, transformers and deepspeed (3 s, python -X importtime) and
    # dschat.eval.plots matplotlib (0.5 s); --help and bad arguments pay neither.
    from dschat.eval import plots, scoring

    settings = settings or EvalSettings()
    start = time.monotonic()
    # Every input is checked before anything is loaded or ``out`` is created.
    folders = [scoring.check_actor_folder(given) for given in (sft, rlhf)]
    for flag, given, folder in zip(("--sft", "--rlhf"), (sft, rlhf), folders):
        if folder != Path(given).expanduser():  # a step-3 output root: its actor/
            log(f"(using the step-3 actor in {folder} for {flag})")
    sft, rlhf = folders
    scoring.check_reward_folder(reward)
    metrics_path = metrics_argument(metrics) if metrics else find_metrics_file(rlhf)
    device = scoring.pick_device(settings.device)
    check_pair_seq_len(settings.max_seq_len)  # --max_seq_len holds a pair and fits the reward model's positions
    check_seq_len_fits_positions(str(reward), settings.max_seq_len)
    prompts = heldout_prompts(settings.max_prompts)
    scoring.check_answer_room(folders, prompts, settings.max_new_tokens)
    check_writable_dir(out, "--out")
    (out := Path(out)).mkdir(parents=True, exist_ok=True)
    pairs = heldout_pairs(settings.max_pairs)
    decoding = "greedy" if not settings.do_sample else (
        f"sampling (temperature {settings.temperature}, top_k {settings.top_k}, top_p {settings.top_p}, seed {settings.seed})")
    log(f"[report] {len(prompts)} held-out prompts, {settings.max_new_tokens} new tokens max, {decoding}, on {device}")

    log(f"[report] generating with the SFT actor {sft}")
    sft_model, sft_tok = scoring.load_actor(sft, device)
    sft_samples = scoring.generate(sft_model, sft_tok, prompts, settings)
    log(f"[report] generating with the RLHF actor {rlhf}")
    rlhf_model, rlhf_tok = scoring.load_actor(rlhf, device)
    rlhf_samples = scoring.generate(rlhf_model, rlhf_tok, prompts, settings)
    log("[report] KL of the RLHF actor to the SFT actor on the RLHF answers")
    temp = settings.temperature if settings.do_sample else 1.0  # both at the distribution sampled from
    logp_rlhf = scoring.response_logprobs(rlhf_model, rlhf_samples, settings.batch_size, rlhf_tok.pad_token_id, temp)
    logp_sft = scoring.response_logprobs(sft_model, rlhf_samples, settings.batch_size, rlhf_tok.pad_token_id, temp)
    token_kl = [a - b for row_a, row_b in zip(logp_rlhf, logp_sft) for a, b in zip(row_a, row_b)]
    per_response = [sum(a) - sum(b) for a, b in zip(logp_rlhf, logp_sft)]
    del sft_model, rlhf_model
    scoring.empty_cache(device)

    log(f"[report] reward-model scores and held-out accuracy on {len(pairs)} pairs ({reward})")
    rm, rm_tok = scoring.load_reward(reward, device)
    sft_rewards = scoring.reward_scores(rm, rm_tok, sft_samples, sft_tok, settings.batch_size)
    rlhf_rewards = scoring.reward_scores(rm, rm_tok, rlhf_samples, rlhf_tok, settings.batch_size)
    rm_stats = scoring.pairwise_accuracy(rm, rm_tok, pairs, settings)
    del rm

    sft_gold = [gold_score(p, t) for p, t in zip(sft_samples.prompts, sft_samples.texts)]
    rlhf_gold = [gold_score(p, t) for p, t in zip(rlhf_samples.prompts, rlhf_samples.texts)]
    wins = sum((r > s) + 0.5 * (r == s) for r, s in zip(rlhf_gold, sft_gold)) / len(prompts)
    # How well the reward model tracks the judge on the actors' own answers (not the dataset's): PPO
    # can raise the gold score only as far as this holds.
    rm_stats["gold_correlation_on_answers"] = scoring.pearson(sft_rewards + rlhf_rewards, sft_gold + rlhf_gold)

    records = read_metrics(metrics_path) if metrics_path else []
    png = plots.plot_metrics(records, out / PLOT_FILE)
    evaluation = _evaluation_part(metrics_path, out)
    episodes = episode_summary(records, read_eval_records(metrics_path) if metrics_path else [])
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
            # the paired standard error of that gain over the same prompts (the noise of the comparison)
            "gold_score_gain_se": paired_change(sft_gold, rlhf_gold)[1],
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
        **({"episodes": episodes} if episodes else {}),  # step 3 ran with --env
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
    path = Path(out) / REPORT_FILE
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def _fmt_seconds(seconds: float | None) -> str:
    return str(datetime.timedelta(seconds=int(seconds))) if seconds is not None else "n/a"


def _in_standard_errors(gain: dict[str, Any]) -> str:
    """The gold gain in units of its paired standard error, or "n/a" (a report written before the SE
    was recorded, one prompt, or answers scored identically)."""
    se = gain.get("gold_score_gain_se")
    if not isinstance(se, (int, float)) or not (math.isfinite(se) and se > 0):
        return "n/a"
    return f"{gain['gold_score_gain'] / se:+.1f}"


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
        f"gold gain {num(gain['gold_score_gain'])} ({_in_standard_errors(gain)} paired standard errors); RLHF beats SFT "
        f"on the gold judge on {num(gain['gold_win_rate'] * 100, '.0f')}% of prompts (ties count half)",
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
    lines += episode_lines(report.get("episodes"))
    return "\n".join(lines)


def _evaluation_part(metrics_path: Path | None, out: Path) -> dict[str, Any] | None:
    """Step 3's evaluation records (if any) as a figure in ``out`` and a summary (with its path)."""
    # lazy: dschat.eval.plots imports matplotlib (0.5 s); --help and bad arguments do not pay it
    from dschat.eval import plots

    records = read_eval_records(metrics_path) if metrics_path else []
    if not records:
        return None
    summary = evaluation_summary(records, metrics_path.parent / BEST_DIR / BEST_FILE)
    summary["plot"] = str(plots.plot_evaluation(records, out / EVAL_PLOT_FILE))
    return summary


def curves_only(metrics: str | Path, out: str | Path) -> list[str]:
    """``--curves_only``: the PPO and evaluation figures of a ``metrics.jsonl``, and the evaluation's and
    (with ``--env``) the multi-turn section's lines."""
    # lazy: matplotlib only (0.5 s), and --curves_only needs no torch
    from dschat.eval import plots

    metrics = metrics_argument(metrics)
    try:
        records = read_metrics(metrics)
    except PermissionError as err:
        raise cannot_read(metrics, err) from None
    if not records and not read_eval_records(metrics):
        raise UserError(f"--metrics {metrics} holds no PPO or evaluation records (JSON lines with global_step and "
                        f"reward, kl_to_ref or response_length); pass step 3's <output_dir>/{METRICS_FILE}")
    check_writable_dir(out, "--out")
    png = plots.plot_metrics(records, Path(out) / PLOT_FILE)
    evaluation = _evaluation_part(metrics, Path(out))
    lines = [f"PPO curves: {png}"] + evaluation_lines(evaluation)
    if evaluation:
        lines.append(f"held-out evaluation curves: {evaluation['plot']}")
    return lines + episode_lines(episode_summary(records, read_eval_records(metrics)))


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
    parser.add_argument("--batch_size", type=int, default=d.batch_size, help="scoring batch (and generation's)")
    parser.add_argument("--generation_batch_size", type=int, default=d.generation_batch_size,
                        help="generation batch (default: --batch_size); on a CPU, decoding many prompts at once "
                             "is faster, scoring is not")
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
    timings = read_timings(args.timings or Path(args.out) / TIMINGS_FILE, given=args.timings is not None)
    for name in ("max_prompts", "max_pairs", "batch_size", "generation_batch_size", "max_new_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name} must be at least 1")
    if not args.greedy:
        check_sampling(args.temperature, args.top_p, args.top_k)
    settings = EvalSettings(
        max_prompts=args.max_prompts, max_pairs=args.max_pairs, batch_size=args.batch_size,
        generation_batch_size=args.generation_batch_size,
        max_new_tokens=args.max_new_tokens, max_seq_len=args.max_seq_len, seed=args.seed,
        do_sample=not args.greedy, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        device=args.device,
    )
    report = build_report(args.sft, args.rlhf, args.reward, args.out, settings, metrics=args.metrics,
                          step_seconds=timings)
    print(summary_text(report))


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
