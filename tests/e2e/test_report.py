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
    assert "episodes" not in report  # no --env: no multi-turn section
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
    assert "multi-turn" not in out and "episode" not in out
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


def _episode_metrics(path: Path, evaluations: list[dict[str, Any]]) -> Path:
    """Six --env iterations (steps 0-5) and ``evaluations``, as step 3 writes metrics.jsonl."""
    rows = [{"epoch": 0, "step": i, "global_step": i, "reward": 0.1 * i, "kl_to_ref": 0.01 * i,
             "response_length": 20.0 + 2 * i, "turns": 1.0 + 0.5 * i, "observation_tokens": 8.0 * i,
             "cut_share": 0.5 - 0.1 * i, "time_env": 0.2 + 0.1 * i} for i in range(6)]
    rows += [{"kind": "eval", "prompts": 4, **e} for e in evaluations]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_multi_turn_section_from_episode_records(tmp_path):
    """The means over the first and the last 3 of 6 iterations, and the held-out return's paired change,
    worked out by hand."""
    evaluations = [{"global_step": 0, "proxy": 0.5, "per_prompt": {"proxy": [0.0, 1.0, 0.0, 1.0]}},
                   {"global_step": 3, "proxy": 0.5, "per_prompt": {"proxy": [1.0, 0.0, 0.0, 1.0]}},
                   {"global_step": 5, "proxy": 0.75, "per_prompt": {"proxy": [1.0, 1.0, 0.0, 1.0]}}]
    metrics = _episode_metrics(tmp_path / "metrics.jsonl", evaluations)
    summary = rep.episode_summary(rep.read_metrics(metrics), rep.read_eval_records(metrics))
    assert summary["iterations"] == 6 and summary["window"] == 3
    # Steps 0, 1, 2: turns 1, 1.5, 2 -> 1.5; actor tokens 20, 22, 24 -> 22; environment tokens 0, 8, 16 -> 8;
    # cut 0.5, 0.4, 0.3 -> 0.4; environment seconds 0.2, 0.3, 0.4 -> 0.3. Steps 3, 4, 5: 3, 28, 32, 0.1, 0.6.
    first, last = dict(summary["first"]), dict(summary["last"])
    assert first.pop("steps") == [0, 2] and last.pop("steps") == [3, 5]
    assert first == pytest.approx({"turns": 1.5, "actor_tokens": 22.0, "environment_tokens": 8.0, "cut_share": 0.4,
                                   "environment_seconds": 0.3})
    assert last == pytest.approx({"turns": 3.0, "actor_tokens": 28.0, "environment_tokens": 32.0, "cut_share": 0.1,
                                  "environment_seconds": 0.6})
    # First (step 0) against last (step 5) evaluation, prompt by prompt: differences 1, 0, 0, 0 -> mean 0.25;
    # their sample standard deviation is sqrt(0.75 / 3) = 0.5, so the standard error is 0.5 / sqrt(4) = 0.25.
    held = summary["heldout_return"]
    assert held == pytest.approx({"evaluations": 3, "before_step": 0, "after_step": 5, "before": 0.5, "after": 0.75,
                                  "change": 0.25, "change_se": 0.25})
    lines = rep.episode_lines(summary)
    assert lines == [
        "multi-turn episodes (--env), mean of the first 3 -> last 3 iterations (steps 0-2 -> steps 3-5): "
        "turns per episode 1.50 -> 3.00; actor tokens per episode 22.0 -> 28.0; environment tokens per episode "
        "8.0 -> 32.0; episodes cut 40% -> 10%; environment time per iteration 0.30 s -> 0.60 s",
        "held-out episode return: 0.500 (step 0) -> 0.750 (step 5), change +0.250 (paired SE 0.250, +1.0 standard "
        "errors)"]
    # --curves_only prints the same section after the curves.
    assert rep.curves_only(metrics, tmp_path / "curves")[-2:] == lines


def test_multi_turn_section_short_runs_and_no_evaluation(tmp_path):
    """One iteration is both ends; one evaluation has no change; evaluations without per-prompt
    scores have a change and no standard error; no evaluation says so."""
    metrics = _episode_metrics(tmp_path / "metrics.jsonl", [])
    records = rep.read_metrics(metrics)
    one = rep.episode_summary(records[:1])
    assert one["window"] == 1 and one["first"] == one["last"] and one["first"]["steps"] == [0, 0]
    assert one["heldout_return"] is None
    assert rep.episode_lines(one) == [
        "multi-turn episodes (--env), first -> last iteration (step 0 -> step 0): turns per episode 1.00 -> 1.00; "
        "actor tokens per episode 20.0 -> 20.0; environment tokens per episode 0.0 -> 0.0; episodes cut 50% -> 50%; "
        "environment time per iteration 0.20 s -> 0.20 s",
        "held-out episode return: not measured (step 3 ran no held-out evaluation; --eval_interval)"]
    assert rep.episode_summary(records[:5])["window"] == 2  # the two ends never share an iteration
    single = rep.episode_summary(records, [{"global_step": 0, "proxy": 0.4}])["heldout_return"]
    assert single["before"] == single["after"] == 0.4 and single["change"] is None and single["change_se"] is None
    plain = rep.episode_summary(records, [{"global_step": 0, "proxy": 0.25}, {"global_step": 4, "proxy": 0.75}])
    assert plain["heldout_return"]["change"] == 0.5 and plain["heldout_return"]["change_se"] is None
    assert rep.episode_lines(plain)[-1] == ("held-out episode return: 0.250 (step 0) -> 0.750 (step 4), change "
                                            "+0.500 (paired SE n/a)")


def test_no_multi_turn_section_without_episode_records(tmp_path):
    """Records of a run without --env: no section, no extra keys, no extra lines or panels."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps({"global_step": i, "reward": 0.1 * i, "kl_to_ref": 0.0, "response_length": 9,
                                          "time_generation": 1.0}) for i in range(4))
                    + "\n" + json.dumps({"kind": "eval", "global_step": 0, "proxy": 0.1}) + "\n")
    records = rep.read_metrics(path)
    assert all(set(r) == {"step", "reward", "kl_to_ref", "response_length"} for r in records)
    assert rep.episode_summary(records, rep.read_eval_records(path)) is None
    assert rep.episode_lines(None) == []
    lines = rep.curves_only(path, tmp_path / "curves")
    assert not any("episode" in line for line in lines)
    assert [ax.get_ylabel() for ax in plots.metrics_figure(records).axes] == [
        "reward-model score", "KL to reference", "response length (tokens)"]


def test_report_has_the_multi_turn_section_when_step3_ran_with_env(folders, tmp_path):
    metrics = _episode_metrics(tmp_path / "metrics.jsonl", [
        {"global_step": 0, "proxy": 0.5, "per_prompt": {"proxy": [0.0, 1.0, 0.0, 1.0]}},
        {"global_step": 5, "proxy": 0.75, "per_prompt": {"proxy": [1.0, 1.0, 0.0, 1.0]}}])
    settings = rep.EvalSettings(max_prompts=2, max_pairs=2, max_new_tokens=4, batch_size=2)
    report = rep.build_report(folders["sft"], folders["rlhf"], folders["reward"], tmp_path / "out", settings,
                              metrics=metrics, log=lambda m: None)
    saved = json.loads((tmp_path / "out" / rep.REPORT_FILE).read_text())
    assert saved["episodes"]["first"]["turns"] == pytest.approx(1.5)
    assert saved["episodes"]["heldout_return"]["change_se"] == pytest.approx(0.25)
    assert saved["ppo_metrics"]["last"]["turns"] == pytest.approx(3.5)
    text = rep.summary_text(report)
    assert text.splitlines()[-2:] == rep.episode_lines(report["episodes"])
    assert "held-out episode return: 0.500 (step 0) -> 0.750 (step 5), change +0.250 (paired SE 0.250" in text


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
    # Step 3 with --env: two more panels, turns and the share of episodes cut.
    "multi-turn run": _steps(40, reward=lambda i: 0.1 * i, kl_to_ref=lambda i: 1e-3 * i,
                             response_length=lambda i: 30, turns=lambda i: 1 + i / 20,
                             observation_tokens=lambda i: 12, cut_share=lambda i: 0.5 - i / 100,
                             time_env=lambda i: 0.25),
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
    episodes = ["actor turns per episode", "share of episodes cut"] if case == "multi-turn run" else []
    assert [ax.get_ylabel() for ax in fig.axes] == ["reward-model score", "KL to reference",
                                                   "response length (tokens)"] + episodes


def test_report_refuses_wrong_folders(folders, tmp_path):
    with pytest.raises(UserError, match="is a reward model .*; pass a step-1 or step-3 actor folder"):
        scoring.load_actor(folders["reward"], torch.device("cpu"))
    with pytest.raises(UserError, match="no config.json"):
        scoring.load_actor(tmp_path, torch.device("cpu"))
    with pytest.raises(UserError, match="not a step-2 reward model output"):
        scoring.load_reward(folders["sft"], torch.device("cpu"))


def test_a_named_timings_file_that_is_not_one_is_refused_the_default_is_optional(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match=f"--timings {bad} cannot be read as a JSON object .* \\(JSONDecodeError\\)"):
        rep.read_timings(bad, given=True)
    with pytest.raises(UserError, match="does not exist"):
        rep.read_timings(tmp_path / "missing.json", given=True)
    assert rep.read_timings(bad) == {} and rep.read_timings(tmp_path / "missing.json") == {}
    (tmp_path / "ok.json").write_text('{"1": 12.5, "3": "x"}')
    assert rep.read_timings(tmp_path / "ok.json", given=True) == {"1": 12.5}


def test_json_never_holds_nan(tmp_path):
    clean = rep._finite({"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": 2.0}})
    assert clean == {"a": None, "b": [1.0, None], "c": {"d": 2.0}}
    path = rep.write_report(clean, tmp_path)
    assert json.loads(path.read_text()) == clean


def test_kl_to_sft_is_taken_at_the_sampling_temperature():
    """Both actors' log-probs are those of the tempered distributions the answers were sampled from:
    with p = (.6, .4), r = (.7, .3) and T = .5 the per-token KL of the tempered r to the tempered p is
    0.0620, where the raw logits' log-probs on the same samples give 0.0856."""

    class Fixed(torch.nn.Module):
        def __init__(self, probs):
            super().__init__()
            self.logits = torch.nn.Parameter(torch.tensor(probs).log(), requires_grad=False)

        def forward(self, input_ids, attention_mask):
            return type("Out", (), {"logits": self.logits.expand(*input_ids.shape, 2)})()

    rlhf, sft = Fixed([0.7, 0.3]), Fixed([0.6, 0.4])
    samples = scoring.Samples([], [[0], [0]], [[0], [1]], [], [])  # each answer token once
    logp = {name: scoring.response_logprobs(m, samples, 2, 0, 0.5) for name, m in (("r", rlhf), ("s", sft))}
    q = [math.exp(row[0]) for row in logp["r"]]  # the tempered RLHF distribution: answer weights
    assert q == pytest.approx([0.49 / 0.58, 0.09 / 0.58])
    kl = sum(w * (a[0] - b[0]) for w, a, b in zip(q, logp["r"], logp["s"]))
    assert kl == pytest.approx(0.0620, abs=1e-4)
    assert scoring.response_logprobs(rlhf, samples, 2, 0)[0][0] == pytest.approx(math.log(0.7))  # T = 1: raw


def test_best_json_of_another_run_is_not_reported(tmp_path):
    """``best/best.json`` is told only when its step is the last record's ``best_step``: a rerun into the
    same folder that kept no best (``--save_best_by none``) or another step does not show the first run's."""
    path = tmp_path / "metrics.jsonl"
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "best.json").write_text(json.dumps({"step": 0, "by": "gold", "score": 0.125}))
    evals = [{"kind": "eval", "global_step": s, "proxy": 0.1, "best_step": None} for s in (0, 2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in evals))
    lines = rep.curves_only(path, tmp_path / "curves")
    assert not any(line.startswith("best evaluation") for line in lines)
    path.write_text("".join(json.dumps({**r, "best_step": 2}) + "\n" for r in evals))
    assert "best evaluation: step 2; its models are in <step-3 output>/best" in rep.curves_only(path, tmp_path / "c")
    path.write_text("".join(json.dumps({**r, "best_step": 0}) + "\n" for r in evals))  # this run's best.json
    assert any(line.startswith("best evaluation: step 0 by gold (0.125)") for line in rep.curves_only(path, tmp_path))


@pytest.mark.parametrize("value", ["-5", "0", "1"])
def test_report_refuses_a_max_seq_len_too_short_for_a_pair(folders, tmp_path, value):
    """``--max_seq_len`` truncates the held-out pairs as step 2 does: under 2 is refused in one line
    (not an OverflowError, nor an accuracy of meaningless pairs) before anything is written."""
    with pytest.raises(UserError, match=f"--max_seq_len must be at least 2 .*got {value}; pass --max_seq_len 2"):
        rep.main(["--sft", str(folders["sft"]), "--rlhf", str(folders["rlhf"]), "--reward", str(folders["reward"]),
                  "--out", str(tmp_path / "out"), "--max_seq_len", value, "--max_prompts", "1", "--max_pairs", "4",
                  "--max_new_tokens", "2", "--device", "cpu"])
    assert not (tmp_path / "out").exists()


def test_report_refuses_answers_that_run_past_an_actors_positions(folders, tmp_path):
    """OPT's position table (tiny-opt: 512): --max_new_tokens 600 was an IndexError mid-report, with an
    empty --out folder left behind."""
    from dschat.models.registry import resolve_model_path

    opt = resolve_model_path("tiny-opt")
    with pytest.raises(UserError, match=r"--max_new_tokens 600 after the longest held-out prompt's \d+ tokens runs "
                                        r"past the 512 positions of .*; give --max_new_tokens \d+ or less"):
        rep.main(["--sft", opt, "--rlhf", opt, "--reward", str(folders["reward"]), "--out", str(tmp_path / "out"),
                  "--max_prompts", "2", "--max_pairs", "4", "--max_new_tokens", "600", "--device", "cpu"])
    assert not (tmp_path / "out").exists()


def test_metrics_file_is_found_for_the_best_actor_and_a_step3_output_folder(tmp_path):
    """step 3 writes metrics.jsonl in its --output_dir: found from <out>/actor, <out>/best/actor and <out>."""
    (tmp_path / "best" / "actor").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text('{"global_step": 1, "reward": 0.5}\n')
    for actor in (tmp_path / "actor", tmp_path / "best" / "actor", tmp_path):
        assert rep.find_metrics_file(actor) == tmp_path / "metrics.jsonl", actor
    assert rep.find_metrics_file(tmp_path / "other" / "actor") is None


def test_a_misspelled_metrics_path_is_refused_before_any_model_loads(folders, tmp_path, monkeypatch):
    monkeypatch.setattr(scoring, "load_actor", lambda *a: pytest.fail("a model loaded before --metrics was checked"))
    with pytest.raises(UserError, match=r"^--metrics .*metrcs\.jsonl does not exist; pass step 3's "):
        rep.build_report(folders["sft"], folders["rlhf"], folders["reward"], tmp_path / "out",
                         metrics=folders["base"] / "step3" / "metrcs.jsonl")
    assert not (tmp_path / "out").exists()


def test_a_step3_output_folder_means_its_actor_and_is_refused_as_the_reward_model(folders, tmp_path):
    from helpers.step3 import make_critic_folder

    step3 = folders["base"] / "step3"  # holds actor/, as step 3's --output_dir
    assert scoring.check_actor_folder(step3) == step3 / "actor"
    make_critic_folder("tiny-llama", tmp_path / "out" / "critic")
    with pytest.raises(UserError, match=rf"^--reward {tmp_path}/out is a step-3 output folder, not a reward model; "
                                        rf"pass the step-2 --output_dir, or {tmp_path}/out/critic for step 3's "):
        scoring.check_reward_folder(tmp_path / "out")


def test_a_step2_lora_adapter_folder_is_a_reward_model(tmp_path):
    """A step-2 LoRA save's lora_adapter/ (value head beside it) loads as the merged folder beside it."""
    from helpers.step3 import make_lora_inputs, max_abs_diff

    critic = make_lora_inputs("tiny-llama", tmp_path)["critic"]
    assert scoring.check_reward_folder(critic / "lora_adapter") == critic / "lora_adapter"
    merged, _ = scoring.load_reward(critic, torch.device("cpu"))
    adapter, _ = scoring.load_reward(critic / "lora_adapter", torch.device("cpu"))
    assert max_abs_diff(merged.state_dict(), adapter.state_dict()) < 1e-5


def test_non_finite_evaluation_scores_are_said_as_nan_in_the_summary(tmp_path):
    """Step 3 writes a NaN score as NaN; the report's JSON holds it as null, and the summary printed
    after report.json crashed on it (formatting None)."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"kind": "eval", "global_step": 0, "proxy": 0.5, "judges": {"gold": 1.0}}\n'
                       '{"kind": "eval", "global_step": 2, "proxy": NaN, "judges": {"gold": NaN}}\n')
    summary = rep._finite(rep.evaluation_summary(rep.read_eval_records(metrics)))
    assert summary["last"]["proxy"] is None
    lines = rep.evaluation_lines(summary)
    assert lines[0].endswith("step 0 proxy 0.500, gold 1.000 -> step 2 proxy nan, gold nan"), lines


@pytest.mark.parametrize("step", ["null", '"2"', "true", "1e999", "[1]"])
def test_an_evaluation_record_with_a_damaged_step_is_skipped(tmp_path, step):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"kind": "eval", "global_step": 0, "proxy": 0.5, "judges": {}}\n[1]\n"text"\n'
                       f'{{"kind": "eval", "global_step": {step}, "proxy": 0.7, "judges": {{}}}}\n')
    assert [r["proxy"] for r in rep.read_eval_records(metrics)] == [0.5]
