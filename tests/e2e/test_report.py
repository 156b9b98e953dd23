"""dschat.eval.report on tiny-model folders: keys, finite numbers, the PNG, and the pieces (KL,
reward-model accuracy, metrics.jsonl reader) against values worked out independently."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from dschat.errors import UserError
from dschat.eval import plots, scoring
from dschat.eval import report as rep
from dschat.gold_judge import GoldBreakdown, gold_score

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """SFT actor = tiny-llama, RLHF actor = a perturbed copy, reward = a step-2-style folder."""
    from transformers import AutoModelForCausalLM

    from dschat.models.build import create_critic_model
    from dschat.models.registry import resolve_model_path
    from dschat.models.save import save_hf_model
    from dschat.models.tokenizer import load_hf_tokenizer

    base = tmp_path_factory.mktemp("report_models")
    src = resolve_model_path("tiny-llama")
    tok = load_hf_tokenizer(src)
    sft = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    save_hf_model(sft, tok, base / "sft")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in sft.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_hf_model(sft, tok, base / "step3" / "actor")
    torch.manual_seed(1)
    save_hf_model(create_critic_model(src, tok, None), tok, base / "reward")
    return {"sft": base / "sft", "rlhf": base / "step3" / "actor", "reward": base / "reward", "base": base}


def test_report_cli_writes_json_png_and_summary(folders, tmp_path, capsys):
    metrics = folders["base"] / "step3" / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps({"global_step": i, "step": i, "reward": -1 + 0.1 * i,
                                             "kl_to_ref": 0.01 * i, "response_length": 10 + i}) for i in range(5)))
    (tmp_path / rep.TIMINGS_FILE).write_text(json.dumps({"1": 10.0, "2": 20.0, "3": 30.0}))
    rep.main(["--sft", str(folders["sft"]), "--rlhf", str(folders["rlhf"]), "--reward", str(folders["reward"]),
              "--out", str(tmp_path), "--max_prompts", "6", "--max_pairs", "10", "--max_new_tokens", "8",
              "--batch_size", "4"])
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["steps"] == {"1": {"seconds": 10.0}, "2": {"seconds": 20.0}, "3": {"seconds": 30.0}}
    assert report["total_seconds"] >= 60.0
    assert 0 <= report["reward_model"]["heldout_accuracy_vs_gold"] <= 1
    assert report["reward_model"]["n_pairs"] == 10
    for actor in ("sft_actor", "rlhf_actor"):
        for key in ("gold_score", "reward_score", "mean_response_tokens"):
            assert math.isfinite(report[actor][key]), (actor, key)
        assert 0 < report[actor]["mean_response_tokens"] <= 8
    assert math.isfinite(report["rlhf_actor"]["kl_to_sft"]) and report["rlhf_actor"]["kl_to_sft"] != 0.0
    assert report["settings"]["n_prompts"] == 6
    assert report["ppo_metrics"]["n_records"] == 5 and report["ppo_metrics"]["last"]["reward"] == pytest.approx(-0.6)
    assert (tmp_path / "ppo_curves.png").read_bytes()[:8] == PNG_MAGIC
    # Every answer is kept, and its gold score is the judge's verdict on exactly that text.
    rows = [json.loads(line) for line in (tmp_path / rep.ANSWERS_FILE).read_text().splitlines()]
    assert len(rows) == 6 and report["answers"] == str(tmp_path / rep.ANSWERS_FILE)
    for row in rows:
        assert row["sft_gold"] == gold_score(row["prompt"], row["sft"])
        assert row["rlhf_gold"] == gold_score(row["prompt"], row["rlhf"])
    for actor, key in (("sft_actor", "sft_gold"), ("rlhf_actor", "rlhf_gold")):
        assert report[actor]["gold_score"] == pytest.approx(sum(r[key] for r in rows) / 6)
        # The components' means add up to the mean score.
        assert sum(report[actor]["gold_components"].values()) == pytest.approx(report[actor]["gold_score"])
        assert set(report[actor]["gold_components"]) == set(GoldBreakdown._fields)
    # The reward model's correlation with the judge over all 12 answers, against the standard library's.
    import statistics

    rewards = [r["sft_reward"] for r in rows] + [r["rlhf_reward"] for r in rows]
    golds = [r["sft_gold"] for r in rows] + [r["rlhf_gold"] for r in rows]
    r_gold = report["reward_model"]["gold_correlation_on_answers"]
    assert len(set(golds)) > 1  # the judge tells these answers apart, so r is defined
    assert r_gold == pytest.approx(statistics.correlation(rewards, golds))
    # The gain's paired standard error over the same 6 prompts, by hand from the saved answers.
    diffs = [r["rlhf_gold"] - r["sft_gold"] for r in rows]
    gain = report["rlhf_vs_sft"]
    assert gain["gold_score_gain"] == pytest.approx(statistics.fmean(diffs))
    expected_se = statistics.stdev(diffs) / math.sqrt(6)
    assert gain["gold_score_gain_se"] == pytest.approx(expected_se)
    out = capsys.readouterr().out
    assert "dschat report" in out and "gold-judge score" in out and "KL(RLHF || SFT)" in out
    assert "on the actors' own answers its scores correlate r = " in out
    assert "gold components, RLHF - SFT: relevance " in out
    in_se = f"{gain['gold_score_gain'] / expected_se:+.1f}" if expected_se > 0 else "n/a"
    assert f"({in_se} paired standard errors)" in out


def test_same_actor_has_zero_kl_and_no_gain(folders, tmp_path):
    settings = rep.EvalSettings(max_prompts=4, max_pairs=4, max_new_tokens=6, batch_size=4)
    report = rep.build_report(folders["sft"], folders["sft"], folders["reward"], tmp_path, settings, log=lambda m: None)
    # The same model with the same seed writes the same answers, and log pi - log pi is exactly 0.
    assert report["rlhf_actor"]["kl_to_sft"] == 0.0
    assert report["rlhf_vs_sft"]["gold_score_gain"] == 0.0 and report["rlhf_vs_sft"]["gold_win_rate"] == 0.5
    assert report["rlhf_vs_sft"]["gold_score_gain_se"] == 0.0  # identical answers: no noise
    assert "(n/a paired standard errors)" in rep.summary_text(report)
    assert report["sft_actor"]["reward_score"] == pytest.approx(report["rlhf_actor"]["reward_score"])
    assert report["ppo_metrics"]["file"] is None  # no metrics.jsonl beside the sft folder
    assert (tmp_path / "ppo_curves.png").read_bytes()[:8] == PNG_MAGIC  # an empty plot is still written


class LengthRewardModel(torch.nn.Module):
    """A reward model whose end score is the sequence length (values = 1, 2, 3, ... per position)."""

    def __init__(self) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward_value(self, input_ids, attention_mask, return_value_only=True):
        return attention_mask.float().cumsum(-1)


def test_generation_batch_size_sets_the_decoding_batch_only(folders, monkeypatch):
    """--generation_batch_size: the prompts decode in batches of that size, scoring keeps --batch_size;
    each answer is the one its prompt gets alone (greedy), whatever the batch."""
    model, tok = scoring.load_actor(folders["sft"], torch.device("cpu"))
    prompts = rep.heldout_prompts(5)
    batches = []
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda **kw: batches.append(kw["input_ids"].shape[0]) or generate(**kw))
    settings = rep.EvalSettings(batch_size=2, generation_batch_size=4, max_new_tokens=6, do_sample=False)
    together = scoring.generate(model, tok, prompts, settings)
    assert batches == [4, 1]
    alone = scoring.generate(model, tok, prompts, rep.EvalSettings(batch_size=1, max_new_tokens=6, do_sample=False))
    assert batches[2:] == [1] * 5  # unset: --batch_size
    assert together.response_ids == alone.response_ids
    with pytest.raises(UserError, match="--generation_batch_size must be at least 1"):
        rep.main(["--sft", str(folders["sft"]), "--rlhf", str(folders["rlhf"]), "--reward", str(folders["reward"]),
                  "--out", "unused", "--generation_batch_size", "0"])


def test_scoring_in_batches_by_length_keeps_each_row_its_own_result(folders):
    """Log-probs and reward scores are computed in batches of similar lengths: each row's result is
    the one it gets alone, in the caller's order."""
    model, tok = scoring.load_actor(folders["sft"], torch.device("cpu"))
    samples = scoring.generate(model, tok, rep.heldout_prompts(7), rep.EvalSettings(max_new_tokens=8, seed=3))
    assert len({len(p) + len(r) for p, r in zip(samples.prompt_ids, samples.response_ids)}) > 2
    rm, rm_tok = scoring.load_reward(folders["reward"], torch.device("cpu"))
    batched = (scoring.response_logprobs(model, samples, 3, tok.pad_token_id),
               scoring.reward_scores(rm, rm_tok, samples, tok, 3))
    alone = (scoring.response_logprobs(model, samples, 1, tok.pad_token_id),
             scoring.reward_scores(rm, rm_tok, samples, tok, 1))
    assert [len(row) for row in batched[0]] == [len(r) for r in samples.response_ids]
    for got, want in zip(batched[0], alone[0]):
        assert got == pytest.approx(want, abs=1e-5)
    assert batched[1] == pytest.approx(alone[1], abs=1e-5)
    assert len(set(alone[1])) == len(alone[1])  # distinct scores: a mix-up would show


def test_pairwise_accuracy_against_an_independent_count():
    from dschat.gold_judge import gold_score
    from dschat.models.tokenizer import load_hf_tokenizer

    tok = load_hf_tokenizer("tiny-llama")
    pairs = rep.heldout_pairs(40)
    stats = scoring.pairwise_accuracy(LengthRewardModel(), tok, pairs, rep.EvalSettings(batch_size=8))
    # Expected: how often the gold judge's better answer is also the one with more tokens.
    expected, n = 0, 0
    for row in pairs:
        gc, gr = gold_score(row["prompt"], row["chosen"]), gold_score(row["prompt"], row["rejected"])
        if gc == gr:
            continue
        n += 1
        better, worse = (row["chosen"], row["rejected"]) if gc > gr else (row["rejected"], row["chosen"])
        length = lambda a: len(tok(row["prompt"] + a + tok.eos_token, max_length=512, truncation=True)["input_ids"])  # noqa: E731
        expected += length(better) > length(worse)
    assert stats["n_pairs"] == n
    assert stats["heldout_accuracy_vs_gold"] == pytest.approx(expected / n)
    assert stats["dataset_labels_agree_with_gold"] == 1.0  # the builtin labels come from the judge


def test_pearson_by_hand():
    # x = 1, 2, 3; y = 2, 4, 5: means 2 and 11/3; sxy = 3, sxx = 2, syy = 14/3 -> 3 / sqrt(28/3).
    assert scoring.pearson([1, 2, 3], [2, 4, 5]) == pytest.approx(3 / math.sqrt(28 / 3))
    assert scoring.pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert scoring.pearson([1, 2, 3], [7, 7, 7]) is None and scoring.pearson([1.0], [2.0]) is None
    with pytest.raises(ValueError):
        scoring.pearson([1, 2], [1, 2, 3])


def test_heldout_prompts_are_deduplicated_in_order():
    prompts = rep.heldout_prompts()
    assert len(prompts) == len(set(prompts)) == 96
    assert rep.heldout_prompts(5) == prompts[:5]
    assert all(p.startswith(" Human: ") and p.endswith(" Assistant:") for p in prompts)


def test_read_metrics_is_tolerant(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join([
        json.dumps({"global_step": 0, "step": 0, "reward": 1.0, "kl_to_ref": 0.0, "response_length": 5}),
        "",
        "{not json",
        json.dumps([1, 2, 3]),
        json.dumps({"global_step": 1, "average_reward": "2.5", "kl": float("nan"), "response_len": 6}),
        json.dumps({"global_step": 2, "step": 0, "reward": 3.0, "micro_steps": [{"x": 1}]}),  # epoch 2: step restarts
        json.dumps({"global_step": 2, "step": 0, "reward": 4.0}),  # a repeated step keeps the last record
        json.dumps({"note": "no numbers"}),
        '{"global_step": 3, "reward": 5.0, "kl_to_ref": 0.3',  # cut off by a crash
    ]))
    records = rep.read_metrics(path)
    assert records == [
        {"step": 0.0, "reward": 1.0, "kl_to_ref": 0.0, "response_length": 5.0},
        {"step": 1.0, "reward": 2.5, "response_length": 6.0},
        {"step": 2.0, "reward": 4.0},
    ]
    assert rep.read_metrics(tmp_path / "missing.jsonl") == []


def test_plot_without_records_still_writes_a_png(tmp_path):
    png = plots.plot_metrics([], tmp_path / "p.png")
    assert png.read_bytes()[:8] == PNG_MAGIC


def _steps(n: int, **columns: Any) -> list[dict[str, float]]:
    """``n`` records; each column is a function of the step index."""
    return [{"step": float(i), **{k: float(f(i)) for k, f in columns.items()}} for i in range(n)]


PLOT_CASES = {
    # A tiny-model run: rewards near 1, a KL that dips below 0 by 1e-4, a constant length.
    "tiny run": _steps(2, reward=lambda i: 0.725 + 0.125 * i, kl_to_ref=lambda i: -1.5e-4 * i,
                       response_length=lambda i: 16),
    "long run, wide tick labels": _steps(300, reward=lambda i: -123.456789 - 0.0012345 * i,
                                         kl_to_ref=lambda i: -1e-5 * i, response_length=lambda i: 100 + i),
    "large values": _steps(30, reward=lambda i: -2.5e12 + 1e9 * i, kl_to_ref=lambda i: 1e-9 * i,
                           response_length=lambda i: 1e5 + i),
    "one column": _steps(1, reward=lambda i: 1.0),
    "no records": [],
}


@pytest.mark.parametrize("font_size", [10, 14], ids=["default-font", "font-14"])
@pytest.mark.parametrize("case", list(PLOT_CASES))
def test_every_label_of_the_ppo_plot_lies_inside_the_figure(case, font_size):
    """Issue: the top panel's y label ran past the figure's left edge. After drawing, every panel's
    tight box (tick labels, offset text, axis labels, in-panel text) and the title lie inside."""
    import matplotlib

    with matplotlib.rc_context({"font.size": font_size}):
        fig = plots.metrics_figure(PLOT_CASES[case])
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        frame = fig.bbox
        boxes = {f"panel {ax.get_ylabel()!r}": ax.get_tightbbox(renderer) for ax in fig.axes}
        boxes["title"] = fig._suptitle.get_window_extent(renderer)
    for name, box in boxes.items():
        assert box.x0 >= frame.x0 and box.y0 >= frame.y0, (name, box.bounds, frame.bounds)
        assert box.x1 <= frame.x1 and box.y1 <= frame.y1, (name, box.bounds, frame.bounds)
    assert [ax.get_ylabel() for ax in fig.axes] == ["reward-model score", "KL to reference",
                                                   "response length (tokens)"]


def test_report_refuses_wrong_folders(folders, tmp_path):
    with pytest.raises(UserError, match="is a step-2 reward model, not an actor"):
        scoring.load_actor(folders["reward"], torch.device("cpu"))
    with pytest.raises(UserError, match="no config.json"):
        scoring.load_actor(tmp_path, torch.device("cpu"))
    with pytest.raises(UserError, match="not a step-2 reward model output"):
        scoring.load_reward(folders["sft"], torch.device("cpu"))


def test_json_never_holds_nan(tmp_path):
    clean = rep._finite({"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": 2.0}})
    assert clean == {"a": None, "b": [1.0, None], "c": {"d": 2.0}}
    path = rep.write_report(clean, tmp_path)
    assert json.loads(path.read_text()) == clean
