"""Step 2 (reward model) end to end on tiny models: ZeRO stages / LoRA, the saved folder scoring
like the trained engine, log lines, the reward model beating chance on held-out pairs in the gold
judge's direction, and the BLOOM final-norm reset."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from helpers.steps import (
    assert_finite,
    assert_reward_adapter_matches,
    assert_reward_folder_matches,
    assert_saved_in_format,
    base_argv,
    load_script,
    require_cuda_accelerator,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def step2():
    return load_script("step2")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


CASES = {
    # OPT with pad == eos == bos (upstream's state): the EOS end token shares the pad id.
    "quirk-z0": ("tiny-opt-quirk", ["--zero_stage", "0"]),
    "llama-z2-lora-only": ("tiny-llama", ["--zero_stage", "2", "--lora_dim", "8", "--lora_module_name", "layers.",
                                          "--only_optimize_lora", "--lora_learning_rate", "1e-2",
                                          "--num_padding_at_beginning", "0"]),
    # Upstream's layout: body and value head in one pytorch_model.bin, which step 3 reads
    "opt-z3-bin": ("tiny-opt", ["--zero_stage", "3", "--save_format", "bin"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_reward_model_trains_saves_and_reloads(step2, data_dir, tmp_path, case):
    model, extra = CASES[case]
    out = tmp_path / "out"
    result = step2.main(base_argv(model, data_dir, *extra, "--learning_rate", "1e-3", "--output_dir", str(out),
                                  max_train_steps=10))

    assert result.optimizer_steps == 10
    assert_finite(result.train_losses)
    before, after = result.evals[0], result.evals[-1]
    assert before["pairs"] == after["pairs"] == 120  # the whole phase-2 held-out chunk (< eval_iters batches)
    # Held-out pairwise loss falls from ~ln 2 within 10 steps at lr 1e-3.
    assert after["loss"] < before["loss"] - 0.005, result.evals
    assert (out / "config.json").is_file()
    save_format = extra[extra.index("--save_format") + 1] if "--save_format" in extra else "safetensors"
    assert (out / "v_head.safetensors").is_file() == (save_format != "bin")
    assert_saved_in_format(out, save_format)
    assert_reward_folder_matches(result)
    assert (out / "lora_adapter").is_dir() == ("--lora_dim" in extra)
    if "--lora_dim" in extra:  # the body's LoRA as a PEFT adapter, the value head beside it
        assert_reward_adapter_matches(out)
    if "--only_optimize_lora" in extra:
        # The fresh value head trains even when only LoRA factors do (DSE #758).
        module = result.engine.module
        assert module.v_head.weight.requires_grad
        assert not module.rwtransformer.embed_tokens.weight.requires_grad


def test_eval_interval_and_log_lines(step2, data_dir, capsys):
    result = step2.main(base_argv("tiny-opt", data_dir, "--eval_interval", "2", "--eval_iters", "1",
                                  "--gradient_accumulation_steps", "2", max_train_steps=4))
    out = capsys.readouterr().out
    for line in ("***** Running training *****", "***** Evaluating reward, Epoch 0/1 *****",
                 "Iter 2: Evaluating reward", "Iter 4: Evaluating reward", "Iter 4: c_scores: ",
                 "Epoch 1/1 with loss ", "***** Evaluating reward, Epoch 1/1 *****"):
        assert line in out, line
    assert out.count("chosen_last_scores (higher is better) : ") == 2
    assert ", acc (higher is better) : " in out and ", diff: " in out
    # --eval_iters 1: one batch of 32 pairs; before, at steps 2 and 4, and after the epoch.
    assert [e["pairs"] for e in result.evals] == [32, 32, 32, 32]
    assert [e["step"] for e in result.evals] == [0, 2, 4, 4]
    assert result.output_dir is None


def test_reward_model_beats_chance_and_agrees_with_gold_judge(step2, data_dir, tmp_path):
    """40 steps of 16 pairs on the builtin data: held-out accuracy well above 0.5, and the saved
    model orders fresh held-out pairs (in random order) the way the gold judge does."""
    from dschat.data.builtin import split_file
    from dschat.gold_judge import gold_prefers
    from dschat.models.build import create_critic_model
    from dschat.models.tokenizer import load_hf_tokenizer

    out = tmp_path / "rm"
    result = step2.main(base_argv("tiny-llama", data_dir, "--learning_rate", "1e-3", "--num_padding_at_beginning", "0",
                                  "--eval_iters", "0", "--output_dir", str(out),
                                  max_train_steps=40, max_seq_len=128, batch_size=16))
    before, after = result.evals[0]["acc"], result.evals[-1]["acc"]
    assert after >= 0.65 and after > before + 0.1, result.evals

    tokenizer = load_hf_tokenizer(str(out))
    rm = create_critic_model(str(out), tokenizer, None, rlhf_training=True).eval()
    rows = [json.loads(line) for line in split_file("eval").read_text().splitlines()]
    rng = random.Random(0)
    agree = 0
    for start in range(0, len(rows), 50):
        chunk = rows[start:start + 50]
        firsts, seconds, gold = [], [], []
        for row in chunk:
            a, b = (row["chosen"], row["rejected"]) if rng.random() < 0.5 else (row["rejected"], row["chosen"])
            firsts.append(row["prompt"] + a + tokenizer.eos_token)
            seconds.append(row["prompt"] + b + tokenizer.eos_token)
            gold.append(gold_prefers(row["prompt"], a, b))
        enc = tokenizer(firsts + seconds, padding="max_length", max_length=128, truncation=True, return_tensors="pt")
        with torch.no_grad():
            scores = rm(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
        prefers_first = (scores["chosen_mean_scores"] > scores["rejected_mean_scores"]).tolist()
        agree += sum(p == g for p, g in zip(prefers_first, gold))
    agreement = agree / len(rows)
    assert len(rows) == 300
    assert agreement >= 0.65, agreement


def test_bloom_final_norm_is_reset_and_force_trained():
    """DSE #772 without upstream's ``rwtranrsformer`` typo; a no-op for other families."""
    from transformers import BloomConfig, BloomModel, LlamaConfig, LlamaModel

    from dschat.models.reward_model import RewardModel
    from dschat.training.engine_setup import reset_final_norm_for_reward

    class Tok:
        pad_token_id = 3

    bloom = BloomModel(BloomConfig(vocab_size=64, hidden_size=16, n_layer=1, n_head=2))
    with torch.no_grad():
        bloom.ln_f.weight.fill_(7.0)
        bloom.ln_f.bias.fill_(-2.0)
    names = reset_final_norm_for_reward(RewardModel(bloom, Tok()), zero_stage=0)
    assert names == ["rwtransformer.ln_f.weight", "rwtransformer.ln_f.bias"]
    assert torch.equal(bloom.ln_f.weight, torch.ones(16)) and torch.equal(bloom.ln_f.bias, torch.zeros(16))

    llama = LlamaModel(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2))
    assert reset_final_norm_for_reward(RewardModel(llama, Tok()), zero_stage=0) == []


@pytest.mark.parametrize("zero_stage,extra", [("0", []), ("3", ["--gradient_checkpointing"])])
def test_freeze_layers_keeps_the_lower_layers_and_trains_the_rest(step2, data_dir, tmp_path, capsys, zero_stage,
                                                                   extra):
    """--freeze_layers 1 (a dschat flag): the saved body's embeddings and lowest block equal the starting
    checkpoint's, the blocks above trained (with activation checkpointing too)."""
    from safetensors.torch import load_file

    from dschat.models.registry import resolve_model_path

    out = tmp_path / "rm"
    step2.main(base_argv("tiny-llama", data_dir, "--freeze_layers", "1", "--zero_stage", zero_stage, *extra,
                         "--learning_rate", "1e-2", "--num_padding_at_beginning", "0", "--output_dir", str(out),
                         max_train_steps=3))
    assert "--freeze_layers 1: the embeddings and the 1 lowest blocks are frozen" in capsys.readouterr().out
    start = load_file(str(Path(resolve_model_path("tiny-llama")) / "model.safetensors"))
    saved = load_file(str(out / "model.safetensors"))
    frozen = [k for k in saved if k.startswith(("embed_tokens.", "layers.0."))]
    trained = [k for k in saved if k.startswith("layers.1.") and "norm" not in k]
    assert frozen and trained
    start = {k.removeprefix("model."): v for k, v in start.items()}
    for key in frozen:
        assert torch.equal(saved[key], start[key]), key
    for key in trained:
        assert not torch.equal(saved[key], start[key]), key


@pytest.mark.parametrize("model,extra", [
    ("tiny-llama", ["--zero_stage", "0", "--freeze_layers", "1"]),
    ("tiny-opt", ["--zero_stage", "3", "--gradient_checkpointing"]),
], ids=["llama-frozen", "opt-zero3"])
def test_sequence_packing_trains_as_the_padded_pass(step2, data_dir, monkeypatch, capsys, model, extra):
    """--sequence_packing auto (default) against off: the batches packed, the same losses and
    weights up to floating-point reordering."""
    from dschat.models.reward_model import RewardModel
    from dschat.runtime.zero3 import gathered_parameters

    packed_batches = []
    original = RewardModel.packed_pair_forward

    def counting(self, *args):
        out = original(self, *args)
        packed_batches.append(out is not None)
        return out

    monkeypatch.setattr(RewardModel, "packed_pair_forward", counting)
    runs = {}
    for setting in ("off", "auto"):
        result = step2.main(base_argv(model, data_dir, *extra, "--sequence_packing", setting, "--dropout", "0.0",
                                      "--learning_rate", "1e-3", "--num_padding_at_beginning", "0",
                                      "--eval_iters", "1", max_train_steps=4, max_seq_len=128))
        runs[setting] = (result.train_losses, {n: p.clone() for n, p in gathered_parameters(result.engine)})
    out = capsys.readouterr().out
    assert "Sequence packing: off (--sequence_packing off)" in out and "Sequence packing: reward on packed rows" in out
    # off never calls it; auto packs every batch with a cheaper layout (3 of these 4)
    assert len(packed_batches) == 4 and sum(packed_batches) >= 2, packed_batches
    (l0, w0), (l1, w1) = runs["off"], runs["auto"]
    assert l0 == pytest.approx(l1, abs=1e-4)
    # OPT's final-norm bias shifts every value alike, which the pairwise loss cancels: its gradient
    # is 0 in exact arithmetic and rounding noise of either order, which Adam scales to lr-sized steps.
    assert {n for n in w0 if (w0[n] - w1[n]).abs().max() > 1e-4} <= {"rwtransformer.decoder.final_layer_norm.bias"}


def test_freeze_layers_must_not_be_negative(step2, data_dir):
    from dschat.errors import UserError

    with pytest.raises(UserError, match="--freeze_layers must be >= 0, got -1"):
        step2.main(base_argv("tiny-llama", data_dir, "--freeze_layers", "-1"))


def test_only_optimize_lora_needs_lora_dim(step2, data_dir):
    from dschat.errors import UserError

    with pytest.raises(UserError, match="--lora_dim"):
        step2.main(base_argv("tiny-opt", data_dir, "--only_optimize_lora"))


# --------------------------------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("zero_stage,lora", [("2", False), ("3", True)])
def test_reward_model_low_precision_on_gpu(step2, data_dir, tmp_path, dtype, zero_stage, lora):
    require_cuda_accelerator()
    from dschat.models.build import create_critic_model
    from dschat.models.tokenizer import load_hf_tokenizer

    extra = ["--zero_stage", zero_stage, "--dtype", dtype, "--learning_rate", "1e-3", "--num_padding_at_beginning", "0"]
    if lora:
        extra += ["--lora_dim", "8", "--lora_module_name", "layers.", "--only_optimize_lora",
                  "--gradient_checkpointing"]
    argv = base_argv("tiny-llama", data_dir, "--output_dir", str(tmp_path / "out"), max_train_steps=10)
    argv = argv[:argv.index("--dtype")] + argv[argv.index("--dtype") + 2:] + extra
    result = step2.main(argv)
    assert_finite(result.train_losses)
    assert result.evals[-1]["loss"] < result.evals[0]["loss"]
    tokenizer = load_hf_tokenizer(str(result.output_dir))
    rm = create_critic_model(str(result.output_dir), tokenizer, None, rlhf_training=True)
    assert rm.v_head.weight.isfinite().all()
