"""Step 3 with a reward model of another family (``--reward_model_name_or_path``) and with sequence
classifiers, end to end on tiny models (CPU): a tiny-llama actor scored by a tiny-opt reward model
under PPO (the critic from the actor, fresh value head) and GRPO (a one-label classifier), one under
ZeRO-3; the same-tokenizer path bit-identical to the default run; the flag rules."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from dschat.models.reward_inputs import CrossTokenizerInputs, encode_for_reward, reward_max_length

from helpers.step3 import base_argv, load_state, make_classifier, refused_in_process, step3_main

pytestmark = pytest.mark.usefixtures("one_thread")

CRITIC_LINE = "critic: the tokenizer of {critic} differs from the actor's ("
FRESH = "the critic starts from the actor tiny-llama with a fresh value head"


def _argv(critic, data, *extra, steps=2):
    argv = base_argv("tiny-llama", critic or Path("unused"), data, *extra, steps=steps)
    if critic is None:
        i = argv.index("--critic_model_name_or_path")
        del argv[i:i + 2]
    return argv


def _finite(result):
    assert len(result.history) == 2
    for record in result.history:
        assert math.isfinite(record["reward"]) and math.isfinite(record["actor_loss"]), record


def _score_directly(engine, folder, rows):
    """The reward model's end scores of ``(prompt, answer, ended)`` texts tokenised by hand with the
    tokenizer of its ``folder`` (no ScoringPasses, no CrossTokenizerInputs), right-padded."""
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    limit = reward_max_length(tok, AutoConfig.from_pretrained(folder))
    encoded = [encode_for_reward(tok, prompt, answer, ended, limit) for prompt, answer, ended in rows]
    width = max(len(r) for r in encoded)
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in encoded])
    m = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in encoded])
    with torch.no_grad():
        values = engine.reward.module.forward_value(ids, m, return_value_only=True)
    return values.gather(1, (m.cumsum(1).argmax(1)).unsqueeze(1)).squeeze(1)


@pytest.mark.slow
def test_ppo_with_a_critic_folder_of_another_tokenizer(tmp_path, critic_dirs, data_cache, capsys):
    # --critic_model_name_or_path of tiny-opt: the reward model (its default) scores re-tokenised text,
    # and the critic, which must read the actor's ids, starts from the actor.
    critic = critic_dirs["tiny-opt"]
    result = step3_main().main(_argv(critic, data_cache, "--output_dir", str(tmp_path / "out")))
    logs = capsys.readouterr().out
    _finite(result)
    assert CRITIC_LINE.format(critic=critic) in logs and FRESH in logs
    assert f"reward model: the tokenizer of {critic} differs from the actor's" in logs
    engine = result.rlhf_engine
    assert type(engine.critic.module.rwtransformer).__name__ == "LlamaModel"
    assert type(engine.reward.module.rwtransformer).__name__ == "OPTModel"
    assert isinstance(engine.reward_inputs, CrossTokenizerInputs)
    # The scores step 3 computes are the reward model's on the re-tokenised rows: an ended answer, and
    # one longer than the reward model's 512 positions (it reads the last 512 tokens).
    tok = result.tokenizer
    text, short, long = "Human: hello there Assistant:", " hi", " hello there" * 150
    prompt = tok([text] * 2, return_tensors="pt")["input_ids"]
    answers = [tok(short, add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
               tok(long, add_special_tokens=False)["input_ids"]]
    assert len(answers[1]) > 512
    width = max(len(a) for a in answers)
    answer = torch.tensor([a + [tok.pad_token_id] * (width - len(a)) for a in answers])
    seq = torch.cat([prompt, answer], 1)
    mask = torch.cat([torch.ones_like(prompt), torch.tensor([[1] * len(a) + [0] * (width - len(a))
                                                             for a in answers])], 1)
    got = result.trainer.passes.reward_scores(seq, mask, mask.cumsum(1) - 1, None, prompt.shape[1])
    assert torch.equal(got, _score_directly(engine, critic, [(text, short, True), (text, long, False)]))


@pytest.mark.slow
def test_grpo_scored_by_a_sequence_classifier_of_another_family(tmp_path, data_cache, capsys):
    # The reward model under ZeRO-3 (its stage follows the critic's flag), built from the classifier.
    # A held-out judge of another family too: a classifier read from the rendered text.
    classifier = make_classifier("tiny-opt", tmp_path / "classifier")
    judge = make_classifier("tiny-opt", tmp_path / "judge", seed=1)
    result = step3_main().main(_argv(None, data_cache, "--algorithm", "grpo", "--num_generations", "2",
                                     "--reward_model_name_or_path", str(classifier), "--critic_zero_stage", "3",
                                     "--eval_interval", "1", "--eval_prompts", "3", "--eval_judge", str(judge)))
    logs = capsys.readouterr().out
    _finite(result)
    judged = [r["per_prompt"][str(judge)] for r in result.evaluations]
    assert len(judged) == 3 and all(len(x) == 3 and all(math.isfinite(v) for v in x) for x in judged)
    assert result.rlhf_engine.critic is None and "critic:" not in logs
    assert f"reward model: the tokenizer of {classifier} differs from the actor's" in logs
    assert result.rlhf_engine.reward_inputs is not None
    assert result.rlhf_engine.reward.zero_optimization_stage() == 3


@pytest.mark.slow
def test_ppo_with_a_classifier_of_the_actors_tokenizer_as_critic_and_reward(tmp_path, data_cache, capsys):
    classifier = make_classifier("tiny-llama", tmp_path / "classifier")
    result = step3_main().main(_argv(classifier, data_cache))
    logs = capsys.readouterr().out
    _finite(result)
    assert "critic:" not in logs and "reward model: the tokenizer" not in logs
    engine = result.rlhf_engine
    assert engine.reward_inputs is None and not engine.critic_from_actor
    # The frozen reward model's value head is the classifier's score row.
    score = load_state(classifier)["score.weight"]
    assert torch.equal(engine.reward.module.v_head.weight.detach(), score)


@pytest.mark.slow
def test_ppo_under_zero3_with_only_a_reward_model_of_another_family(tmp_path, critic_dirs, data_cache, capsys):
    result = step3_main().main(_argv(None, data_cache, "--reward_model_name_or_path", str(critic_dirs["tiny-opt"]),
                                     "--actor_zero_stage", "3", "--critic_zero_stage", "3"))
    logs = capsys.readouterr().out
    _finite(result)
    assert "critic: no --critic_model_name_or_path; " + FRESH in logs
    engine = result.rlhf_engine
    assert engine.reward.zero_optimization_stage() == 3 and engine.critic.zero_optimization_stage() == 3
    assert all(math.isfinite(r["critic_loss"]) for r in result.history)


@pytest.mark.slow
def test_a_reward_model_of_the_actors_tokenizer_scores_as_the_default_run(tmp_path, critic_dirs, data_cache, capsys):
    # The same folder at another path, given as --reward_model_name_or_path: the actor's ids, untouched.
    copy = Path(shutil.copytree(critic_dirs["tiny-llama"], tmp_path / "rm_copy"))
    default = step3_main().main(_argv(critic_dirs["tiny-llama"], data_cache))
    given = step3_main().main(_argv(critic_dirs["tiny-llama"], data_cache, "--reward_model_name_or_path", str(copy)))
    logs = capsys.readouterr().out
    assert "critic:" not in logs and "reward model: the tokenizer" not in logs
    assert given.rlhf_engine.reward_inputs is None
    keys = ("reward", "actor_loss", "critic_loss", "kl_to_ref")
    assert [[r[k] for k in keys] for r in given.history] == [[r[k] for k in keys] for r in default.history]


def test_a_multi_label_reward_model_is_refused_before_any_model(tmp_path, data_cache, capsys):
    folder = make_classifier("tiny-opt", tmp_path / "two", num_labels=2)
    line = refused_in_process(_argv(None, data_cache, "--reward_model_name_or_path", str(folder)), capsys)
    assert f"{folder} is a sequence classifier with num_labels 2" in line and "num_labels=1" in line


def test_ppo_without_any_critic_or_reward_folder_is_refused(data_cache, capsys):
    line = refused_in_process(_argv(None, data_cache), capsys)
    assert "--critic_model_name_or_path is required for --algorithm ppo's critic" in line
    assert "--reward_model_name_or_path" in line
