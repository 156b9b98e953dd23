"""Rollout decoding fast paths (dschat/rlhf/rollout/sample_loop.py): the sampling loop against Hugging Face
``generate``, the inverse-CDF draw against the distribution it samples, and oneDNN decode linears
against the stock kernels -- including after the weights change, as they do every PPO step."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dschat.rlhf.rollout.sample_loop as decoding
from dschat.rlhf.rollout.sample_loop import onednn_decode_linears, sample_loop
from dschat.rlhf.rollout.sampling import DecodingSettings, draw, generated_token_logprobs

GREEDY = DecodingSettings("greedy")


def _model_and_prompts(name: str):
    from transformers import AutoModelForCausalLM

    from dschat.models.registry import resolve_model_path
    from dschat.models.tokenizer import load_hf_tokenizer

    tok = load_hf_tokenizer(name)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(name), dtype=torch.float32).eval()
    texts = [" Human: Tell me about kites. Assistant:", " Human: Hi Assistant:",
             " Human: Why is the sky blue? Assistant:"]
    rows = [tok(t)["input_ids"] for t in texts]
    width = max(map(len, rows))  # left-padded, a different prompt length per row
    prompts = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return model, tok, prompts, mask


def _generate(model, tok, prompts, mask, settings: DecodingSettings, max_new: int, min_new: int = 0):
    with torch.no_grad():
        out = type(model).generate(model, prompts, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=min_new,
                                   pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, use_cache=True,
                                   return_dict_in_generate=True, output_logits=True, **settings.generate_kwargs())
    return out.sequences, generated_token_logprobs(out.logits, out.sequences[:, prompts.shape[1]:],
                                                   settings.logit_temperature)


def _loop(model, tok, prompts, mask, settings: DecodingSettings, max_new: int, min_new: int = 0, **kwargs):
    return sample_loop(model, prompts, mask, decoding=settings, max_new_tokens=max_new, min_new_tokens=min_new,
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kwargs)


# ------------------------------------------------------------------------------------ the loop


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-opt", "tiny-opt-quirk"])
@pytest.mark.parametrize("min_new", [0, 12])
def test_greedy_loop_gives_generates_tokens_and_log_probs(name, min_new):
    model, tok, prompts, mask = _model_and_prompts(name)
    seq, logprobs = _generate(model, tok, prompts, mask, GREEDY, 12, min_new)
    rollout = _loop(model, tok, prompts, mask, GREEDY, 12, min_new)
    assert torch.equal(rollout.sequences, seq)
    assert rollout.logprobs.dtype == torch.float32 and rollout.logprobs.shape == logprobs.shape
    assert torch.allclose(rollout.logprobs, logprobs, atol=1e-5)


@pytest.mark.parametrize("settings", [
    DecodingSettings("sample"),
    DecodingSettings("sample", temperature=0.7, top_k=5),
    DecodingSettings("sample", temperature=1.3, top_p=0.9),
    DecodingSettings("sample", temperature=0.8, top_k=20, top_p=0.8),
])
def test_sampling_loop_with_generates_sampler_draws_generates_tokens(settings):
    """Same logits processing as generate: with torch.multinomial, a seed gives generate's tokens."""
    model, tok, prompts, mask = _model_and_prompts("tiny-llama")
    torch.manual_seed(5)
    seq, logprobs = _generate(model, tok, prompts, mask, settings, 10, 4)
    torch.manual_seed(5)
    rollout = _loop(model, tok, prompts, mask, settings, 10, 4, sampler="multinomial")
    assert torch.equal(rollout.sequences, seq)
    assert torch.allclose(rollout.logprobs, logprobs, atol=1e-5)
    # The default sampler is reproducible for a seed too.
    torch.manual_seed(5)
    first = _loop(model, tok, prompts, mask, settings, 10, 4)
    torch.manual_seed(5)
    assert torch.equal(_loop(model, tok, prompts, mask, settings, 10, 4).sequences, first.sequences)


def test_rows_end_at_eos_then_pad_and_decoding_stops_when_all_ended(monkeypatch):
    model, tok, prompts, mask = _model_and_prompts("tiny-llama")
    eos, pad, P = tok.eos_token_id, tok.pad_token_id, prompts.shape[1]
    original = decoding.next_token_scores
    calls = {"n": 0}

    def forced(logits, settings, eos_token_id, suppress_eos):
        """Row 0 says EOS at its 3rd token, row 1 at its 5th, row 2 at its 6th."""
        scores = original(logits, settings, eos_token_id, suppress_eos).clone()
        for row, at in ((0, 2), (1, 4), (2, 5)):
            if calls["n"] == at:
                scores[row] = -float("inf")
                scores[row, eos] = 0.0
        calls["n"] += 1
        return scores

    monkeypatch.setattr(decoding, "next_token_scores", forced)
    rollout = _loop(model, tok, prompts, mask, GREEDY, 20)
    answer = rollout.sequences[:, P:]
    assert answer.shape == (3, 6)  # stopped after the last row's EOS, not at 20
    assert answer[0, 2] == eos and (answer[0, 3:] == pad).all()
    assert answer[1, 4] == eos and answer[1, 5] == pad
    assert answer[2, 5] == eos
    # Pad slots keep the raw log-prob of pad (upstream's reward slot after EOS reads the first one).
    assert torch.isfinite(rollout.logprobs).all()
    # The log-probs (EOS and pad slots included) are a forward pass's over the same sequence.
    full_mask = torch.cat([mask, torch.ones_like(answer)], 1)
    with torch.no_grad():
        logits = model(rollout.sequences, attention_mask=full_mask,
                       position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0)).logits
    expected = torch.log_softmax(logits[:, P - 1:-1].float(), -1).gather(-1, answer[..., None]).squeeze(-1)
    assert torch.allclose(rollout.logprobs, expected, atol=1e-4)


def test_inverse_cdf_draw_samples_the_given_probabilities():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    n = 40_000
    torch.manual_seed(0)
    tokens = draw(probs.expand(n, -1))
    counts = torch.bincount(tokens, minlength=5).double()
    assert counts[1] == 0 and counts[4] == 0  # zero-probability tokens are never drawn
    freq = counts / n
    sigma = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert ((freq - probs.double()).abs() <= 4 * sigma + 1e-12).all(), freq


def test_inverse_cdf_draw_edges(monkeypatch):
    probs = torch.tensor([[0.25, 0.75, 0.0], [0.0, 0.0, 1.0]])
    top = 1.0 - 2.0 ** -53
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.full(shape, top, dtype=kw.get("dtype")))
    assert draw(probs).tolist() == [1, 2]  # u at the very top: the last token with p > 0
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.zeros(shape, dtype=kw.get("dtype")))
    assert draw(probs).tolist() == [0, 2]  # u = 0: the first token with p > 0
    with pytest.raises(ValueError, match="not finite"):
        draw(torch.tensor([[float("nan"), 0.5]]))
    with pytest.raises(ValueError, match="sampler"):
        draw(probs, "gumbel")


# ------------------------------------------------------------------------------------ oneDNN linears


def test_onednn_linear_matches_f_linear_and_only_for_decode_rows():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96)
    x4, x7 = torch.randn(4, 1, 64), torch.randn(7, 64)
    with onednn_decode_linears(layer, rows=4) as count:
        assert count == 1 and "forward" in layer.__dict__
        decode, prefill = layer(x4), layer(x7)
    assert "forward" not in layer.__dict__  # the class's forward is back
    assert torch.allclose(decode, F.linear(x4, layer.weight, layer.bias), atol=1e-5)
    assert torch.equal(prefill, F.linear(x7, layer.weight, layer.bias))  # other row counts: stock kernel


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-opt"])
@pytest.mark.parametrize("loop", ["dschat", "hf"])
def test_onednn_decode_gives_the_stock_kernels_greedy_tokens(name, loop):
    model, tok, prompts, mask = _model_and_prompts(name)
    n_linear = sum(type(m) is torch.nn.Linear for m in model.modules())

    def run():
        if loop == "dschat":
            r = _loop(model, tok, prompts, mask, GREEDY, 12)
            return r.sequences, r.logprobs
        return _generate(model, tok, prompts, mask, GREEDY, 12)

    stock = run()
    with onednn_decode_linears(model, rows=prompts.shape[0]) as count:
        fast = run()
    assert count == n_linear
    assert torch.equal(fast[0], stock[0])
    assert torch.allclose(fast[1], stock[1], atol=1e-5)


def test_onednn_decode_sees_weight_updates():
    """The packed copies are taken per rollout: after the weights change (an optimizer step), the fast
    path generates what the stock kernels generate with the new weights, not the old tokens."""
    model, tok, prompts, mask = _model_and_prompts("tiny-llama")
    with onednn_decode_linears(model, rows=prompts.shape[0]):
        before = _loop(model, tok, prompts, mask, GREEDY, 12).sequences
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    with onednn_decode_linears(model, rows=prompts.shape[0]):
        after = _loop(model, tok, prompts, mask, GREEDY, 12).sequences
    stock = _loop(model, tok, prompts, mask, GREEDY, 12).sequences
    assert not torch.equal(after, before)
    assert torch.equal(after, stock)


def test_onednn_decode_on_smollm2_gives_the_stock_greedy_tokens():
    """The model the CPU benchmark decodes (30 layers, a 49152-row LM head)."""
    model, tok, prompts, mask = _model_and_prompts("smollm2-135m")
    stock = _loop(model, tok, prompts, mask, GREEDY, 8)
    with onednn_decode_linears(model, rows=prompts.shape[0]):
        fast = _loop(model, tok, prompts, mask, GREEDY, 8)
    assert torch.equal(fast.sequences, stock.sequences)
    assert torch.allclose(fast.logprobs, stock.logprobs, atol=1e-4)
