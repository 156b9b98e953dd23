"""Sequence packing (``--sequence_packing``, dschat/models/packing.py, dschat/rlhf/scoring_passes.py):
the layout maths, every supported family's packed forward against its padded one (SDPA and eager,
fp32 on a CPU), step 2's pairwise loss, and step 3's experience and PPO update on packed rows
against padded rows."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers as T

from dschat.errors import UserError
from dschat.models.packing import (PACKED_ROW_TOKENS, attention_span, layout_cost, pack_rows, packed_model_inputs,
                                  packing_mode, packing_unsupported_reason)
from dschat.models.reward_model import RewardModel
from dschat.rlhf.experience import sequence_masks
from dschat.runtime.zero3 import gathered_parameters
from dschat.rlhf.scoring_passes import (reward_end_scores, resolve_sequence_packing, token_log_probs,
                                       token_values)

from test_decoder_model import FAMILIES, _model, tiny_config
from test_step3_experience import _build, _fixed_generation

pytestmark = pytest.mark.usefixtures("one_thread")


def _batch(V: int = 96, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """5 rows of 24 columns: left-padded prompts of 3-8 tokens, answers of 1-16 tokens (one fills
    the row, one is cut short), padding after them; (ids, attention mask, position ids)."""
    g = torch.Generator().manual_seed(seed)
    P, A = 8, 16
    ids = torch.randint(3, V, (5, P + A), generator=g)
    mask = torch.zeros(5, P + A, dtype=torch.long)
    for b, (prompt, answer) in enumerate([(8, 16), (3, 5), (5, 1), (8, 2), (4, 11)]):
        mask[b, P - prompt:P + answer] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.masked_fill(mask == 0, 0), mask, positions


# ------------------------------------------------------------------------------ the layout


def test_pack_rows_layout_and_round_trip():
    ids, mask, _ = _batch()
    lengths = mask.sum(1).tolist()
    assert lengths == [24, 8, 6, 10, 15]
    # By default (rows of up to PACKED_ROW_TOKENS) a short batch is one row with no filler.
    assert PACKED_ROW_TOKENS == 1024 and pack_rows(ids, mask).input_ids.shape == (1, 63)
    # At a width of 24: first-fit decreasing gives [24], [15, 8], [10, 6]; spreading them evenly would
    # not make the rows narrower (24, 21, 18), so that layout stays.
    packed = pack_rows(ids, mask, max_width=24)
    assert packed.input_ids.shape == (3, 24)
    assert packed.real.sum(1).tolist() == [24, 23, 16]
    assert packed.real_tokens == sum(lengths)
    # Every real token exactly once, in order within its row, positions restarting at 0.
    assert sorted(packed.source[packed.real].tolist()) == mask.flatten().nonzero().flatten().tolist()
    row1 = packed.position_ids[1].tolist()
    assert row1 == list(range(15)) + list(range(8)) + [0]  # the last slot: a filler sequence
    assert torch.equal(packed.input_ids[packed.real], ids.flatten()[packed.source[packed.real]])
    # gather then unpack gives the padded tensor back at real tokens, the fill elsewhere.
    values = torch.randn(5, 24, 3)
    back = packed.unpack(packed.gather(values), fill=-7.0)
    assert torch.equal(back[mask.bool()], values[mask.bool()])
    assert (back[~mask.bool()] == -7.0).all()
    # A width below the padded one counts as the padded one.
    assert torch.equal(pack_rows(ids, mask, max_width=5).source, packed.source)
    # Deterministic.
    again = pack_rows(ids, mask, max_width=24)
    assert torch.equal(again.source, packed.source) and torch.equal(again.position_ids, packed.position_ids)


def test_pack_rows_keeps_the_padded_batch_when_no_layout_is_cheaper():
    # Full rows: nothing to remove, and one wide row would only add attention.
    mask = torch.ones(4, 10, dtype=torch.long)
    assert pack_rows(torch.arange(40).reshape(4, 10), mask) is None
    # Lengths 10, 10, 10, 9 in 10 columns: by slots alone one row of 39 is cheaper than 4 x 10, but
    # where attention costs as much as the matmuls at a width of 20 (span 20) it is not: 39 x (1 +
    # 39 / 20) = 115 against 40 x (1 + 10 / 20) = 60, and rows of 10 save nothing.
    mask[3, 0] = 0
    ids = torch.arange(40).reshape(4, 10)
    assert pack_rows(ids, mask).input_ids.shape == (1, 39)
    assert layout_cost(1, 39, 20) == pytest.approx(39 * (1 + 39 / 20)) and layout_cost(4, 10, None) == 40
    assert pack_rows(ids, mask, span=20) is None
    # A wide model (span 2 x 576 + 1536 for SmolLM2's shape) packs the CPU demo's short rows into one.
    smollm2 = SimpleNamespace(model_type="llama", hidden_size=576, intermediate_size=1536)
    assert attention_span(smollm2) == 2688
    ids, mask, _ = _batch()
    assert pack_rows(ids, mask, span=2688).input_ids.shape == (1, 63)
    opt = SimpleNamespace(model_type="opt", hidden_size=2048, ffn_dim=8192)
    assert attention_span(opt) == 12288 and attention_span(SimpleNamespace(model_type="x")) is None


def test_pack_rows_spreads_sequences_evenly_when_that_narrows_the_rows():
    # Lengths 10, 9, 8, 7, 6 at a width of 20: first-fit decreasing needs 3 rows, [10, 9], [8, 7], [6]
    # (19 wide); spread longest first to the least-filled row they are [10], [9, 6], [8, 7] (15 wide).
    mask = torch.zeros(5, 12, dtype=torch.long)
    for b, n in enumerate([10, 9, 8, 7, 6]):
        mask[b, 12 - n:] = 1
    packed = pack_rows(torch.arange(60).reshape(5, 12), mask, max_width=20)
    assert packed.input_ids.shape == (3, 15)
    assert packed.real.sum(1).tolist() == [10, 15, 15]
    # Filler keeps position 0: one-token sequences of their own, no position past the padded batch's.
    assert packed.position_ids[0].tolist() == list(range(10)) + [0] * 5
    assert sorted(packed.source[packed.real].tolist()) == mask.flatten().nonzero().flatten().tolist()


def test_unpack_is_differentiable_and_non_contiguous_rows_are_not_packed():
    ids, mask, _ = _batch()
    packed = pack_rows(ids, mask)
    x = torch.randn(*packed.input_ids.shape, requires_grad=True)
    (packed.unpack(x) * 2).sum().backward()
    assert torch.equal(x.grad, 2.0 * packed.real.float())
    holed = mask.clone()
    holed[0, 5] = 0  # a hole inside a row: no single run to pack
    assert pack_rows(ids, holed) is None
    empty = torch.zeros_like(mask)
    empty[:, :2] = 1
    empty[1] = 0  # a row without tokens takes no slot
    assert pack_rows(ids, empty).real_tokens == 8


# ------------------------------------------------------------------------------ every family


def _reward_model(causal_lm) -> RewardModel:
    torch.manual_seed(1)
    return RewardModel(causal_lm.base_model, SimpleNamespace(pad_token_id=0)).eval()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", FAMILIES)
def test_packed_log_probs_and_values_equal_the_padded_ones(name, attention):
    model = _model(name)
    model.config._attn_implementation = attention
    assert packing_mode(model) == ("mask" if name.startswith("opt") else "positions")
    critic = _reward_model(model)
    ids, mask, positions = _batch()
    packed = pack_rows(ids, mask)
    # Columns read downstream: every real token's, which includes the first pad after a finished
    # answer (upstream's reward slot).
    real = mask[:, :-1].bool()
    with torch.no_grad():
        for temperature in (1.0, 0.7):
            padded = token_log_probs(model, ids, mask, positions, None, temperature=temperature)
            ours = token_log_probs(model, ids, mask, positions, packed, temperature=temperature)
            assert (ours[real] - padded[real]).abs().max() < 2e-5
            assert (ours[~real] == 0).all()
        padded_values = token_values(critic, ids, mask, positions, None)
        assert (token_values(critic, ids, mask, positions, packed) - padded_values)[mask.bool()].abs().max() < 2e-5
        scores = reward_end_scores(critic, ids, mask, positions, packed, prompt_length=8)
        assert torch.allclose(scores, reward_end_scores(critic, ids, mask, positions, None, prompt_length=8),
                              atol=2e-5)
        if attention == "eager":  # the same sums in the same order: equal to the bit
            assert torch.equal(ours[real], padded[real])


_OTHER_FAMILIES = {  # packed by their position ids too; not in dschat's decode model (no tiny_config there)
    "gpt2": lambda: T.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=1,
                                 eos_token_id=2),
    "gptj": lambda: T.GPTJConfig(vocab_size=96, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64,
                                 bos_token_id=1, eos_token_id=2),
    "gpt_neo": lambda: T.GPTNeoConfig(vocab_size=96, hidden_size=64, num_layers=2, num_heads=4, window_size=8,
                                      attention_types=[[["global", "local"], 1]], max_position_embeddings=64,
                                      bos_token_id=1, eos_token_id=2),
}


@pytest.mark.parametrize("name", sorted(_OTHER_FAMILIES))
def test_other_families_pack_by_their_position_ids(name):
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(_OTHER_FAMILIES[name]()).eval()
    assert packing_mode(model) == "positions", model.config._attn_implementation
    critic = _reward_model(model)
    ids, mask, positions = _batch()
    packed = pack_rows(ids, mask)
    real = mask[:, :-1].bool()
    with torch.no_grad():
        ours = token_log_probs(model, ids, mask, positions, packed)
        padded = token_log_probs(model, ids, mask, positions, None)
        assert (ours[real] - padded[real]).abs().max() < 2e-5
        values = token_values(critic, ids, mask, positions, packed) - token_values(critic, ids, mask, positions, None)
        assert values[mask.bool()].abs().max() < 2e-5


def test_packed_training_gradients_equal_the_padded_ones():
    model = _model("llama").train()
    ids, mask, positions = _batch()
    packed = pack_rows(ids, mask)
    grads = []
    for layout in (None, packed):
        model.zero_grad()
        token_log_probs(model, ids, mask, positions, layout)[mask[:, 1:].bool()].sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert (grads[0] - grads[1]).abs().max() < 1e-4 * grads[0].abs().max()


def test_packing_refuses_what_it_cannot_run():
    bloom = T.AutoModelForCausalLM.from_config(T.BloomConfig(vocab_size=96, hidden_size=64, n_layer=1, n_head=4))
    assert "'bloom'" in packing_unsupported_reason(bloom)
    assert packing_mode(bloom) is None
    with pytest.raises(ValueError, match="does not apply"):
        packed_model_inputs(pack_rows(*_batch()[:2]), bloom)
    class RemoteCodeLlama(T.LlamaForCausalLM):  # what trust_remote_code loads: not transformers' own class
        pass
    remote = RemoteCodeLlama(tiny_config("llama"))
    assert "RemoteCodeLlama is not a transformers model class" in packing_unsupported_reason(remote)
    llama_inputs = packed_model_inputs(pack_rows(*_batch()[:2]), _model("llama"))
    assert llama_inputs["use_cache"] is False and llama_inputs["attention_mask"] is None
    flash = _model("llama")
    flash.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in packing_unsupported_reason(flash)
    assert "no Hugging Face config" in packing_unsupported_reason(torch.nn.Linear(2, 2))
    llama = _model("llama")
    assert resolve_sequence_packing("auto", {"actor": llama, "reward": bloom, "critic": None}) == {
        "actor": True, "reward": False}
    assert resolve_sequence_packing("off", {"actor": llama}) == {"actor": False}
    with pytest.raises(UserError, match=r"--sequence_packing on: the reward model cannot run packed rows: .*'bloom'"):
        resolve_sequence_packing("on", {"actor": llama, "reward": bloom})


def test_sliding_windows_still_apply_inside_packed_rows():
    # Mistral's window of 8 inside rows of up to 24 tokens: packed equals padded (the family test),
    # and the window matters there, so that equality is not the window being ignored by both.
    model = _model("mistral")
    assert model.config.sliding_window == 8
    ids, mask, positions = _batch()
    real = mask[:, :-1].bool()
    with torch.no_grad():
        windowed = token_log_probs(model, ids, mask, positions, pack_rows(ids, mask))
        model.config.sliding_window = None
        full = token_log_probs(model, ids, mask, positions, pack_rows(ids, mask))
    assert (windowed[real] - full[real]).abs().max() > 1e-3


# ------------------------------------------------------------------------------ step 2


def _pairs() -> tuple[torch.Tensor, torch.Tensor]:
    """3 right-padded pairs of 20 columns, [chosen x 3; rejected x 3]: a 4-token shared prompt, then
    chosen longer (10 vs 6), rejected longer (5 vs 12), and an identical pair (7), whose loss reads
    to the end of the row."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 96, (6, 20), generator=g)
    ids[3:, :4] = ids[:3, :4]
    ids[5] = ids[2]
    mask = torch.zeros(6, 20, dtype=torch.long)
    for row, n in enumerate([10, 5, 7, 6, 12, 7]):
        mask[row, :n] = 1
    return ids.masked_fill(mask == 0, 0), mask


def _check_step2_packed_pair_loss(critic: RewardModel, windowed: str | None) -> None:
    """The pairwise loss reads the shorter answer's padding up to the longer one's end (DSE #316):
    the packed pass computes those slots too, with the padded pass's positions and attention."""
    ids, mask = _pairs()
    if windowed is not None:  # a window of 8 < 20 columns: an explicit mask would not apply it
        assert critic.packed_pair_forward(ids, mask) is None
        setattr(critic.config, windowed, 64)  # wider than the batch: packed
    assert critic.packed_pair_forward(ids, mask) is not None
    results = []
    for packed in (False, True):
        critic.zero_grad()
        out = critic(input_ids=ids, attention_mask=mask, sequence_packing=packed)
        out["loss"].backward()
        grads = torch.cat([p.grad.flatten() for p in critic.parameters() if p.grad is not None])
        results.append((out, grads))
    (padded, g0), (ours, g1) = results
    for key in ("loss", "chosen_mean_scores", "rejected_mean_scores"):
        assert torch.allclose(ours[key], padded[key], atol=2e-5), key
    assert (g0 - g1).abs().max() < 1e-4 * g0.abs().max()
    # The padding the loss reads matters: scoring it as 0 (what a plain packing of the real tokens
    # would give) changes the loss.
    with torch.no_grad():
        values = critic.forward_value(ids, mask, return_value_only=True).masked_fill(mask == 0, 0.0)
        assert abs(float(critic._pair_loss(values, ids, mask)["loss"]) - float(padded["loss"])) > 1e-3


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", FAMILIES)
def test_step2_packed_pair_loss_equals_the_padded_one(name, attention):
    critic = _reward_model(_model(name))
    critic.config._attn_implementation = attention
    _check_step2_packed_pair_loss(critic, "sliding_window" if name in ("mistral", "qwen2") else None)


@pytest.mark.parametrize("name", sorted(_OTHER_FAMILIES))
def test_step2_packed_pair_loss_on_other_families(name):
    torch.manual_seed(0)
    critic = _reward_model(T.AutoModelForCausalLM.from_config(_OTHER_FAMILIES[name]()))
    _check_step2_packed_pair_loss(critic, "window_size" if name == "gpt_neo" else None)


def test_step2_packing_falls_back_to_the_padded_pass():
    critic = _reward_model(_model("llama"))
    ids, mask = _pairs()
    assert critic.packed_pair_forward(ids.flip(1), mask.flip(1)) is None  # left padding
    # forward(sequence_packing=True) then runs the padded pass
    left = critic(input_ids=ids.flip(1), attention_mask=mask.flip(1), sequence_packing=True)["loss"]
    assert torch.equal(left, critic(input_ids=ids.flip(1), attention_mask=mask.flip(1))["loss"])
    full = torch.ones_like(mask)
    assert critic.packed_pair_forward(ids, full) is None  # nothing to remove: no cheaper layout
    bloom = T.AutoModelForCausalLM.from_config(T.BloomConfig(vocab_size=96, hidden_size=64, n_layer=1, n_head=4))
    assert _reward_model(bloom).packed_pair_forward(ids, mask) is None  # positions from the mask (ALiBi)


# ------------------------------------------------------------------------------ step 3


@pytest.mark.parametrize("model, extra", [
    ("tiny-llama", ()), ("tiny-opt", ()),
    ("tiny-llama", ("--actor_zero_stage", "3", "--critic_zero_stage", "3", "--actor_lora_dim", "4",
                    "--critic_lora_dim", "4")),
], ids=["llama", "opt", "llama-zero3-lora"])
def test_step3_experience_and_update_on_packed_rows_equal_the_padded_ones(model, extra, monkeypatch, critic_dirs,
                                                                          data_cache, capsys):
    runs = {}
    for setting in ("off", "auto"):
        trainer, tok = _build(model, critic_dirs, data_cache, "--actor_dropout", "0.0", "--critic_dropout", "0.0",
                              "--sequence_packing", setting, *extra)
        pad, eos = tok.pad_token_id, tok.eos_token_id
        prompts = torch.tensor([[pad, pad, 40, 41, 42], [43, 44, 45, 46, 47], [pad, 48, 49, 50, 51]])
        prompt_mask = (prompts != pad).long()
        answers = torch.tensor([[52, 53, eos, pad, pad, pad], [54, 55, 56, 57, 58, 59], [60, eos, pad, pad, pad, pad]])
        seq = torch.cat([prompts, answers], dim=1)
        _fixed_generation(monkeypatch, trainer, seq)
        trainer.reuse_rollout_logprobs = False  # the actor's scoring pass too
        exp = trainer.generate_experience(prompts, prompt_mask, step=0)
        packed = trainer._packed(seq, exp.attention_mask, "actor")
        assert (packed is None) == (setting == "off")  # 23 real tokens of 33: one packed row
        assert setting == "off" or packed.input_ids.shape == (1, 23)
        trainer.prepare_rollout([exp])
        trainer.train()
        actor_loss, critic_loss = trainer.train_rlhf(exp)
        weights = torch.cat([p.flatten().clone() for engine in (trainer.actor_model, trainer.critic_model)
                             for _, p in gathered_parameters(engine)])
        runs[setting] = (exp, actor_loss.item(), critic_loss.item(), weights)
    assert "Sequence packing: actor, reference, critic, reward on packed rows" in capsys.readouterr().out
    (padded, a0, c0, w0), (packed, a1, c1, w1) = runs["off"], runs["auto"]
    real = padded.attention_mask[:, :-1].bool()
    for field in ("logprobs", "ref_logprobs", "values"):
        assert (getattr(packed, field) - getattr(padded, field))[real].abs().max() < 2e-5, field
    assert torch.allclose(packed.reward_score, padded.reward_score, atol=2e-5)
    assert torch.allclose(packed.advantages, padded.advantages, atol=1e-4)
    assert a1 == pytest.approx(a0, abs=1e-5) and c1 == pytest.approx(c0, abs=1e-5)
    # The same optimizer steps: Adam scales each step to about the learning rate (1e-3 here) whatever the
    # gradient's size, so rounding-level gradient gaps on parameters with near-zero gradients show up as
    # a few percent of one step at most.
    assert w0.numel() == w1.numel() > 30_000 and (w1 - w0).abs().max() < 5e-5
