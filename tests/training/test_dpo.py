"""DPO end to end on tiny models (ZeRO stages, LoRA, reference offload), its label mask by hand,
and the evaluation over the whole held-out split."""
from __future__ import annotations

import math

import pytest
import torch

from helpers.steps import (
    assert_causal_adapter_matches,
    assert_causal_folder_matches,
    assert_finite,
    assert_saved_in_format,
    base_argv,
    load_script,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dpo():
    return load_script("dpo")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


CASES = {
    "llama-z0": ("tiny-llama", ["--zero_stage", "0"]),
    "opt-z2-lora-both": ("tiny-opt", ["--zero_stage", "2", "--lora_dim", "8", "--lora_module_name", "decoder.layers.",
                                      "--save_format", "both"]),
    "quirk-z3-offload-ref": ("tiny-opt-quirk", ["--zero_stage", "3", "--offload_reference_model"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dpo_trains_saves_and_reloads(dpo, data_dir, tmp_path, case, capsys):
    model, extra = CASES[case]
    out = tmp_path / "out"
    result = dpo.main(base_argv(model, data_dir, *extra, "--learning_rate", "1e-4", "--output_dir", str(out)))
    log = capsys.readouterr().out

    assert result.optimizer_steps == 6
    assert_finite(result.train_losses)
    before, after = result.evals[0], result.evals[-1]
    # Before training policy == reference: every implicit reward is 0 and the loss is ln 2.
    assert before["chosen"] == pytest.approx(0.0, abs=1e-6) and before["rejected"] == pytest.approx(0.0, abs=1e-6)
    assert before["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert after["loss"] < before["loss"] - 1e-3, result.evals
    assert after["chosen"] - after["rejected"] > 0, result.evals
    assert before["pairs"] == after["pairs"] == 120  # the whole held-out chunk, not the last batch
    assert "***** Evaluating rewards, Epoch 0/1 *****" in log and "chosen: 0.0, rejected: 0.0, loss: " in log
    assert "Model Parameters: " in log and "saving the final model ..." in log
    assert_saved_in_format(out, extra[extra.index("--save_format") + 1] if "--save_format" in extra else "safetensors")
    assert_causal_folder_matches(result, model)
    assert (out / "lora_adapter").is_dir() == ("--lora_dim" in extra)
    if "--lora_dim" in extra:  # OPT with its tied embeddings trained too: modules_to_save
        assert_causal_adapter_matches(out, model)


def test_label_mask_by_hand():
    """Upstream's mask (first divergence .. end), read from the attention mask: with OPT's
    pad == eos (id 2 here) the final EOS stays in, which ``ids != pad`` would drop."""
    from dschat.training.dpo import dpo_label_mask

    pad = eos = 2
    input_ids = torch.tensor([
        [5, 6, 7, 8, eos, pad],   # chosen 1: diverges from rejected 1 at position 2
        [5, 6, 9, eos, pad, pad],  # chosen 2: identical to rejected 2 -> keep every real token
        [5, 6, 4, eos, pad, pad],  # rejected 1
        [5, 6, 9, eos, pad, pad],  # rejected 2
    ])
    attention_mask = torch.tensor([
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 0],
    ])
    expected = torch.tensor([
        [0, 0, 1, 1, 1, 0],
        [1, 1, 1, 1, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 0],
    ])
    assert torch.equal(dpo_label_mask(input_ids, attention_mask), expected)


def test_dpo_batch_matches_hand_formula():
    """``dpo_batch`` = beta * ((pi_c - ref_c) - (pi_r - ref_r)) through -logsigmoid, with the
    sequence log-probs summed over the masked, shifted tokens."""
    from types import SimpleNamespace

    from dschat.training.dpo import dpo_batch

    torch.manual_seed(0)
    vocab = 11
    policy_logits = torch.randn(2, 4, vocab)
    ref_logits = torch.randn(2, 4, vocab)

    def fake(logits):
        return lambda **kw: SimpleNamespace(logits=logits)

    batch = {"input_ids": torch.tensor([[1, 2, 3, 0], [1, 4, 0, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])}
    # Divergence at position 1: chosen scores tokens 2, 3 (positions 1, 2); rejected scores token 4.
    def logp(logits, row, pos, tok):
        return torch.log_softmax(logits[row, pos - 1], -1)[tok]

    pi_c = logp(policy_logits, 0, 1, 2) + logp(policy_logits, 0, 2, 3)
    pi_r = logp(policy_logits, 1, 1, 4)
    ref_c = logp(ref_logits, 0, 1, 2) + logp(ref_logits, 0, 2, 3)
    ref_r = logp(ref_logits, 1, 1, 4)
    beta, eps = 0.5, 0.1
    z = beta * ((pi_c - ref_c) - (pi_r - ref_r))
    expected = -torch.nn.functional.logsigmoid(z) * (1 - eps) - torch.nn.functional.logsigmoid(-z) * eps

    out = dpo_batch(fake(policy_logits), fake(ref_logits), batch, beta=beta, label_smoothing=eps)
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(out.output.chosen_rewards, (beta * (pi_c - ref_c)).reshape(1))
