"""Step 3's held-out evaluation (--eval_interval), the over-optimization alarm and the best checkpoint.

The alarm's rule on hand-made series; the flag rules and bad judges (one line, exit 2, nothing
written); tiny-model runs: PPO with evaluation against the same run without it (identical training),
its records and best checkpoint, an interrupted and resumed run reproducing both (and, up to the
interruption, a second fresh run with the same seed reproducing the records), and a critic-free run
stopped by the alarm; two ranks against one."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from dschat.errors import UserError
from dschat.models.registry import resolve_model_path
from dschat.rlhf.heldout import evaluation as ev
from dschat.eval.metrics_file import read_eval_records
from dschat.rlhf.heldout.evaluation import token_entropy
from dschat.rlhf.heldout.setup import Judge
from dschat.rlhf.heldout.alarm import Alarm, EvalPoint, best_index, overoptimization_alarm, paired_change
from dschat.runtime import fs

from helpers.step3 import (
    STEP3_MAIN,
    Interrupted,
    base_argv,
    crash_after_checkpoint,
    load_state,
    max_abs_diff,
    refused_in_process,
    step3_main,
    subprocess_env,
)
from helpers.steps import deepspeed_cmd


@pytest.fixture(autouse=True, scope="module")  # module: before the module-scoped runs (same float sums)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------ the rule

def test_paired_change_by_hand():
    # differences 1, 2, 3: mean 2, sample sd 1, SE 1 / sqrt(3)
    mean, se = paired_change([0.0, 0.0, 0.0], [1.0, 2.0, 3.0])
    assert mean == pytest.approx(2.0) and se == pytest.approx(1 / math.sqrt(3))
    assert paired_change([1.0], [0.0]) == (-1.0, math.inf)  # one prompt: no noise estimate
    with pytest.raises(ValueError):
        paired_change([1.0, 2.0], [1.0])


def _series(proxies, judges):
    """Evaluations at steps 0, 10, 20, ... from per-prompt proxy and judge scores."""
    return [EvalPoint(10 * i, tuple(p), {"gold": tuple(j)}) for i, (p, j) in enumerate(zip(proxies, judges))]


BASE = [0.0, 1.0, 2.0, 3.0]


def test_alarm_fires_when_the_proxy_rises_and_the_judge_falls_beyond_its_noise():
    # Judge differences -1.0, -1.1, -0.9, -1.0 against two evaluations back: mean -1.0, SE 0.041; proxy +0.5.
    series = _series([BASE, BASE, [x + 0.5 for x in BASE]],
                     [BASE, BASE, [x + d for x, d in zip(BASE, (-1.0, -1.1, -0.9, -1.0))]])
    alarm = overoptimization_alarm(series, best_step=10)
    assert isinstance(alarm, Alarm)
    assert (alarm.step, alarm.since, alarm.judge, alarm.best_step) == (20, 0, "gold", 10)
    assert alarm.proxy_change == pytest.approx(0.5) and alarm.judge_change == pytest.approx(-1.0)
    assert alarm.judge_se == pytest.approx(math.sqrt(0.02 / 3) / 2)
    assert "OVER-OPTIMIZATION at step 20" in alarm.line() and "judge gold fell -1.0000" in alarm.line()


def test_alarm_silent_when_both_rise():
    series = _series([BASE, [x + 0.5 for x in BASE]], [BASE, [x + 0.3 for x in BASE]])
    assert overoptimization_alarm(series) is None


def test_alarm_silent_when_the_judge_falls_within_its_noise():
    # Differences -1, +1, -1, +0.6: mean -0.1, SE 0.5 -> within 2 SE (and within 1 SE).
    series = _series([BASE, [x + 0.5 for x in BASE]], [BASE, [x + d for x, d in zip(BASE, (-1, 1, -1, 0.6))]])
    assert overoptimization_alarm(series) is None
    assert overoptimization_alarm(series, sigmas=0.1) is not None  # the same fall, a looser threshold


def test_alarm_silent_when_the_proxy_does_not_rise_and_with_one_evaluation():
    series = _series([BASE, [x - 0.1 for x in BASE]], [BASE, [x - 2 for x in BASE]])
    assert overoptimization_alarm(series) is None
    assert overoptimization_alarm(series[:1]) is None


def test_alarm_compares_with_the_evaluation_window_steps_back():
    # The judge fell from step 0 to 10, then stayed: against two back (step 10 at step 30) no fall.
    falls = [x - 1 for x in BASE]
    series = _series([BASE, [x + 1 for x in BASE], [x + 2 for x in BASE], [x + 3 for x in BASE]],
                     [BASE, falls, falls, falls])
    assert overoptimization_alarm(series[:3]) is not None  # step 20 vs step 0
    assert overoptimization_alarm(series) is None  # step 30 vs step 10
    assert overoptimization_alarm(series, window=3) is not None  # step 30 vs step 0


def test_best_index_and_token_entropy():
    series = _series([[1.0], [3.0], [3.0]], [[0.0], [2.0], [1.0]])
    assert best_index(series, "proxy") == 1 and best_index(series, "gold") == 1 and best_index([], "gold") is None
    uniform = torch.zeros(2, 3, 8)
    assert torch.allclose(token_entropy(uniform), torch.full((2, 3), math.log(8)))
    assert float(token_entropy(torch.tensor([0.0, -1e9]))) == pytest.approx(0.0, abs=1e-6)


def test_one_batchs_measurements_by_hand():
    """``_score_batch`` on hand-set tensors (a stub trainer): KL to the reference is actor minus reference
    log-probs over the actor's tokens only (not padding, not an episode's observations), the entropy is
    of the logits at the sampling temperature, and each row keeps its own ended flag and proxy + the
    environment's reward."""
    from types import SimpleNamespace

    torch.manual_seed(0)
    B, P, L, V, T = 2, 2, 6, 7, 2.0
    seq = torch.randint(0, V, (B, L))
    att = torch.ones(B, L, dtype=torch.long)
    att[1, -1] = 0  # row 1: its last answer position is padding
    observation = torch.zeros(B, L - 1)
    observation[0, P] = 1  # row 0: its second answer token is an environment's
    actor_logits, ref_logits = torch.randn(B, L, V), torch.randn(B, L, V)

    def log_probs(logits, tokens):
        return torch.log_softmax(logits[:, :-1] / T, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)

    generated = SimpleNamespace(seq=seq, masks=SimpleNamespace(attention_mask=att, position_ids=None),
                                env_reward=torch.tensor([0.5, -1.0]), observation_mask=observation,
                                ended=torch.tensor([True, False]))
    trainer = SimpleNamespace(
        experience=SimpleNamespace(generate_answers=lambda *a, **k: generated),
        generator=SimpleNamespace(scoring_mode=lambda: None), logit_temperature=T, _log_probs=log_probs,
        actor_model=lambda *a, **k: SimpleNamespace(logits=actor_logits),
        ref_model=lambda *a, **k: SimpleNamespace(logits=ref_logits),
        _reward_scores=lambda *a, **k: torch.tensor([1.0, 2.0]),
        _decode_for_hook=lambda *a: (["p", "p"], ["a", "b"]))
    owner = SimpleNamespace(trainer=trainer, _judge=lambda *a: {"gold": [3.0, 4.0]})
    rows = ev._Rows(judges={"gold": []})
    ev.StepThreeEvaluation._score_batch(owner, seq[:, :P], att[:, :P], [7, 8], rows)

    mask = att[:, P:].float() * (1 - observation[:, P - 1:])
    kl = ((log_probs(actor_logits, seq) - log_probs(ref_logits, seq))[:, P - 1:] * mask).sum(-1)
    entropy = (token_entropy(actor_logits[:, P - 1:-1] / T) * mask).sum(-1)
    assert mask.sum(-1).tolist() == [3.0, 3.0]
    assert rows.index == [7, 8] and rows.proxy == [1.5, 1.0] and rows.judges == {"gold": [3.0, 4.0]}
    assert rows.kl == pytest.approx(kl.tolist(), abs=1e-6) and rows.entropy == pytest.approx(entropy.tolist(), abs=1e-6)
    assert rows.tokens == [3, 3] and rows.ended == [True, False]


def test_a_non_finite_evaluation_is_never_best_nor_an_alarm_and_pins_nothing():
    nan = [x if i else math.nan for i, x in enumerate(BASE)]  # one NaN score: a NaN mean
    falls = [x - 1 for x in BASE]
    series = _series([BASE, BASE, [x + 0.5 for x in BASE], [x + 1 for x in BASE]], [BASE, nan, falls, falls])
    # Step 30 against two evaluations back: step 10's judge is NaN, so the finite step 0 is the comparison.
    alarm = overoptimization_alarm(series)
    assert alarm is not None and (alarm.step, alarm.since) == (30, 0)
    # A NaN or inf newest evaluation fires nothing, whatever it is compared with.
    for bad in (nan, [-math.inf] * 4):
        assert overoptimization_alarm([series[0], EvalPoint(40, tuple(x + 1 for x in BASE), {"gold": tuple(bad)})]) is None
    assert overoptimization_alarm([series[0], EvalPoint(40, tuple(nan), {"gold": tuple(falls)})]) is None
    # best: the highest finite mean, a NaN first evaluation included.
    assert best_index(_series([[1.0], [0.5], [2.0]], [[math.nan], [0.5], [math.inf]]), "gold") == 1
    assert best_index(_series([[math.nan]], [[0.0]]), "proxy") is None


def test_the_non_finite_line_names_only_what_the_evaluation_does_not_count_for():
    """The best checkpoint only for the --save_best_by series; the alarm for the proxy, else that judge's."""
    nan, inf = math.nan, math.inf
    line = ev.not_finite_line
    assert line(3, {"proxy": 1.0, "gold": 2.0}, "gold") is None
    assert line(3, {"proxy": nan, "gold": 2.0, "rm": 1.0}, "gold") == (
        "[eval] step 3: the mean of proxy nan is not finite (a score was NaN or inf): this evaluation does not count "
        "for the over-optimization alarm")
    assert line(3, {"proxy": nan, "gold": 2.0}, "proxy").endswith(
        "counts neither for the best checkpoint nor for the over-optimization alarm")
    assert line(3, {"proxy": 1.0, "gold": 2.0, "rm": inf}, "gold").endswith(
        "the mean of judge rm inf is not finite (a score was NaN or inf): this evaluation does not count for the "
        "over-optimization alarm of judge rm")
    assert line(3, {"proxy": 1.0, "gold": nan, "rm": inf}, "gold").endswith(
        "counts neither for the best checkpoint nor for the over-optimization alarm of judge gold, rm")
    # No judge (no alarm) and no best checkpoint: nothing is compared on it.
    assert line(3, {"proxy": nan}, None) == "[eval] step 3: the mean of proxy nan is not finite (a score was NaN or inf)"


def test_a_function_judges_nan_reaches_the_evaluation_and_a_non_number_is_still_refused():
    """A judge only observes: its NaN or inf makes the evaluation's mean not finite (the line above)
    instead of stopping the run; a string is no score there either."""
    from dschat.rewards import RewardFunction
    from dschat.rlhf.heldout.setup import resolve_judges

    (judge,) = resolve_judges(["dschat.rewards:math_exact_match"], ["dschat/builtin"])
    assert judge.fn.nonfinite_numbers and judge.fn.require_finite
    scores = RewardFunction("j:nan", lambda p, a: [math.nan, 1e39], nonfinite_numbers=True)(["p", "q"], ["a", "b"])
    assert math.isnan(scores[0]) and scores[1] == 1e39
    with pytest.raises(UserError, match=r"reward function j:str returned '0.5' for row 0"):
        RewardFunction("j:str", lambda p, a: ["0.5", 1.0], nonfinite_numbers=True)(["p", "q"], ["a", "b"])
    with pytest.raises(UserError, match=r"reward function f:nan returned nan for row 0"):  # a reward's is refused
        RewardFunction("f:nan", lambda p, a: [math.nan, 1.0])(["p", "q"], ["a", "b"])


def test_the_run_reports_a_non_finite_mean_and_later_finite_evaluations_compete(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    saved = []
    monkeypatch.setattr(ev, "save_best", lambda output_dir, models, tokenizer, info, rank, **_: saved.append(info["step"]))
    args = SimpleNamespace(eval_interval=1, eval_alarm_sigmas=2.0, save_best_by="judge", output_dir=str(tmp_path),
                           stop_on_overoptimization=True)
    engine = SimpleNamespace(actor=object(), critic=None, actor_ema=None)
    trainer = SimpleNamespace(prompt_columns=object(), tokenizer=None, rlhf_engine=engine)
    evaluation = ev.StepThreeEvaluation(args, trainer, [], [Judge("j", fn=object())])
    # (proxy, judge) per prompt at steps 0..4: NaN first (it would pin best/ for good), a best at 1, an
    # inf at 2 (proxy up, judge down: no alarm from it), worse at 3, better at 4.
    scores = [([0.0, 0.0], [math.nan, 1.0]), ([0.0, 0.1], [1.0, 1.0]), ([5.0, 5.0], [-math.inf, 0.0]),
              ([0.0, 0.0], [0.5, 0.5]), ([0.0, 0.3], [3.0, 3.0])]
    records = []
    for step, (proxy, judge) in enumerate(scores):
        rows = ev._Rows([0, 1], proxy, {"j": judge}, [0.0, 0.0], [0.0, 0.0], [1, 1], [True, True])
        monkeypatch.setattr(evaluation, "_evaluate_shard", lambda rows=rows: rows)
        records.append(evaluation.maybe_evaluate(step))
    assert saved == [1, 4]
    assert [r["new_best"] for r in records] == [False, True, False, False, True]
    assert evaluation.best == {"step": 4, "by": "j", "score": 3.0}
    assert not evaluation.alarms and not evaluation.should_stop
    out = capsys.readouterr().out
    assert "[eval] step 0: the mean of judge j nan is not finite (a score was NaN or inf): this evaluation counts " \
           "neither for the best checkpoint nor for the over-optimization alarm of judge j" in out
    assert "[eval] step 2: the mean of judge j -inf is not finite" in out
    assert "step 1: the mean" not in out and "step 4: the mean" not in out
    # A best score that is not finite (restored from a checkpoint) is beaten by the next finite evaluation.
    evaluation.best = {"step": 4, "by": "j", "score": math.nan}
    rows = ev._Rows([0, 1], [0.0, 0.0], {"j": [-5.0, -5.0]}, [0.0, 0.0], [0.0, 0.0], [1, 1], [True, True])
    monkeypatch.setattr(evaluation, "_evaluate_shard", lambda: rows)
    assert evaluation.maybe_evaluate(5)["new_best"] and saved == [1, 4, 5]


def test_loading_a_reward_model_judge_draws_nothing_from_trainings_random_numbers(critic_dirs):
    """A folder judge loads (its value head is built) after the engines and before the first rollout:
    it drew from the global torch generator, so every sampled rollout of the run changed with it."""
    from types import SimpleNamespace

    args = SimpleNamespace(eval_interval=1, eval_alarm_sigmas=2.0, save_best_by="none", output_dir=None,
                           stop_on_overoptimization=False)
    trainer = SimpleNamespace(prompt_columns=object(), tokenizer=None, device=torch.device("cpu"),
                              rlhf_engine=SimpleNamespace(actor=object(), critic=None, actor_ema=None))
    torch.manual_seed(0)
    before = torch.get_rng_state()
    evaluation = ev.StepThreeEvaluation(args, trainer, [], [Judge("rm", folder=critic_dirs["tiny-opt"])])
    assert set(evaluation._judge_models) == {"rm"}
    assert torch.equal(torch.get_rng_state(), before)


def test_a_resume_on_other_held_out_prompts_is_one_line():
    """The series is paired prompt by prompt: a checkpoint measured on 6 prompts resumed with
    --eval_prompts 8 ended in a traceback at the first alarm check, after a PPO step; other prompts of
    the same count (another split or prompt length) silently compared other prompts."""
    from dschat.rlhf.heldout.setup import check_same_prompts, prompts_digest

    six = [(torch.tensor([i, i + 1]),) for i in range(6)]
    state = {"history": [{"step": 0, "proxy": [0.0] * 6, "judges": {}}], "prompts": prompts_digest(six)}
    check_same_prompts(state, prompts_digest(six), 6)
    check_same_prompts({"history": []}, prompts_digest(six), 8)  # nothing measured yet
    check_same_prompts({"history": state["history"]}, "any", 6)  # a checkpoint without the digest: the count
    with pytest.raises(UserError) as err:
        check_same_prompts(state, prompts_digest(six + six[:2]), 8)
    assert str(err.value).startswith("the checkpoint's evaluations were made on 6 held-out prompts, and this run's "
                                     "are 8 prompts: its series, best score and alarm cannot go on here")
    other = [(torch.tensor([i, i + 2]),) for i in range(6)]
    with pytest.raises(UserError, match="made on 6 held-out prompts, and this run's are 6 other prompts"):
        check_same_prompts(state, prompts_digest(other), 6)


def test_best_models_on_disk_that_score_higher_stay_the_best(tmp_path, monkeypatch, capsys):
    """After a roll back to an earlier checkpoint (or a kill between a best save and the next
    checkpoint), best/ may hold models that score higher than the checkpoint's best: only a higher
    evaluation replaces them. A best.json by another series, or unreadable, is no bar."""
    from types import SimpleNamespace

    saved = []
    monkeypatch.setattr(ev, "save_best", lambda output_dir, models, tokenizer, info, rank, **_: saved.append(info["step"]))
    args = SimpleNamespace(eval_interval=1, eval_alarm_sigmas=2.0, save_best_by="judge", output_dir=str(tmp_path),
                           stop_on_overoptimization=False)
    trainer = SimpleNamespace(prompt_columns=object(), tokenizer=None,
                              rlhf_engine=SimpleNamespace(actor=object(), critic=None, actor_ema=None))
    (tmp_path / "best").mkdir()

    def evaluation_after_resume(on_disk: str, checkpoint_best: dict | None, run: str | None = None
                                ) -> ev.StepThreeEvaluation:
        (tmp_path / "best").mkdir(exist_ok=True)
        (tmp_path / "best" / "best.json").write_text(on_disk)
        evaluation = ev.StepThreeEvaluation(args, trainer, [], [Judge("j", fn=object())])
        state = {"history": [], "best": checkpoint_best, "alarms": [], "seconds": [0.0, 0.0, 0.0], "run": run}
        evaluation.restore(SimpleNamespace(extra={"evaluation": state}))
        return evaluation

    def evaluate(evaluation: ev.StepThreeEvaluation, step: int, judge: float) -> bool:
        rows = ev._Rows([0], [0.0], {"j": [judge]}, [0.0], [0.0], [1], [True])
        monkeypatch.setattr(evaluation, "_evaluate_shard", lambda: rows)
        return evaluation.maybe_evaluate(step)["new_best"]

    evaluation = evaluation_after_resume('{"step": 6, "by": "j", "score": 2.0}', {"step": 2, "by": "j", "score": 1.0})
    assert evaluation.best == {"step": 6, "by": "j", "score": 2.0}
    assert "the best models in" in capsys.readouterr().out
    assert not evaluate(evaluation, 3, 1.5) and evaluate(evaluation, 4, 2.5) and saved == [4]
    # The checkpoint's best is higher, or best.json is damaged: the checkpoint's stays.
    for on_disk in ('{"step": 6, "by": "j", "score": 0.5}', '{"step": 6'):
        evaluation = evaluation_after_resume(on_disk, {"step": 2, "by": "j", "score": 1.0})
        assert evaluation.best == {"step": 2, "by": "j", "score": 1.0}
    # By run id: this run's best/ is the bar; another run's (its checkpoint had no best yet) is set aside.
    capsys.readouterr()
    evaluation = evaluation_after_resume('{"step": 6, "by": "j", "score": 2.0, "run": "mine"}', None, run="mine")
    assert evaluation.best == {"step": 6, "by": "j", "score": 2.0} and evaluation.run_id == "mine"
    evaluation = evaluation_after_resume('{"step": 6, "by": "j", "score": 2.0, "run": "older"}', None, run="mine")
    assert evaluation.best is None and not (tmp_path / "best").exists()
    assert '"run": "older"' in (tmp_path / "best.earlier" / "best.json").read_text()
    assert f"held an earlier run's best models: now in {tmp_path / 'best.earlier'}" in capsys.readouterr().out
    assert evaluate(evaluation, 7, 0.1) and saved[-1] == 7  # no bar: any finite evaluation is the best now
    # The checkpoint's best evaluation, whose models another run's best/ had replaced: gone, so the next saves.
    shutil.rmtree(tmp_path / "best.earlier")  # (with it there, setting best/ aside is refused: the next test)
    evaluation = evaluation_after_resume('{"step": 6, "by": "j", "score": 2.0, "run": "older"}',
                                         {"step": 2, "by": "j", "score": 1.0}, run="mine")
    assert evaluation.best is None and "the best models of step 2 are not in" in capsys.readouterr().out
    # A checkpoint from a dschat that kept no run id: best/ is its run's (and best.earlier/ stays).
    evaluation = evaluation_after_resume('{"step": 6, "by": "j", "score": 2.0, "run": "saved"}', None)
    assert evaluation.best == {"step": 6, "by": "j", "score": 2.0} and evaluation.run_id == "saved"
    assert '"run": "older"' in (tmp_path / "best.earlier" / "best.json").read_text()


def test_a_resume_with_save_best_by_none_keeps_no_best_from_the_checkpoint(tmp_path, monkeypatch):
    """The checkpoint's best (by a judge) would otherwise stand for good: every later record's best_step
    pointing at it, and the closing line and report naming it, whatever later evaluations score."""
    from types import SimpleNamespace

    args = SimpleNamespace(eval_interval=1, eval_alarm_sigmas=2.0, save_best_by="none", output_dir=str(tmp_path),
                           stop_on_overoptimization=False)
    trainer = SimpleNamespace(prompt_columns=object(), tokenizer=None,
                              rlhf_engine=SimpleNamespace(actor=object(), critic=None, actor_ema=None))
    evaluation = ev.StepThreeEvaluation(args, trainer, [], [Judge("j", fn=object())])
    state = {"history": [], "best": {"step": 1, "by": "j", "score": 1.0}, "alarms": [], "seconds": [0.0, 0.0, 0.0],
             "run": "mine"}
    evaluation.restore(SimpleNamespace(extra={"evaluation": state}))
    assert evaluation.best is None
    rows = ev._Rows([0], [0.0], {"j": [5.0]}, [0.0], [0.0], [1], [True])
    monkeypatch.setattr(evaluation, "_evaluate_shard", lambda: rows)
    record = evaluation.maybe_evaluate(2)
    assert (record["best_step"], record["new_best"]) == (None, False)
    assert "best evaluation" not in evaluation.finish()


def test_a_resume_that_would_keep_the_best_by_another_series_stops_and_leaves_best_as_it_is(tmp_path, monkeypatch):
    """A run kept best/ by the proxy; resumed with --eval_judge (whose default --save_best_by is judge)
    it would compare judge scores with the proxy's bar: best/ replaced by a worse model, or (the other
    way round) never again. The resume stops with one line naming both ways on; with best/ moved away
    the new series starts afresh."""
    from types import SimpleNamespace

    monkeypatch.setattr(ev, "save_best", lambda *args, **kwargs: None)
    trainer = SimpleNamespace(prompt_columns=object(), tokenizer=None,
                              rlhf_engine=SimpleNamespace(actor=object(), critic=None, actor_ema=None))

    def resume(save_best_by: str, kept: str, judge: str = "gold") -> ev.StepThreeEvaluation:
        args = SimpleNamespace(eval_interval=1, eval_alarm_sigmas=2.0, save_best_by=save_best_by,
                               output_dir=str(tmp_path), stop_on_overoptimization=False)
        evaluation = ev.StepThreeEvaluation(args, trainer, [], [Judge(judge, fn=object())])
        state = {"history": [], "best": {"step": 6, "by": kept, "score": -0.2}, "alarms": [],
                 "seconds": [0.0, 0.0, 0.0], "run": "mine"}
        evaluation.restore(SimpleNamespace(extra={"evaluation": state}))
        return evaluation

    for save_best_by, kept, same in (("judge", "proxy", "--save_best_by proxy"),
                                     ("proxy", "gold", "--save_best_by judge with --eval_judge gold first")):
        (tmp_path / "best").mkdir()
        info = f'{{"step": 6, "by": "{kept}", "score": -0.2, "run": "mine"}}'
        (tmp_path / "best" / "best.json").write_text(info)
        with pytest.raises(UserError, match=f"by {kept}, and this run would keep them by") as refused:
            resume(save_best_by, kept)
        assert f"pass {same} to go on as before" in str(refused.value)
        assert (tmp_path / "best" / "best.json").read_text() == info
        assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]
        shutil.rmtree(tmp_path / "best")  # moved away: the new series starts without a bar
        assert resume(save_best_by, kept).best is None
    # A folder judge spelled another way (its --eval_judge text names the series) is the same series.
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "best.json").write_text(f'{{"step": 6, "by": "{tmp_path}/rm/", "score": -0.2, "run": "mine"}}')
    assert resume("judge", f"{tmp_path}/rm/", judge=f"{tmp_path}/./rm").best == {
        "step": 6, "by": f"{tmp_path}/rm/", "score": -0.2}


def test_one_judge_folder_given_twice_by_two_spellings_is_refused(critic_dirs):
    """It loaded the same model twice and kept two identical series."""
    from dschat.rlhf.heldout.setup import resolve_judges

    folder = critic_dirs["tiny-opt"]
    with pytest.raises(UserError, match=r"^--eval_judge given twice: .* name the same folder; give it once$"):
        resolve_judges([str(folder), str(folder) + "/"], ["dschat/builtin"])


def test_a_judge_folder_named_proxy_is_refused_and_never_the_proxys_series(tmp_path, monkeypatch):
    """``--eval_judge proxy`` (a reward-model folder ``./proxy``) would be named ``proxy``: its scores
    read as the step's own reward's (the alarm comparing the proxy with itself, best/ kept by the
    proxy). Refused in one line naming the fix; spelled ``./proxy`` it is a judge like any other,
    and another series than the proxy's on resume."""
    from dschat.rlhf.heldout.best import same_series
    from dschat.rlhf.heldout.setup import resolve_judges

    monkeypatch.chdir(tmp_path)
    (tmp_path / "proxy").mkdir()
    with pytest.raises(UserError, match=r"^--eval_judge proxy: 'proxy' names the step's own reward \(the proxy\) in "
                                        r"the evaluation's records; spell the folder \./proxy$"):
        resolve_judges(["proxy"], ["dschat/builtin"])
    assert not same_series("proxy", "./proxy") and not same_series(str(tmp_path / "proxy"), "proxy")
    assert same_series("proxy", "proxy") and same_series("./rm", str(tmp_path / "rm"))


def test_a_run_with_no_evaluation_to_continue_sets_an_earlier_runs_best_models_aside(tmp_path, monkeypatch, capsys):
    """A fresh run's first evaluation, of the starting models, would replace an earlier run's best/:
    that folder becomes best.earlier/ (an older best.earlier/ goes) before anything is evaluated."""
    from types import SimpleNamespace

    monkeypatch.setattr(ev, "save_best", lambda output_dir, models, tokenizer, info, rank, **_: None)
    args = SimpleNamespace(eval_interval=1, eval_alarm_sigmas=2.0, save_best_by="judge", output_dir=str(tmp_path),
                           stop_on_overoptimization=False)
    trainer = SimpleNamespace(prompt_columns=object(), tokenizer=None,
                              rlhf_engine=SimpleNamespace(actor=object(), critic=None, actor_ema=None))
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "best.json").write_text('{"step": 6, "by": "j", "score": 2.0, "run": "first"}')
    evaluation = ev.StepThreeEvaluation(args, trainer, [], [Judge("j", fn=object())])
    evaluation.restore(None)
    assert evaluation.best is None and not (tmp_path / "best").exists()
    assert '"run": "first"' in (tmp_path / "best.earlier" / "best.json").read_text()
    assert f"held an earlier run's best models: now in {tmp_path / 'best.earlier'}" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.earlier"]
    # A second run's best/ with best.earlier/ there already: setting it aside would lose the older one.
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "best.json").write_text('{"step": 6, "by": "j", "score": 1.0, "run": "second"}')
    with pytest.raises(UserError, match=f"move {tmp_path / 'best.earlier'} away"):
        ev.StepThreeEvaluation(args, trainer, [], [Judge("j", fn=object())]).restore(None)
    assert '"run": "first"' in (tmp_path / "best.earlier" / "best.json").read_text()
    assert '"run": "second"' in (tmp_path / "best" / "best.json").read_text()
    shutil.rmtree(tmp_path / "best")
    # A best/ of step 0 holds the starting models of a run that stopped early: it goes, best.earlier/ stays.
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "best.json").write_text('{"step": 0, "by": "j", "score": 0.5}')
    ev.StepThreeEvaluation(args, trainer, [], [Judge("j", fn=object())]).restore(None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.earlier"]
    assert '"run": "first"' in (tmp_path / "best.earlier" / "best.json").read_text()
    assert "the starting models of a run that stopped before a better evaluation" in capsys.readouterr().out
    # A rename that fails is one line, and best/ stays.
    shutil.rmtree(tmp_path / "best.earlier")
    (tmp_path / "best").mkdir()
    from types import SimpleNamespace as Module

    from dschat.rlhf.heldout import best as best_folder

    def refused(*_):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(best_folder, "os", Module(replace=refused, getpid=lambda: 1))
    with pytest.raises(UserError, match=r"cannot set the earlier run's .*best aside \(Permission denied\); move it"):
        ev.StepThreeEvaluation(args, trainer, [], [Judge("j", fn=object())]).restore(None)
    assert (tmp_path / "best").is_dir()


# ------------------------------------------------------------------------------------ ranks and cost

def test_eval_batches_are_the_same_for_any_number_of_ranks():
    # 6 prompts in batches of 4: batch 0 = prompts 0-3, batch 1 = 4, 5 and repeats of 0, 1 (uncounted).
    one = [(0, [(0, 0), (1, 1), (2, 2), (3, 3)]), (1, [(4, 4), (5, 5), (-1, 0), (-1, 1)])]
    assert ev.eval_batches(6, 4, 0, 1) == one
    assert ev.eval_batches(6, 4, 0, 2) == one[:1] and ev.eval_batches(6, 4, 1, 2) == one[1:]
    # A third rank has no batch of its own: it repeats batch 0, counting nothing (ZeRO-3 collectives).
    assert ev.eval_batches(6, 4, 2, 3) == [(2, [(-1, 0), (-1, 1), (-1, 2), (-1, 3)])]
    for n, size in ((1, 4), (5, 2), (16, 8), (17, 8)):
        full = ev.eval_batches(n, size, 0, 1)
        for world in (2, 3, 4):
            shares = [ev.eval_batches(n, size, rank, world) for rank in range(world)]
            assert len({len(share) for share in shares}) == 1  # the same number of batches on every rank
            real = sorted(b for share in shares for b in share if b[0] < len(full))
            assert real == full  # the same batches, with the same numbers (seeds)
            counted = sorted(i for share in shares for _, rows in share for i, _ in rows if i >= 0)
            assert counted == list(range(n))


@pytest.mark.parametrize("given, interval", [
    ((), 0),  # upstream's default: no evaluation
    (("--eval_judge", "gold"), "auto"),  # a judge asks for the evaluation: its interval keeps it at <= 10 %
    (("--save_best_by", "proxy"), "auto"),
    (("--eval_judge", "gold", "--eval_interval", "5"), 5),  # a given interval stays
    (("--eval_interval", "0"), 0),
])
def test_eval_interval_default_follows_the_evaluation_flags(given, interval):
    from dschat.cli.step3 import EVAL_INTERVAL_AUTO
    from dschat.rlhf.heldout.setup import check_eval_args
    args = step3_main().parse_args(["--data_path", "dschat/builtin", "--actor_model_name_or_path", "a",
                       "--critic_model_name_or_path", "c", "--output_dir", "out", *given])
    if "--eval_interval" not in given:
        assert args.eval_interval is None  # left out: decided by check_eval_args
    judges = check_eval_args(args)
    assert args.eval_interval == (EVAL_INTERVAL_AUTO if interval == "auto" else interval)
    assert [j.name for j in judges] == (["gold"] if "gold" in given else [])


def test_planned_ppo_steps_count_only_whole_rollouts():
    from types import SimpleNamespace

    from dschat.rlhf.heldout.cost import planned_ppo_steps

    def planned(total, per_rollout, **args):
        trainer = SimpleNamespace(rlhf_engine=SimpleNamespace(num_total_iters=total),
                                  plan=SimpleNamespace(optimizer_steps_per_rollout=per_rollout))
        return planned_ppo_steps(SimpleNamespace(enable_test_mode=False, **args), trainer)

    # 3 prompt batches, --generation_batches 2, one optimizer step a batch: the schedule counts 3 steps,
    # but only one rollout of 2 batches is made (the third batch waits for a partner that never comes).
    assert planned(3, 2.0) == 1
    assert planned(4, 2.0) == 2 and planned(20, 1.0) == 20 and planned(1, 4.0) == 1
    assert planned_ppo_steps(SimpleNamespace(), SimpleNamespace()) is None


def test_auto_interval_by_hand():
    from dschat.rlhf.heldout.cost import auto_interval, eval_share

    # E = 1 s, S = 5 s, 20 steps: N = 2 gives 11 evaluations, 11 / (11 + 100) = 9.9 %; N = 1 gives 17.4 %.
    assert eval_share(1.0, 5.0, 20, 2) == pytest.approx(11 / 111)
    assert auto_interval(1.0, 5.0, 20) == 2
    # Without a planned length, the long-run share E / (N S + E) <= 10 %: N >= 9 E / S = 1.8.
    assert auto_interval(1.0, 5.0, None) == 2
    # E = 40 s, S = 30 s (the CPU demo's shape): N >= 12 over a long run; over 100 steps
    # 9 x 40 x (100 // N + 1) <= 100 x 30 fails at N = 12 (9 evaluations) and holds at 13 (8, 9.6 %).
    assert auto_interval(40.0, 30.0, None) == 12
    assert auto_interval(40.0, 30.0, 100) == 13 and eval_share(40.0, 30.0, 100, 13) == pytest.approx(320 / 3320)
    # Too short a run for 10 %: evaluate before the first step and after the last.
    assert auto_interval(40.0, 30.0, 10) == 10
    # Later: 200 s of evaluations spent by step 50 of 100; k = 50 // N more of 40 s fit in 10 % when
    # (200 + 40 k) x 9 <= 3000, i.e. k <= 3: the smallest N with 50 // N <= 3 is 13 (50 // 12 = 4).
    assert auto_interval(40.0, 30.0, 100, since=50, spent=200.0) == 13
    assert eval_share(40.0, 30.0, 100, 13, since=50, spent=200.0) == pytest.approx(320 / 3320)


def _auto_run(monkeypatch, step_seconds, planned=20, steps=None):
    """``--eval_interval auto`` on a fake clock: evaluations take 1 s, PPO step i ``step_seconds[i]``;
    returns the evaluated steps, the measured share and the evaluation."""
    from types import SimpleNamespace

    now = [0.0]
    monkeypatch.setattr(ev, "time", SimpleNamespace(time=lambda: now[0]))

    def evaluate(self):
        now[0] += 1.0
        return ev._Rows(index=[0, 1], proxy=[1.0, 2.0], kl=[0.0, 0.0], entropy=[1.0, 1.0], tokens=[3, 3],
                        ended=[True, True])

    monkeypatch.setattr(ev.StepThreeEvaluation, "_evaluate_shard", evaluate)
    plan = SimpleNamespace(optimizer_steps_per_rollout=1.0)
    trainer = SimpleNamespace(prompt_columns=None, plan=plan, rlhf_engine=SimpleNamespace(num_total_iters=planned))
    args = SimpleNamespace(eval_interval="auto", eval_alarm_sigmas=2.0, save_best_by="none", output_dir=None,
                           enable_test_mode=False, stop_on_overoptimization=False)
    evaluation = ev.StepThreeEvaluation(args, trainer, [(torch.tensor([1]),), (torch.tensor([2]),)], [])
    made = []
    for step in range((planned if steps is None else steps) + 1):
        if step:
            now[0] += step_seconds[step - 1]  # a PPO step
        if evaluation.maybe_evaluate(step) is not None:
            made.append(step)
    return made, evaluation.eval_seconds / now[0], evaluation


def test_auto_interval_schedules_evaluations_within_a_tenth_of_the_wall_time(monkeypatch):
    # Steady costs (E = 1 s, S = 5 s, 20 steps): every 2 steps, 11 evaluations, 9.9 %.
    made, share, evaluation = _auto_run(monkeypatch, [5.0] * 20)
    assert made == list(range(0, 21, 2)) and share == pytest.approx(11 / 111)
    assert evaluation.state()["next_step"] is None  # scheduled once the step after the last one is timed
    # A first step slowed by warm-up (20 s, then 2 s) is not timed: at step 2, (1 + 20 // N) / (1 +
    # 20 // N + 40) <= 10 % first holds at N = 6; at step 7, (2 + 14 // N) / (... + 40) at N = 5; at
    # step 17 one more (the last step's) is over 10 % by the estimate, and is made: a run ends evaluated.
    made, share, _ = _auto_run(monkeypatch, [20.0] + [2.0] * 19)
    assert made == [0, 6, 11, 16, 20] and share <= 0.10
    # One PPO step (never timed: warm-up), or a resume one step before the end: the last step is still
    # evaluated (the trained actor was never judged, and best/ kept the starting models).
    assert _auto_run(monkeypatch, [5.0], planned=1)[0] == [0, 1]
    # A run past its plan (resumed with more ranks or larger batches: fewer planned steps than done)
    # goes on by the measured costs (every 2 steps here), not every step.
    made = _auto_run(monkeypatch, [5.0] * 20, planned=5, steps=20)[0]
    assert made == [0, 3, 5, 7, 9, 11, 13, 15, 17, 19], made
    # Steps that slow down (2 s, then 10 s after step 6): the next evaluations move apart.
    made, share, _ = _auto_run(monkeypatch, [2.0] * 6 + [10.0] * 14)
    gaps = [b - a for a, b in zip(made, made[1:])]
    assert gaps == sorted(gaps, reverse=True) and gaps[0] > gaps[-1] and share <= 0.10


# ------------------------------------------------------------------------------------ bad input

def _argv(data, *extra, critic=None, steps=4, model="tiny-opt"):
    argv = base_argv(model, critic or Path("unused"), data, *extra, steps=steps)
    if critic is None:  # critic-free, scored by a reward function: no step-2 folder
        i = argv.index("--critic_model_name_or_path")
        del argv[i:i + 2]
        argv += ["--algorithm", "grpo", "--num_generations", "2", "--reward_fn", "reward_fixtures:length"]
    return argv


def _train_only_file(folder: Path) -> Path:
    """12 rows of the embedded data in one file: its 9:1 held-out share gives phase 3 no eval rows."""
    from dschat.data.builtin import read_rows

    path = folder / "prefs.jsonl"
    path.write_text("".join(json.dumps({k: r[k] for k in ("prompt", "chosen", "rejected")}) + "\n"
                            for r in read_rows("train")[:12]))
    return path


@pytest.mark.parametrize("extra, message", [
    (("--eval_interval", "2", "--eval_judge", "nonsense"), "--eval_judge 'nonsense' is neither 'gold'"),
    (("--eval_interval", "2", "--eval_judge", "no_such_module_xyz:fn"), "--eval_judge no_such_module_xyz:fn: cannot import"),
    (("--eval_interval", "2", "--eval_judge", "reward_fixtures:NOT_CALLABLE"), "is a int, not a function"),
    (("--eval_interval", "0", "--eval_judge", "gold"), "--eval_judge need(s) the held-out evaluation"),
    (("--eval_interval", "2", "--save_best_by", "judge"), "--save_best_by judge needs a judge"),
    (("--eval_interval", "2", "--stop_on_overoptimization"), "give --eval_judge"),
    (("--eval_alarm_sigmas", "3"), "--eval_alarm_sigmas need(s) the held-out evaluation"),
    (("--eval_prompts", "4"), "--eval_prompts need(s) the held-out evaluation"),
    (("--eval_interval", "2", "--eval_alarm_sigmas", "3"), "--eval_alarm_sigmas: the alarm compares the proxy with a "
                                                           "judge; give --eval_judge"),
    (("--eval_interval", "-1",), "--eval_interval must be >= 0"),
    (("--eval_interval", "2", "--eval_judge", "gold", "--eval_alarm_sigmas", "inf"),
     "--eval_alarm_sigmas must be a finite number > 0, got inf"),
    ("train-only", "has no held-out prompts"),
    ("gold-elsewhere", "the gold judge scores the embedded data only"),
])
def test_bad_evaluation_input_is_one_line_and_writes_nothing(extra, message, tmp_path, data_cache, capsys):
    out = tmp_path / "out"
    argv = _argv(data_cache, "--output_dir", str(out))
    if isinstance(extra, str):  # the data itself: a file without held-out rows for phase 3
        argv[argv.index("--data_path") + 1] = str(_train_only_file(tmp_path))
        extra = ("--eval_interval", "2") + (("--eval_judge", "gold") if extra == "gold-elsewhere" else ())
    assert message in refused_in_process(argv + list(extra), capsys)
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("judge, message", [
    ("reward_fixtures:always_raises", "--eval_judge: reward function reward_fixtures:always_raises raised KeyError"),
    ("reward_fixtures:one_short", "reward function reward_fixtures:one_short returned 3 scores for 4 answers"),
])
def test_a_failing_judge_stops_the_run_before_anything_is_written(judge, message, tmp_path, data_cache, capsys):
    out = tmp_path / "out"
    line = refused_in_process(_argv(data_cache, "--output_dir", str(out), "--eval_interval", "2", "--eval_prompts", "4",
                          "--eval_judge", judge), capsys)
    assert message in line
    assert not out.exists()


# ------------------------------------------------------------------------------------ runs

TIMING = ("seconds", "eval_share")
TRAINING = ("actor_loss", "critic_loss", "reward", "ema_reward", "kl_to_ref", "response_length", "approx_kl",
            "ratio_mean", "clip_frac", "kept", "dropped", "global_step")


def _untimed(records):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def _eval_lines(out: Path):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def ppo_runs(tmp_path_factory, critic_dirs, data_cache):
    """Tiny OPT PPO with EMA, 4 steps: evaluated every 2 steps (gold judge, best by gold) and not."""
    root = tmp_path_factory.mktemp("eval_runs")
    main = step3_main().main

    def argv(out, *more):
        return base_argv("tiny-opt", critic_dirs["tiny-opt"], data_cache, "--enable_ema", "--actor_dropout", "0.1",
                         "--output_dir", str(out), *more, steps=4)

    evaluated = ("--eval_interval", "2", "--eval_prompts", "6", "--eval_judge", "gold", "--save_interval", "1")
    # An earlier run's metrics.jsonl: the fresh run starts its own (test_ppo_evaluation_records_and_best_checkpoint).
    (root / "with").mkdir()
    (root / "with" / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "global_step": 0, "stale": True}) + "\n")
    return {"argv": argv, "evaluated": evaluated, "root": root,
            "with": main(argv(root / "with", *evaluated)), "without": main(argv(root / "without"))}


@pytest.mark.slow
def test_evaluation_changes_nothing_in_training(ppo_runs):
    a, b = ppo_runs["with"], ppo_runs["without"]
    assert len(a.history) == len(b.history) == 4
    for x, y in zip(a.history, b.history):
        assert {k: x[k] for k in TRAINING} == {k: y[k] for k in TRAINING}
    root = ppo_runs["root"]
    for name in ("actor", "critic", "actor_ema"):
        assert max_abs_diff(load_state(root / "with" / name), load_state(root / "without" / name)) == 0.0, name
    assert b.evaluations == [] and not (root / "without" / "best").exists()


@pytest.mark.slow
def test_ppo_evaluation_records_and_best_checkpoint(ppo_runs):
    out = ppo_runs["root"] / "with"
    records = ppo_runs["with"].evaluations
    assert [r["global_step"] for r in records] == [0, 2, 4]
    for r in records:
        assert r["kind"] == "eval" and r["prompts"] == 6 and set(r["judges"]) == {"gold"}
        for key in ("proxy", "proxy_se", "response_length", "eos_rate", "entropy", "kl_to_ref"):
            assert math.isfinite(r[key]), (key, r)
        assert len(r["per_prompt"]["proxy"]) == len(r["per_prompt"]["gold"]) == 6
        assert r["judges"]["gold"] == pytest.approx(sum(r["per_prompt"]["gold"]) / 6)
    assert records[0]["kl_to_ref"] == pytest.approx(0.0, abs=1e-5)  # the actor is the reference before step 1
    # --eval_interval auto plans over the run's PPO steps: --test_stop_step 4 (one generation batch a step).
    from dschat.rlhf.heldout.cost import planned_ppo_steps

    trainer = ppo_runs["with"].trainer
    assert planned_ppo_steps(trainer.args, trainer) == 4
    # metrics.jsonl: the evaluation records interleaved with the training ones, in order.
    lines = _eval_lines(out)
    assert [(x.get("kind", "train"), x["global_step"]) for x in lines] == [
        ("eval", 0), ("train", 0), ("train", 1), ("eval", 2), ("train", 2), ("train", 3), ("eval", 4)]
    assert _untimed([x for x in lines if x.get("kind") == "eval"]) == _untimed(records)
    # The best evaluation by gold (the earliest on ties), its models and its record.
    golds = [r["judges"]["gold"] for r in records]
    best = records[golds.index(max(golds))]
    info = json.loads((out / "best" / "best.json").read_text())
    assert (info["step"], info["by"], info["score"]) == (best["global_step"], "gold", best["judges"]["gold"])
    # The folder is written atomically, so it carries the completion marker of dschat.runtime.fs too.
    assert sorted(p.name for p in (out / "best").iterdir()) == sorted([
        "actor", "actor_ema", "best.json", "critic", fs.SAVED_MARKER])
    assert records[-1]["best_step"] == best["global_step"]
    if best["global_step"] == 0:  # the best is the actor before training: the step-1 weights themselves
        assert max_abs_diff(load_state(Path(resolve_model_path("tiny-opt"))), load_state(out / "best" / "actor")) == 0.0


@pytest.mark.slow
def test_resume_reproduces_the_evaluation_records_and_the_best_checkpoint(ppo_runs, monkeypatch):
    """Interrupted after the checkpoint of step 2 (a fresh run with the same seed: its records so far
    are the first run's), then resumed: the records, the best checkpoint and the file are the
    uninterrupted run's."""
    root, argv, evaluated = ppo_runs["root"], ppo_runs["argv"], ppo_runs["evaluated"]
    main = step3_main().main
    tb = ("--enable_tensorboard", "--tensorboard_path", str(root / "resumed-tb"))
    crash_after_checkpoint(monkeypatch, optimizer_steps=2)
    with pytest.raises(Interrupted):
        main(argv(root / "resumed", *evaluated, *tb))
    monkeypatch.undo()
    full = ppo_runs["with"].evaluations
    first = [x for x in _eval_lines(root / "resumed") if x.get("kind") == "eval"]
    assert _untimed(first) == _untimed(full[:2])  # same seed, same records (determinism)
    resumed = main(argv(root / "resumed", *evaluated, *tb, "--resume"))
    assert _untimed(resumed.evaluations) == _untimed(full[2:])
    # TensorBoard: the resume purges step 2 on, the checkpoint's evaluation at step 2 included, and
    # logs that evaluation again: every evaluation shows once.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(root / "resumed-tb" / "step3_tensorboard_logs")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/proxy")] == [
        (r["global_step"], pytest.approx(r["proxy"])) for r in full]
    lines, want = _eval_lines(root / "resumed"), _eval_lines(root / "with")
    assert [(x.get("kind"), x["global_step"]) for x in lines] == [(x.get("kind"), x["global_step"]) for x in want]
    assert _untimed(x for x in lines if x.get("kind")) == _untimed(x for x in want if x.get("kind"))
    best, best_want = (json.loads((root / run / "best" / "best.json").read_text()) for run in ("resumed", "with"))
    assert isinstance(best.pop("run"), str) and isinstance(best_want.pop("run"), str)  # each run's own id
    assert best == best_want
    for name in ("actor", "critic", "actor_ema"):
        assert max_abs_diff(load_state(root / "with" / "best" / name), load_state(root / "resumed" / "best" / name)) == 0.0


@pytest.mark.slow
def test_a_resume_with_another_eval_prompts_stops_before_training(ppo_runs, tmp_path, capsys):
    root, argv, evaluated = ppo_runs["root"], ppo_runs["argv"], ppo_runs["evaluated"]
    shutil.copytree(root / "with", tmp_path / "again")
    more = [x if x != "6" else "4" for x in evaluated]  # --eval_prompts 4
    line = refused_in_process(argv(tmp_path / "again", *more, "--resume", "--test_stop_step", "6"), capsys)
    assert line.startswith("error: the checkpoint's evaluations were made on 6 held-out prompts, and this run's "
                           "are 4 prompts"), line


@pytest.mark.slow
def test_critic_free_run_with_evaluation_stops_on_the_alarm(tmp_path, critic_dirs, data_cache, monkeypatch,
                                                            capsys):
    """GRPO scored by a reward function, judged by a column-reading function and a reward-model
    folder, best by the proxy; the alarm (forced at step 2: its rule is tested above) ends the run
    there with everything saved."""
    real = overoptimization_alarm

    def fires_at_two(series, **kw):
        if series[-1].step == 2:
            return Alarm(2, 0, "reward_fixtures:chosen_overlap", 0.5, 0.1, -0.5, 0.1, 2.0, kw.get("best_step"))
        return real(series, **kw)

    monkeypatch.setattr(ev, "overoptimization_alarm", fires_at_two)
    out = tmp_path / "out"
    flags = _argv(data_cache, "--output_dir", str(out), "--eval_interval", "1", "--eval_prompts", "5", "--eval_judge",
                  "reward_fixtures:chosen_overlap", "--save_best_by", "proxy", "--eval_judge", str(critic_dirs["tiny-opt"]),
                  "--stop_on_overoptimization", "--save_interval", "1")
    result = step3_main().main(flags)
    logs = capsys.readouterr().out
    assert len(result.history) == 2 and [r["global_step"] for r in result.evaluations] == [0, 1, 2]
    assert "[eval] OVER-OPTIMIZATION at step 2" in logs and "--stop_on_overoptimization: ending the run at step 2" in logs
    assert result.evaluations[-1]["alarm"]["step"] == 2
    assert all(0.0 <= s <= 1.0 for r in result.evaluations for s in r["per_prompt"]["reward_fixtures:chosen_overlap"])
    rm_scores = [r["per_prompt"][str(critic_dirs["tiny-opt"])] for r in result.evaluations]
    assert all(len(x) == 5 and all(math.isfinite(v) for v in x) for x in rm_scores) and len({tuple(x) for x in rm_scores}) > 1
    proxies = [r["proxy"] for r in result.evaluations]
    info = json.loads((out / "best" / "best.json").read_text())
    assert (info["by"], info["step"]) == ("proxy", proxies.index(max(proxies)))
    assert sorted(p.name for p in (out / "best").iterdir()) == sorted(["actor", "best.json", fs.SAVED_MARKER])  # no critic, no EMA
    assert (out / "actor").is_dir()  # the final save still happened
    assert "evaluations took" in logs and "of step-3 wall time" in logs
    # Resumed with the flag, the series' alarm ends the run again, and a line says why (it trained
    # nothing and said nothing before).
    again = step3_main().main([*flags, "--resume"])
    assert again.history == [] and ("[eval] --stop_on_overoptimization: the resumed evaluation series raised the "
                                    "over-optimization alarm at step 2, so the run ends without training") in \
        capsys.readouterr().out


@pytest.mark.slow
def test_auto_evaluates_a_run_that_ends_before_its_planned_last_step(tmp_path, data_cache, monkeypatch):
    """A run that ends before the step ``auto`` planned to end at (``--dynamic_sampling`` uses prompt
    batches up; stood in for by a plan of 50 steps for a 2-step run) is still evaluated at its end: the
    trained actor was judged last at the step before the first one otherwise (the next evaluation,
    scheduled 10 steps on, never came)."""
    monkeypatch.setattr(ev, "planned_ppo_steps", lambda config, trainer: 50)
    monkeypatch.setattr(ev, "auto_interval", lambda *args, **kwargs: 10)
    result = step3_main().main(_argv(data_cache, "--eval_prompts", "2", "--eval_judge", "reward_fixtures:length",
                                     steps=2))
    assert len(result.history) == 2 and [r["global_step"] for r in result.evaluations] == [0, 2]


@pytest.mark.slow
def test_two_ranks_zero2_with_evaluation(ppo_runs, tmp_path):
    """Two CPU ranks under the DeepSpeed launcher (ZeRO-2), evaluated as ``ppo_runs`` is: the run
    finishes and saves, trains on both ranks, and its evaluation before the first step equals the
    one-rank run's record for record (the same batches, seeded alike, gathered on every rank). Later
    records differ only because two ranks train on other prompts than one. Rank 0 alone prints,
    writes metrics.jsonl and writes best/ (nothing left behind beside it)."""
    out = tmp_path / "out"
    argv = ppo_runs["argv"](out, *ppo_runs["evaluated"][:6], "--actor_zero_stage", "2", "--critic_zero_stage", "2")
    argv[argv.index("--test_stop_step") + 1] = "2"
    proc = subprocess.run(deepspeed_cmd(str(STEP3_MAIN), *argv), cwd=tmp_path, env=subprocess_env(),
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("Average reward score") == 2  # rank 0 only, two iterations
    assert "Batch Size: 8" in proc.stdout  # 4 rows on each of the 2 ranks
    assert max_abs_diff(load_state(Path(resolve_model_path("tiny-opt"))), load_state(out / "actor")) > 0
    assert (out / "critic" / "v_head.safetensors").exists()
    lines = _eval_lines(out)
    assert [(x.get("kind", "train"), x["global_step"]) for x in lines] == [
        ("eval", 0), ("train", 0), ("train", 1), ("eval", 2)]
    assert proc.stdout.count("[eval] step ") == 2
    records = [x for x in lines if x.get("kind") == "eval"]
    assert _untimed(records[:1]) == _untimed(ppo_runs["with"].evaluations[:1])
    assert records[1]["prompts"] == 6 and len(records[1]["per_prompt"]["gold"]) == 6
    golds = [r["judges"]["gold"] for r in records]
    info = json.loads((out / "best" / "best.json").read_text())
    assert (info["step"], info["score"]) == (2 * golds.index(max(golds)), max(golds))
    assert sorted(p.name for p in (out / "best").iterdir()) == sorted([
        "actor", "actor_ema", "best.json", "critic", fs.SAVED_MARKER])
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no partial or old copies


# ------------------------------------------------------------------------------------ the report

def test_report_draws_the_evaluation_curves_and_names_the_alarm(tmp_path, capsys):
    """``--curves_only``: both figures from a metrics.jsonl alone; the training curves ignore the
    evaluation records, the summary names the best step and the alarm."""
    from dschat.eval import report

    alarm = {"step": 4, "since": 0, "judge": "gold", "proxy_change": 0.8, "proxy_se": 0.1, "judge_change": -0.6,
             "judge_se": 0.2, "sigmas": 2.0, "best_step": 2}
    lines = [{"global_step": 0, "reward": 1.0, "kl_to_ref": 0.0, "response_length": 30.0}]
    for step, proxy, gold in ((0, 1.0, 1.5), (2, 1.4, 1.7), (4, 1.8, 1.1)):
        lines.append({"kind": "eval", "global_step": step, "proxy": proxy, "proxy_se": 0.1, "judges": {"gold": gold},
                      "judges_se": {"gold": 0.2}, "kl_to_ref": 0.01 * step, "response_length": 30.0 + step,
                      "eos_rate": 1.0, "entropy": 2.0, "best_step": 2 if step else 0,
                      "alarm": alarm if step == 4 else None})
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert report.read_metrics(metrics) == [{"step": 0.0, "reward": 1.0, "kl_to_ref": 0.0, "response_length": 30.0}]
    assert [r["global_step"] for r in read_eval_records(metrics)] == [0, 2, 4]
    report.main(["--curves_only", "--metrics", str(metrics), "--out", str(tmp_path / "rep")])
    out = capsys.readouterr().out
    assert (tmp_path / "rep" / report.EVAL_PLOT_FILE).stat().st_size > 0
    assert (tmp_path / "rep" / report.PLOT_FILE).stat().st_size > 0
    assert "best evaluation: step 2" in out and "OVER-OPTIMIZATION alarm at step 4" in out and "judge gold -0.600" in out
    assert "step 0 proxy 1.000, gold 1.500 -> step 4 proxy 1.800, gold 1.100" in out
    with pytest.raises(Exception, match="--sft, --rlhf, --reward required"):
        report.main(["--out", str(tmp_path / "rep")])


def test_a_step2_lora_adapter_judge_loads_and_a_step3_output_folder_is_refused(tmp_path):
    """--eval_judge takes what --critic_model_name_or_path takes: a step-2 LoRA save's lora_adapter/
    passes the start-up check and loads as the evaluation loads its judges; a step-3 output folder is one
    line naming --eval_judge, at start-up."""
    from dschat.eval.scoring import load_reward
    from dschat.rlhf.heldout.setup import resolve_judges
    from helpers.step3 import make_critic_folder, make_lora_inputs

    adapter = make_lora_inputs("tiny-llama", tmp_path)["critic"] / "lora_adapter"
    (judge,) = resolve_judges([str(adapter)], ["dschat/builtin"])
    assert judge.folder == adapter
    model, _ = load_reward(judge.folder, torch.device("cpu"))
    assert model.v_head.weight.shape[0] == 1
    make_critic_folder("tiny-llama", tmp_path / "out" / "critic")
    with pytest.raises(UserError, match=rf"^--eval_judge {tmp_path}/out is a step-3 output folder, not a reward "
                                        rf"model; pass the step-2 --output_dir, or {tmp_path}/out/critic for "):
        resolve_judges([str(tmp_path / "out")], ["dschat/builtin"])


def test_held_out_prompts_are_distinct_in_the_datasets_order(tmp_path):
    """Several pairs per prompt (as in SHP): each prompt is evaluated once, and --eval_prompts counts
    distinct prompts."""
    import argparse

    from dschat.rlhf.heldout.setup import heldout_prompt_items

    from helpers.data import make_tokenizer, write_jsonl

    texts = [" Human: a? Assistant:", " Human: a? Assistant:", " Human: b? Assistant:", " Human: a? Assistant:",
             " Human: c? Assistant:", " Human: d? Assistant:"]
    write_jsonl(tmp_path / "d" / "train.jsonl", [{"prompt": t, "chosen": " x", "rejected": " y"} for t in texts])
    write_jsonl(tmp_path / "d" / "eval.jsonl", [{"prompt": t, "chosen": f" {i}", "rejected": " y"}
                                                for i, t in enumerate(texts)])
    tokenizer = make_tokenizer()
    args = argparse.Namespace(data_path=[str(tmp_path / "d")], data_split="0,0,1", data_output_path=str(tmp_path / "c"),
                              seed=1234, max_prompt_seq_len=32, end_of_conversation_token=None, eval_prompts=10,
                              eval_interval=1, env=None)
    items = heldout_prompt_items(args, tokenizer, -1)  # 6 rows, 4 distinct prompts
    assert len({tuple(item[0][item[1].bool()].tolist()) for item in items}) == len(items) == 4
    args.eval_prompts = 2
    assert len(heldout_prompt_items(args, tokenizer, -1)) == 2
