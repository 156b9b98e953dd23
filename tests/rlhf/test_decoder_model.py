"""dschat's decode model (dschat/models/decoder) and Hybrid Engine (dschat/rlhf/rollout/dschat_engine.py) on
tiny random configs of every supported family, fp32 on a CPU: greedy tokens equal Hugging Face
``generate``'s, per-token log-probs equal a training forward's, seeded sampling is reproducible, the
weights are refreshed in place."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers as T

from dschat.models.decoder.layouts import LAYOUTS, decoder_spec, unsupported_reason
from dschat.rlhf.rollout.dschat_engine import DschatHybridEngine
from dschat.rlhf.rollout.sampling import DecodingSettings

V, PAD, BOS, EOS = 96, 0, 1, 2
_COMMON = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
               pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False)
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def tiny_config(name: str) -> T.PretrainedConfig:
    """2 layers, hidden 64, GQA (4 query heads, 2 or 1 kv heads) where the family has it; each
    family's own quirk switched on (sliding windows shorter than the rollout, partial rotary, ...)."""
    gqa = dict(intermediate_size=128, num_key_value_heads=2)
    configs = {
        "llama": lambda: T.LlamaConfig(**_COMMON, **gqa, rope_parameters=_LLAMA3_ROPE),
        "llama-yarn": lambda: T.LlamaConfig(**_COMMON, **gqa, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}),
        "llama-tied": lambda: T.LlamaConfig(**{**_COMMON, "tie_word_embeddings": True}, **gqa),
        "mistral": lambda: T.MistralConfig(**_COMMON, **gqa, sliding_window=8),
        "qwen2": lambda: T.Qwen2Config(**_COMMON, **gqa, use_sliding_window=True, sliding_window=8, max_window_layers=1),
        "qwen3": lambda: T.Qwen3Config(**_COMMON, **gqa, head_dim=32),
        "phi3": lambda: T.Phi3Config(**_COMMON, **gqa, sliding_window=None, partial_rotary_factor=0.5),
        "gemma": lambda: T.GemmaConfig(**_COMMON, intermediate_size=128, num_key_value_heads=1, head_dim=16),
        "opt": lambda: T.OPTConfig(**_COMMON, ffn_dim=128, word_embed_proj_dim=64),
        "opt-350m-quirks": lambda: T.OPTConfig(**_COMMON, ffn_dim=128, word_embed_proj_dim=32, do_layer_norm_before=False),
        # LayerNorms without weight or bias: the final one is applied all the same
        "opt-no-affine": lambda: T.OPTConfig(**_COMMON, ffn_dim=128, word_embed_proj_dim=64,
                                             layer_norm_elementwise_affine=False),
        "gpt_neox": lambda: T.GPTNeoXConfig(**_COMMON, intermediate_size=128, rotary_pct=0.25),
        "gpt_neox-serial": lambda: T.GPTNeoXConfig(**_COMMON, intermediate_size=128, use_parallel_residual=False),
    }
    config = configs[name]()
    config.initializer_range = 0.2  # peaked logits: greedy choices far from ties
    return config


FAMILIES = ["llama", "llama-yarn", "llama-tied", "mistral", "qwen2", "qwen3", "phi3", "gemma", "opt",
            "opt-350m-quirks", "opt-no-affine", "gpt_neox", "gpt_neox-serial"]


def _model(name: str, seed: int = 0):
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(tiny_config(name), attn_implementation="sdpa").eval()
    with torch.no_grad():  # norms start at a constant scale (OPT-350m's post-norm then collapses to one token)
        for n, p in model.named_parameters():
            if "norm" in n and p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """3 left-padded rows of widths 4, 6, 7 (of 7 columns)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, V, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, :1] = 0
    return ids.masked_fill(mask == 0, PAD), mask


def _engine(config, settings: DecodingSettings = DecodingSettings("greedy"), n: int = 40, **kwargs) -> DschatHybridEngine:
    return DschatHybridEngine(config, decoding=settings, max_new_tokens=n, eos_token_id=EOS, pad_token_id=PAD, **kwargs)


def _forward_logprobs(model, seq: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(B, A) log-probs of the answer under one training-style forward over the whole rollout."""
    B, P = mask.shape
    full = torch.cat([mask, torch.ones(B, seq.shape[1] - P, dtype=mask.dtype)], dim=1)
    positions = (full.cumsum(-1) - 1).masked_fill(full == 0, 0)
    with torch.no_grad():
        logits = model(seq, attention_mask=full, position_ids=positions).logits.float()
    return torch.log_softmax(logits[:, P - 1:-1] / temperature, -1).gather(-1, seq[:, P:, None]).squeeze(-1)


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_tokens_equal_generate_and_log_probs_equal_the_training_forward(name):
    model, (ids, mask) = _model(name), _prompts()
    n = 32
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=PAD, eos_token_id=EOS)
    rollout = _engine(model.config, n=n).rollout(model, ids, mask, min_new_tokens=n)
    assert torch.equal(rollout.sequences, expected), (rollout.sequences != expected).nonzero()[:3]
    assert rollout.sequences[:, 7:].unique().numel() > 2  # not one token repeated
    gap = (rollout.logprobs - _forward_logprobs(model, rollout.sequences, mask)).abs().max()
    assert gap < 1e-4, gap


@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_sliding_window_is_applied(name, monkeypatch):
    """Without its sliding window the decode model would decode other tokens (so the test above checks it)."""
    model, (ids, mask) = _model(name), _prompts()
    engine = _engine(model.config)
    assert any(engine.spec.sliding_windows) and (name != "qwen2" or engine.spec.sliding_windows == (None, 8))
    windowed = engine.rollout(model, ids, mask, min_new_tokens=40).sequences
    monkeypatch.setattr(engine.model, "spec", dataclasses.replace(engine.spec, sliding_windows=(None, None)))
    assert not torch.equal(engine.rollout(model, ids, mask, min_new_tokens=40).sequences, windowed)


def test_eos_ends_a_row_then_padding_as_generate_and_min_new_tokens():
    model, (ids, mask) = _model("llama"), _prompts()
    greedy = _engine(model.config).rollout(model, ids, mask).sequences
    eos = int(greedy[0, 7 + 3])  # row 0's 4th answer token: make it the EOS
    for min_new in (0, 6):
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=40, min_new_tokens=min_new, do_sample=False,
                                  pad_token_id=PAD, eos_token_id=eos)
        engine = DschatHybridEngine(model.config, decoding=DecodingSettings("greedy"), max_new_tokens=40,
                                    eos_token_id=eos, pad_token_id=PAD)
        got = engine.rollout(model, ids, mask, min_new_tokens=min_new).sequences
        assert torch.equal(got, expected)
    assert (got[0, 7:] == PAD).any()  # row 0 ended and was padded


def test_seeded_sampling_is_reproducible_and_keeps_the_sampling_log_probs():
    model, (ids, mask) = _model("qwen3"), _prompts()
    settings = DecodingSettings("sample", temperature=0.7, top_k=20, top_p=0.9)
    engine = _engine(model.config, settings, n=32)
    runs = []
    for seed in (11, 11, 12):
        torch.manual_seed(seed)
        runs.append(engine.rollout(model, ids, mask, min_new_tokens=32))
    assert torch.equal(runs[0].sequences, runs[1].sequences) and torch.equal(runs[0].logprobs, runs[1].logprobs)
    assert not torch.equal(runs[0].sequences, runs[2].sequences)
    gap = (runs[0].logprobs - _forward_logprobs(model, runs[0].sequences, mask, 0.7)).abs().max()
    assert gap < 1e-4, gap


def test_a_greedy_rollout_between_sampled_ones_leaves_the_generator_sampling():
    """ReMax's baseline switches the generator to greedy for one rollout and back; the engine, built at
    the first rollout, must decode every later rollout with the generator's settings of that call (it
    kept the greedy ones it was built with, so every sampled answer was the baseline's)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from dschat.rlhf.rollout.deepspeed_engine import HybridEngineDecision
    from dschat.rlhf.rollout.generator import RolloutGenerator

    model, (ids, mask) = _model("llama"), _prompts()
    generator = RolloutGenerator(SimpleNamespace(module=model), SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD),
                                 decision=HybridEngineDecision(True, False, dschat_engine=True),
                                 decoding=DecodingSettings("sample", temperature=1.0), max_answer_seq_len=8,
                                 zero_stage=0, cpu_decode_linear="off")
    sampling = generator.decoding
    generator.decoding = replace(sampling, decoding="greedy")  # as ExperienceMaker._greedy_baseline
    greedy = generator.rollout(ids, mask).sequences
    generator.decoding = sampling
    assert generator.last_loop == "dschat-he"
    sampled = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        sampled.append(generator.rollout(ids, mask))
    assert generator.engine.decoding == sampling
    assert not torch.equal(sampled[0].sequences, sampled[1].sequences)
    assert not all(torch.equal(run.sequences, greedy) for run in sampled)
    gap = (sampled[0].logprobs - _forward_logprobs(model, sampled[0].sequences, mask, 1.0)).abs().max()
    assert gap < 1e-4, gap


def test_a_compile_cache_others_can_write_to_stops_the_rollout_before_compiling(monkeypatch, tmp_path):
    """Before the decode step is compiled, torch.compile's cache must be a folder of the user's own
    (dschat.runtime.compile_cache); one others can write to is a user error the generator re-raises,
    not a compiler failure it falls back from."""
    from types import SimpleNamespace

    from dschat.errors import UserError
    from dschat.rlhf.rollout.deepspeed_engine import HybridEngineDecision
    from dschat.rlhf.rollout.generator import RolloutGenerator

    model, (ids, mask) = _model("llama"), _prompts()
    generator = RolloutGenerator(SimpleNamespace(module=model), SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD),
                                 decision=HybridEngineDecision(True, False, dschat_engine=True),
                                 decoding=DecodingSettings("greedy"), max_answer_seq_len=8, zero_stage=0,
                                 cpu_decode_linear="off")
    generator.rollout(ids, mask)  # builds the engine; eager on a CPU
    planted = tmp_path / "torchinductor_victim"
    planted.mkdir()
    planted.chmod(0o777)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(planted))
    generator.engine.compile_step = True  # as on CUDA
    with pytest.raises(UserError, match="TORCHINDUCTOR_CACHE_DIR .* its group and others can write"):
        generator.rollout(ids, mask)
    assert generator.use_dschat_engine and generator.engine._step is None and not any(planted.iterdir())


def test_weights_are_refreshed_in_place_and_released_on_request():
    model, (ids, mask) = _model("phi3"), _prompts()
    engine = _engine(model.config, n=8)
    first = engine.rollout(model, ids, mask)
    weights = engine.model.weights
    ptrs = [t.data_ptr() for t in weights.tensors()]
    cache_ptr = engine.cache.keys[0].data_ptr()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    second = engine.rollout(model, ids, mask)
    assert [t.data_ptr() for t in weights.tensors()] == ptrs and engine.cache.keys[0].data_ptr() == cache_ptr
    assert (weights.allocations, engine.cache_allocations) == (1, 1)
    # The fused buffer holds the new weights: q, k, v of Phi-3's one qkv_proj, gate/up of its gate_up_proj.
    layer = model.model.layers[1]
    assert torch.equal(weights.layers[1].qkv_w, layer.self_attn.qkv_proj.weight)
    assert torch.equal(weights.layers[1].up_w, layer.mlp.gate_up_proj.weight)
    assert not torch.equal(first.sequences, second.sequences)
    assert torch.equal(second.sequences, model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                                        pad_token_id=PAD, eos_token_id=EOS))
    released = _engine(model.config, n=8, release_cache=True)
    released.rollout(model, ids, mask)
    assert released.cache is None and not released.model.weights.allocated
    assert torch.equal(released.rollout(model, ids, mask).sequences, second.sequences)
    assert released.model.weights.allocations == 2


def test_fused_layouts_are_q_k_v_and_gate_up_rows():
    model = _model("gpt_neox")
    engine = _engine(model.config, n=1)
    engine.refresh(model)
    attn = model.gpt_neox.layers[0].attention
    H, D = 4, 16
    per_head = attn.query_key_value.weight.view(H, 3, D, 64)  # GPT-NeoX: (head, q|k|v, D) rows
    qkv = engine.model.weights.layers[0].qkv_w
    assert torch.equal(qkv[:H * D], per_head[:, 0].reshape(H * D, 64))
    assert torch.equal(qkv[2 * H * D:], per_head[:, 2].reshape(H * D, 64))
    llama = _model("llama")
    engine = _engine(llama.config, n=1)
    engine.refresh(llama)
    mlp, w = llama.model.layers[0].mlp, engine.model.weights.layers[0]
    assert torch.equal(w.up_w, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    assert w.qkv_w.shape == (64 + 2 * 32, 64) and w.qkv_w.is_contiguous()


def test_families_outside_the_table_keep_the_module_path_with_a_reason():
    assert set(LAYOUTS) >= {"llama", "mistral", "qwen2", "qwen3", "phi3", "opt", "gpt_neox", "gemma"}
    assert "no inference layout" in unsupported_reason(T.GPT2Config())
    assert "no inference layout" in unsupported_reason(T.Gemma2Config(**_COMMON, intermediate_size=128))
    capped = tiny_config("gemma")
    capped.attn_logit_softcapping = 50.0  # Gemma-2's attention soft-capping: SDPA has none
    assert "attn_logit_softcapping" in unsupported_reason(capped)
    dynamic = T.LlamaConfig(**_COMMON, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    assert "changes its frequencies" in unsupported_reason(dynamic)
    assert unsupported_reason(tiny_config("llama")) is None


def test_the_decode_step_compiles_as_one_graph_once_for_every_prompt_width():
    """What CUDA graphs need, checked on a CPU with Dynamo (``aot_eager``: tracing without a compiler):
    the decode step is one graph (``fullgraph``), gives the eager tokens and log-probs, and a rollout
    with another prompt width compiles nothing new (the cache capacity and the weights stay put)."""
    model, (ids, mask) = _model("qwen2"), _prompts()
    eager = _engine(model.config, n=32).rollout(model, ids, mask, min_new_tokens=32)
    engine = _engine(model.config, n=32, compile_step=True)
    engine.compile_options = {"backend": "aot_eager", "dynamic": False}
    torch._dynamo.reset()
    try:
        compiled = engine.rollout(model, ids, mask, min_new_tokens=32)
        engine.rollout(model, ids[:, 2:], mask[:, 2:], min_new_tokens=32)
    finally:
        torch._dynamo.reset()
    assert torch.equal(compiled.sequences, eager.sequences)
    assert (compiled.logprobs - eager.logprobs).abs().max() < 1e-5
    assert engine.compiles_per_rollout == [1, 0] and engine.cache_allocations == 1


def test_engines_of_two_models_compile_their_decode_steps_in_one_process():
    """The decode step is one function for every engine: an engine of another model recompiles it, and
    Dynamo then makes the sizes that changed dynamic (its default, as on CUDA). Attention's grouped-KV
    switch must stay a plain bool there (it once became a SymBool, which SDPA refuses: on CUDA the
    second engine of a process fell back to the training module). Traced with ``aot_eager``."""
    torch._dynamo.reset()
    try:
        for name in ("opt", "llama", "gemma"):  # 4/4, 4/2 and 4/1 query/key-value heads
            model, (ids, mask) = _model(name), _prompts()
            engine = _engine(model.config, n=6, compile_step=True)
            engine.compile_options = {"backend": "aot_eager"}  # dynamic=None: automatic dynamic shapes
            expected = model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6,
                                      do_sample=False, pad_token_id=PAD, eos_token_id=EOS)
            rollout = engine.rollout(model, ids, mask, min_new_tokens=6)
            assert torch.equal(rollout.sequences, expected), name
            assert engine.compiles >= 1, name
    finally:
        torch._dynamo.reset()
