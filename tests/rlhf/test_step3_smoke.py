"""Step 3 end to end on tiny models (CPU): a cover of ZeRO 0/2/3 x LoRA x offload x EMA x PPO-ptx,
the on-policy ratio, step-normalised losses, off-policy detection and a toy run whose gold-judge
reward rises. (The 2-rank DeepSpeed launch is in test_step3_evaluation.py, evaluated.)"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dschat.models.registry import resolve_model_path

from helpers.step3 import base_argv, load_state, max_abs_diff, step3_main
from helpers.steps import (
    assert_causal_adapter_matches,
    assert_reward_adapter_matches,
    assert_saved_in_format,
    require_cuda_accelerator,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def _initial_actor(model: str) -> dict[str, torch.Tensor]:
    return load_state(Path(resolve_model_path(model)))


def _assert_reloads(out: Path, model: str, ema: bool) -> None:
    from transformers import AutoModelForCausalLM

    from dschat.models.build import create_critic_model
    from dschat.models.tokenizer import load_hf_tokenizer

    for sub in ("actor", "actor_ema") if ema else ("actor",):
        AutoModelForCausalLM.from_pretrained(out / sub)
        assert not any("lora" in k for k in load_state(out / sub))  # fused and dropped
    create_critic_model(str(out / "critic"), load_hf_tokenizer(str(out / "critic")), None, rlhf_training=True)


# ------------------------------------------------------------------------------------ the cover

COVER = {
    # ZeRO-0, full fine-tuning, PPO-ptx, TensorBoard, --print_answers, HE flag (CPU fallback)
    "z0-ptx-tb": ("tiny-opt", ["--unsupervised_dataset_name", "dschat/builtin", "--unsup_coef", "0.5",
                               "--enable_tensorboard", "--print_answers", "--enable_hybrid_engine"]),
    # ZeRO-3 actor and critic (reference and reward then ZeRO-3 too), LoRA on both, EMA, actor grad-ckpt;
    # saved in both formats (upstream's test asserts pytorch_model.bin in actor/ and critic/)
    "z3-lora-ema": ("tiny-llama", ["--actor_zero_stage", "3", "--critic_zero_stage", "3", "--actor_lora_dim", "4",
                                   "--critic_lora_dim", "4", "--enable_ema", "--actor_gradient_checkpointing",
                                   "--save_format", "both"]),
    # pad == eos == bos; ZeRO-2 actor, ZeRO-3 critic, CPU offload (+ reward offload: ZeRO-3 like the
    # critic), only-LoRA actor, EMA, critic grad-ckpt; saved in upstream's layout only (pytorch_model.bin);
    # actor and critic given as dschat's PEFT LoRA adapters (merged into their bases on load, the
    # critic's and reward's under ZeRO-3)
    "z2-offload-quirk": ("tiny-opt-quirk", ["--actor_zero_stage", "2", "--critic_zero_stage", "3", "--offload",
                                            "--offload_reward_model",
                                            "--actor_lora_dim", "4", "--only_optimize_lora", "--enable_ema",
                                            "--critic_gradient_checkpointing", "--save_format", "bin"]),
    # ZeRO-3 actor with offload (+ reference offload: ZeRO-3 like the actor), ZeRO-1 critic (offload needs
    # ZeRO >= 1), PPO-ptx, two generation batches, two PPO epochs (off-policy: warned)
    "z3-offload-ptx-multi": ("tiny-llama", ["--actor_zero_stage", "3", "--critic_zero_stage", "1", "--offload",
                                            "--offload_reference_model", "--unsupervised_dataset_name",
                                            "dschat/builtin", "--generation_batches", "2", "--ppo_epochs", "2"]),
}


FROM_ADAPTERS = {"z2-offload-quirk"}


@pytest.mark.parametrize("name", list(COVER))
def test_smoke_cover(name, tmp_path, critic_dirs, lora_inputs, data_cache, capsys):
    model, extra = COVER[name]
    out = tmp_path / "out"
    # The starting actor and critic: merged folders, or, given as adapters, what those merge into.
    start_actor, start_critic = Path(resolve_model_path(model)), critic_dirs[model]
    actor = critic = None
    if name in FROM_ADAPTERS:
        start_actor, start_critic = lora_inputs["actor"], lora_inputs["critic"]
        actor, critic = start_actor / "lora_adapter", start_critic / "lora_adapter"
    argv = base_argv(model, critic or start_critic, data_cache, *extra, "--output_dir", str(out),
                     "--tensorboard_path", str(tmp_path / "tb"), actor=actor)
    result = step3_main().main(argv)
    logs = capsys.readouterr().out

    assert result.history, "no PPO iteration ran"
    for record in result.history:
        for key in ("actor_loss", "critic_loss", "reward", "kl_to_ref", "response_length"):
            assert math.isfinite(record[key]), (key, record)
        if "--unsupervised_dataset_name" in extra:
            assert math.isfinite(record["unsup_loss"]) and record["unsup_loss"] > 0
    # Upstream's log lines.
    assert "***** Running training (total_iters=" in logs and "Beginning of Epoch 1/1" in logs
    assert "| PPO Epoch: " in logs and "| Unsupervised Loss: " in logs and "EMA reward score: " in logs
    assert "-" * 85 in logs and "End-to-End => Latency" in logs and "Initialized Critic Model" in logs

    # Weights moved, outputs reload; the EMA moved less than the actor.
    initial_actor = load_state(start_actor)
    actor_change = max_abs_diff(initial_actor, load_state(out / "actor"))
    assert actor_change > 0
    assert max_abs_diff(load_state(start_critic), load_state(out / "critic")) > 0
    ema = "--enable_ema" in extra
    if ema:
        assert 0 < max_abs_diff(initial_actor, load_state(out / "actor_ema")) < actor_change
    else:
        assert not (out / "actor_ema").exists()
    save_format = extra[extra.index("--save_format") + 1] if "--save_format" in extra else "safetensors"
    for sub in ("actor", "critic", "actor_ema") if ema else ("actor", "critic"):
        assert_saved_in_format(out / sub, save_format)
    _assert_reloads(out, model, ema)
    # Each LoRA model's PEFT adapter is the merged model (ZeRO-3 gathered in z3-lora-ema); one trained on
    # an adapter names that adapter as its base, and dschat loads the chain.
    for sub in ("actor", "actor_ema") if ema else ("actor",):
        assert (out / sub / "lora_adapter").is_dir() == ("--actor_lora_dim" in extra)
        if "--actor_lora_dim" in extra:
            assert_causal_adapter_matches(out / sub, actor or start_actor)
            config = json.loads((out / sub / "lora_adapter" / "adapter_config.json").read_text())
            # Only the factors trained (the EMA averaged only them): the form LoRA servers accept.
            assert (config["modules_to_save"] is None) == ("--only_optimize_lora" in extra), (sub, config)
    assert (out / "critic" / "lora_adapter").is_dir() == ("--critic_lora_dim" in extra)
    if "--critic_lora_dim" in extra:
        assert_reward_adapter_matches(out / "critic")
    from dschat.eval.report import read_metrics

    curve = read_metrics(out / "metrics.jsonl")  # one line per PPO iteration, for the e2e report
    assert [r["step"] for r in curve] == list(range(len(result.history)))
    assert all({"reward", "kl_to_ref", "response_length"} <= set(r) for r in curve)

    if name == "z0-ptx-tb":
        assert logs.count("Rollouts: dschat Hybrid Engine (eager decode step), layout opt") == 1  # --enable_hybrid_engine
        assert "--- ans    --> step=0" in logs
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "tb" / "step3_tensorboard_logs")).Reload()
        tags = set(events.Tags()["scalars"])
        assert {"reward", "actor_loss", "critic_loss", "approx_kl", "clip_frac", "ratio_max", "kl_to_ref",
                "value_explained_variance", "response_length"} <= tags
        assert [e.step for e in events.Scalars("reward")] == [0, 1]  # global step, never reset
    if name == "z3-offload-ptx-multi":
        assert not result.on_policy and logs.count("WARNING: this configuration is off-policy") == 1
        assert len(result.history[0]["micro_steps"]) == 4  # 2 micro-batches x 2 PPO epochs


# ------------------------------------------------------------------------------------ on-policy rule


LENGTHS = (3, 9, 5, 14)  # answer lengths forced below, EOS included


@pytest.fixture
def varied_lengths(monkeypatch):
    """Cut the sampled answers at fixed, different lengths (EOS then padding), so micro-batches hold
    different token counts."""
    from dschat.rlhf.rollout.generator import RolloutGenerator
    from dschat.rlhf.rollout.sampling import Rollout

    original = RolloutGenerator.rollout

    def rollout(self, prompts, mask):
        seq = original(self, prompts, mask).sequences
        P = prompts.shape[1]
        for row in range(seq.shape[0]):
            n = LENGTHS[row % len(LENGTHS)]
            seq[row, P + n - 1] = self.tokenizer.eos_token_id
            seq[row, P + n:] = self.tokenizer.pad_token_id
        return Rollout(seq, None)  # the sampled tokens' log-probs no longer describe the edited answers

    monkeypatch.setattr(RolloutGenerator, "rollout", rollout)


def _run(critic_dirs, data_cache, *extra, steps=2, model="tiny-llama"):
    argv = base_argv(model, critic_dirs[model], data_cache, "--actor_dropout", "0.0",
                     "--critic_dropout", "0.0", *extra, steps=steps)
    return step3_main().main(argv)


def test_on_policy_ratio_is_one_and_step_normalised_losses_equal_one_micro_batch(
        varied_lengths, critic_dirs, data_cache):
    # Recommended shape with accumulation: 4-row rollouts, 2 micro-batches of 2, GA 2 -> on-policy.
    split = _run(critic_dirs, data_cache, "--per_device_training_batch_size", "2",
                 "--gradient_accumulation_steps", "2")
    assert split.on_policy
    micro = [m for record in split.history for m in record["micro_steps"]]
    assert len(micro) == 4  # 2 rollouts x 2 micro-steps; the second rollout follows an optimizer step
    for m in micro:
        assert abs(m["ratio_max"] - 1) < 1e-6 and abs(m["ratio_min"] - 1) < 1e-6 and m["approx_kl"] < 1e-6
    assert [m["tokens"] for m in micro[:2]] == [3 + 9, 5 + 14]  # unequal micro-batches

    # The same first rollout as one micro-batch of 4: the accumulated step loss is the same number.
    whole = _run(critic_dirs, data_cache, steps=1)
    first = whole.history[0]["micro_steps"][0]
    assert first["tokens"] == sum(LENGTHS)
    for key in ("actor_loss", "critic_loss"):
        accumulated = sum(m[key] for m in micro[:2]) / 2  # DeepSpeed divides each by GA = 2
        assert accumulated == pytest.approx(first[key], rel=1e-4, abs=1e-6), key


def test_off_policy_configuration_is_detected_and_its_ratio_measured(critic_dirs, data_cache, capsys):
    # 4-row rollouts trained as 2 micro-batches with a step after each: the second is off-policy.
    result = _run(critic_dirs, data_cache, "--per_device_training_batch_size", "2", steps=1)
    logs = capsys.readouterr().out
    assert not result.on_policy
    assert logs.count("WARNING: this configuration is off-policy") == 1 and "OFF-POLICY" in logs
    first, second = result.history[0]["micro_steps"]
    assert abs(first["ratio_max"] - 1) < 1e-6 and abs(first["ratio_min"] - 1) < 1e-6
    assert max(abs(second["ratio_max"] - 1), abs(second["ratio_min"] - 1)) > 1e-4
    assert second["approx_kl"] > 0
    # The memory preflight's plan (printed on the CPU, not enforced), before the first engine is built.
    preflight = logs.index("memory preflight (printed, not enforced on the CPU")
    assert logs.index("peak/GPU", preflight) < logs.index("Initializing Actor Model")


def _six_prompts(folder: Path) -> Path:
    """A local dataset whose phase-3 split has 6 prompts: gen batches of 4 leave a short batch of 2."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 6), ("eval", 2)):
        rows = [{"prompt": f" Human: Say {w}. Assistant:", "chosen": f" {w}.", "rejected": " No."}
                for w in ("one", "two", "three", "four", "five", "six")[:n]]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _short_batch_run(critic_dirs, data_cache, tmp_path):
    # 4-prompt rollouts as 2 micro-batches of 2 with GA 2 (on-policy), 2 epochs of 6 prompts.
    argv = base_argv("tiny-llama", critic_dirs["tiny-llama"], data_cache, "--actor_dropout", "0.0",
                     "--critic_dropout", "0.0", "--per_device_training_batch_size", "2",
                     "--gradient_accumulation_steps", "2", "--num_train_epochs", "2", steps=100)
    argv[argv.index("--data_path") + 1] = str(_six_prompts(tmp_path / "six"))
    return step3_main().main([*argv, "--data_split", "0,0,1"])


def test_a_short_last_batch_is_dropped_so_steps_never_straddle_rollouts(tmp_path, critic_dirs, data_cache):
    result = _short_batch_run(critic_dirs, data_cache, tmp_path)
    # The 2-prompt batch of each epoch is dropped: one 2-micro-step rollout, one optimizer step per epoch.
    assert len(result.history) == 2
    assert result.rlhf_engine.actor.global_steps == 2 and result.rlhf_engine.actor.micro_steps == 4
    for m in (m for record in result.history for m in record["micro_steps"]):
        assert abs(m["ratio_max"] - 1) < 1e-6 and abs(m["ratio_min"] - 1) < 1e-6


def test_a_rollout_after_a_shifted_step_is_trained_against_its_stored_log_probs(
        monkeypatch, tmp_path, critic_dirs, data_cache, capsys):
    # Keep the short batch (as before the fix): epoch 0's 1-micro-step rollout shifts every later
    # optimizer step by one, so epoch 1's first rollout has a step between its two micro-steps.
    from dschat.rlhf.config import BatchPlan
    from dschat.rlhf.ppo_trainer import DeepSpeedPPOTrainer

    monkeypatch.setattr(BatchPlan, "drop_short_batches", property(lambda self: False))
    shortcut = []  # per micro-step: were the old log-probs the current ones, detached?
    original = DeepSpeedPPOTrainer.actor_loss_fn

    def actor_loss_fn(self, logprobs, old_logprobs, *args, **kwargs):
        shortcut.append(bool(torch.equal(logprobs.detach(), old_logprobs)))
        return original(self, logprobs, old_logprobs, *args, **kwargs)

    monkeypatch.setattr(DeepSpeedPPOTrainer, "actor_loss_fn", actor_loss_fn)
    result = _short_batch_run(critic_dirs, data_cache, tmp_path)
    assert [len(r["micro_steps"]) for r in result.history] == [2, 1, 2, 1]
    # Steps after micro-steps 2, 4 and 6 (of 6): epoch 1's first rollout has one between its two
    # micro-steps, so its second is trained against the stored log-probs (the actor moved).
    assert shortcut == [True, True, True, True, False, True]
    second = result.history[2]["micro_steps"][1]
    assert max(abs(second["ratio_max"] - 1), abs(second["ratio_min"] - 1)) > 1e-4
    # And the step normaliser, which assumes steps start with a rollout, is given up (said once).
    assert capsys.readouterr().out.count("optimizer steps no longer start with a rollout") == 1


# ------------------------------------------------------------------------------------ learning


def test_gold_judge_reward_rises(critic_dirs, data_cache):
    """A tiny OPT actor trained against the gold judge (reward hook) with a high LR: 8-token answers
    start short of words (length penalty) and learn to be wordier within 40 PPO steps."""
    from dschat.gold_judge import gold_score

    def reward_fn(prompts, answers):
        return [gold_score(p, a) for p, a in zip(prompts, answers)]

    argv = base_argv("tiny-opt", critic_dirs["tiny-opt"], data_cache, "--per_device_generation_batch_size", "16",
                     "--per_device_training_batch_size", "16", "--max_answer_seq_len", "8", "--actor_dropout", "0.0",
                     "--whiten_advantages", steps=40, lr=1e-2)
    result = step3_main().main(argv, reward_fn=reward_fn)
    rewards = [record["reward"] for record in result.history]
    assert len(rewards) == 40
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.2, rewards


# ------------------------------------------------------------------------------------ GPU tier

GPU_COVER = {
    # ZeRO-0 OPT with the Hybrid Engine (upstream's single-GPU recipe shape)
    "z0-he-opt": ("tiny-opt", ["--enable_hybrid_engine"]),
    # ZeRO-3 LLaMA actor and critic, actor LoRA fused for generation, EMA, gradient checkpointing, HE
    "z3-lora-ema-he-llama": ("tiny-llama", ["--actor_zero_stage", "3", "--critic_zero_stage", "3",
                                            "--actor_lora_dim", "4", "--enable_ema", "--enable_hybrid_engine",
                                            "--actor_gradient_checkpointing"]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("name", list(GPU_COVER))
def test_step3_low_precision_on_gpu(name, dtype, tmp_path, critic_dirs, data_cache, capsys):
    """fp16 and bf16 PPO on a GPU: finite losses, actor and critic moved, outputs reload;
    --enable_hybrid_engine either generated or said once why not. (--align_overflow is refused with
    DeepSpeed 0.19.8: none of its fp16 optimizers has upstream's external overflow check.)"""

    require_cuda_accelerator()
    model, extra = GPU_COVER[name]
    out = tmp_path / "out"
    argv = base_argv(model, critic_dirs[model], data_cache, *extra, "--output_dir", str(out), steps=3, lr=1e-4)
    argv = argv[:argv.index("--dtype")] + argv[argv.index("--dtype") + 2:] + ["--dtype", dtype]
    result = step3_main().main(argv)
    logs = capsys.readouterr().out
    assert len(result.history) == 3
    for record in result.history:
        for key in ("actor_loss", "critic_loss", "reward", "kl_to_ref"):
            assert math.isfinite(record[key]), (key, record)
    assert max_abs_diff(_initial_actor(model), load_state(out / "actor")) > 0
    assert max_abs_diff(load_state(critic_dirs[model]), load_state(out / "critic")) > 0
    _assert_reloads(out, model, "--enable_ema" in extra)
    assert logs.count("--enable_hybrid_engine: ") <= 1  # a fallback is said once
    print(logs[-4000:])  # with -rA / -s, the HE decision and throughput lines of the GPU run
