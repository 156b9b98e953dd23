"""LoRA (dschat.models.lora): upstream-compatible math, conversion, Hybrid-Engine contract, QLoRA."""
from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

from dschat.errors import UserError
from dschat.models.lora import (
    LinearLayer_LoRA,
    convert_linear_layer_to_lora,
    convert_lora_to_linear_layer,
    lora_target_modules_for,
    make_model_gradient_checkpointing_compatible,
    only_optimize_lora_parameters,
    unfuse_lora,
)

VOCAB = 128


def tiny_opt(seed: int = 0) -> OPTForCausalLM:
    torch.manual_seed(seed)
    cfg = OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
                    max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0)
    return OPTForCausalLM(cfg).eval()


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def input_ids(batch: int = 2, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def randomize_lora(model: nn.Module, seed: int = 3) -> None:
    """Non-zero left factors so the LoRA branch actually changes the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LinearLayer_LoRA):
                m.lora_left_weight.copy_(torch.randn(m.lora_left_weight.shape, generator=gen))


def lora_layer(in_f: int = 8, out_f: int = 6, r: int = 4, dropout: float = 0.0) -> LinearLayer_LoRA:
    torch.manual_seed(0)
    lin = nn.Linear(in_f, out_f)
    return LinearLayer_LoRA(lin.weight, lora_dim=r, lora_scaling=1, lora_droppout=dropout, bias=lin.bias)


# ------------------------------------------------------------------------------------ the layer


def test_layer_reuses_linear_params_shapes_init_and_scaling():
    torch.manual_seed(0)
    lin = nn.Linear(8, 6)
    torch.manual_seed(42)
    layer = LinearLayer_LoRA(lin.weight, lora_dim=4, lora_scaling=2, bias=lin.bias)
    assert layer.weight is lin.weight and layer.bias is lin.bias       # same Parameters, same keys
    assert layer.lora_right_weight.shape == (8, 4)                      # (in, r)
    assert layer.lora_left_weight.shape == (4, 6)                       # (r, out)
    assert torch.equal(layer.lora_left_weight, torch.zeros(4, 6))
    # right is kaiming_uniform_(a=sqrt(5)) of a fresh fp32 (in, r) tensor, drawn right after the seed
    torch.manual_seed(42)
    expected = torch.zeros(8, 4)
    nn.init.kaiming_uniform_(expected, a=math.sqrt(5))
    assert torch.equal(layer.lora_right_weight, expected)
    assert layer.lora_scaling == 2 / 4                                  # lora_scaling / lora_dim
    assert not layer.weight.requires_grad and layer.bias.requires_grad  # base frozen, bias not
    assert isinstance(layer.lora_dropout, nn.Identity) and layer.fuse_lora is False
    assert list(dict(layer.named_parameters())) == ["weight", "bias", "lora_right_weight", "lora_left_weight"]


def test_features_read_the_full_shape_of_zero3_partitioned_factors():
    layer = LinearLayer_LoRA(nn.Linear(8, 6).weight, lora_dim=4)
    assert (layer.in_features, layer.out_features) == (8, 6)
    # What ZeRO-3 leaves: an empty local tensor, the full shape in ds_shape (DeepSpeed's inference
    # containers read in/out features from a partitioned model).
    for name, full in (("lora_right_weight", (8, 4)), ("lora_left_weight", (4, 6))):
        param = getattr(layer, name)
        param.data = torch.empty(0)
        param.ds_shape = torch.Size(full)
    assert (layer.in_features, layer.out_features) == (8, 6)


def test_layer_rejects_nonpositive_rank():
    with pytest.raises(UserError, match="lora_dim"):
        LinearLayer_LoRA(nn.Linear(4, 4).weight, lora_dim=0)


def test_forward_is_base_plus_scaled_low_rank_product():
    layer = lora_layer()
    randomize_lora(layer)
    x = torch.randn(3, 5, 8)
    expected = x @ layer.weight.T + layer.bias + (x @ layer.lora_right_weight @ layer.lora_left_weight) / 4
    torch.testing.assert_close(layer(x), expected)


def test_fused_equals_unfused_and_unfuse_restores_weight():
    layer = lora_layer()
    randomize_lora(layer)
    w0 = layer.weight.detach().clone()
    x = torch.randn(3, 8)
    unfused = layer(x)
    layer.fuse_lora_weight()
    assert layer.fuse_lora
    torch.testing.assert_close(layer.weight, w0 + 0.25 * layer.lora_left_weight.T @ layer.lora_right_weight.T)
    torch.testing.assert_close(layer(x), unfused)
    layer.fuse_lora_weight()                     # idempotent: fusing twice adds the delta once
    torch.testing.assert_close(layer(x), unfused)
    layer.unfuse_lora_weight()
    assert not layer.fuse_lora
    assert torch.equal(layer.weight, w0)  # bit for bit (tests/models/test_lora_exact.py: every dtype, many rounds)
    torch.testing.assert_close(layer(x), unfused)


def test_train_and_eval_return_self_and_toggle_children():
    layer = lora_layer(dropout=0.5)
    assert isinstance(layer.lora_dropout, nn.Dropout)
    assert layer.eval() is layer
    assert not layer.training and not layer.lora_dropout.training
    assert layer.train() is layer
    assert layer.training and layer.lora_dropout.training
    assert layer.train(False) is layer and not layer.lora_dropout.training
    # and through a whole model: nn.Module.eval() chains work again (upstream returned None)
    model = convert_linear_layer_to_lora(tiny_opt(), "decoder.layers.", lora_dim=2, lora_droppout=0.1)
    assert model.train() is model
    assert all(m.training for m in model.modules())
    assert model.eval() is model
    assert not any(m.training for m in model.modules())


# ---------------------------------------------------------------------------------- conversion

OPT_LORA_MODULES = [
    "model.decoder.layers.0.self_attn.k_proj", "model.decoder.layers.0.self_attn.v_proj",
    "model.decoder.layers.0.self_attn.q_proj", "model.decoder.layers.0.self_attn.out_proj",
    "model.decoder.layers.0.fc1", "model.decoder.layers.0.fc2",
    "model.decoder.layers.1.self_attn.k_proj", "model.decoder.layers.1.self_attn.v_proj",
    "model.decoder.layers.1.self_attn.q_proj", "model.decoder.layers.1.self_attn.out_proj",
    "model.decoder.layers.1.fc1", "model.decoder.layers.1.fc2",
]
LLAMA_LORA_MODULES = [
    "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj",
    "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
    "model.layers.0.mlp.down_proj",
    "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.v_proj",
    "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj",
    "model.layers.1.mlp.down_proj",
]


def lora_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, LinearLayer_LoRA)]


def plain_linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if type(m) is nn.Linear]


def test_family_defaults():
    assert lora_target_modules_for(tiny_opt()) == "decoder.layers."
    assert lora_target_modules_for(tiny_llama()) == "layers."


def test_convert_opt_touches_exactly_the_decoder_layers():
    model = tiny_opt()
    convert_linear_layer_to_lora(model, lora_target_modules_for(model), lora_dim=4)
    assert lora_names(model) == OPT_LORA_MODULES
    assert plain_linear_names(model) == ["lm_head"]


def test_convert_llama_touches_exactly_the_layers():
    model = tiny_llama()
    convert_linear_layer_to_lora(model, lora_target_modules_for(model), lora_dim=4)
    assert lora_names(model) == LLAMA_LORA_MODULES
    assert plain_linear_names(model) == ["lm_head"]


def test_convert_accepts_a_list_of_substrings():
    model = convert_linear_layer_to_lora(tiny_llama(), ["q_proj", "v_proj"], lora_dim=2)
    assert lora_names(model) == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj",
                                 "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]


def test_convert_matches_inside_the_reward_wrapper():
    """Upstream's RewardModel holds the base AutoModel as ``rwtransformer``; the substring still matches."""
    base = tiny_opt()
    wrapper = nn.Module()
    wrapper.rwtransformer = base.model  # OPTModel: names "decoder.layers.N..."
    wrapper.v_head = nn.Linear(64, 1, bias=False)
    convert_linear_layer_to_lora(wrapper, "decoder.layers.", lora_dim=2)
    assert lora_names(wrapper) == ["rwtransformer." + n[len("model."):] for n in OPT_LORA_MODULES]
    assert plain_linear_names(wrapper) == ["v_head"]


def test_convert_with_no_match_is_a_user_error():
    with pytest.raises(UserError, match="matches no nn.Linear"):
        convert_linear_layer_to_lora(tiny_opt(), "transformer.h.", lora_dim=2)


def test_convert_on_gpt2s_conv1d_layers_says_they_are_not_wrapped():
    """GPT-2's block projections are transformers Conv1D, not nn.Linear: one line saying so (it named
    lm_head, tied to the embeddings, as the layer to match), nothing converted."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from dschat.models.lora import lora_target_modules_for

    model = AutoModelForCausalLM.from_config(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64))
    with pytest.raises(UserError) as err:
        convert_linear_layer_to_lora(model, lora_target_modules_for(model), lora_dim=2)
    assert str(err.value) == ("--lora_module_name ['h.'] matches only transformers Conv1D layers (GPT-2's, like "
                              "transformer.h.0.attn.c_attn), which dschat's LoRA, upstream's LinearLayer_LoRA, does "
                              "not wrap; train this model without LoRA (its LoRA dim 0)")
    assert lora_names(model) == []


def test_convert_refuses_a_tied_lm_head_before_changing_anything():
    """OPT's lm_head shares the input embeddings' weight: a LoRA layer on it would freeze the embeddings
    (even without --only_optimize_lora) and its fuse would change them, so rollouts decoded a model that
    differs from the one trained. One line, nothing converted; an untied lm_head (LLaMA) is fine."""
    model = tiny_opt()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    with pytest.raises(UserError, match=r"matches lm_head, whose weight is tied to model\.decoder\.embed_tokens "
                                        r"\(tie_word_embeddings\).*leave it out of --lora_module_name "
                                        r".*'decoder\.layers\.'"):
        convert_linear_layer_to_lora(model, ["q_proj", "lm_head"], lora_dim=2)
    assert lora_names(model) == [] and model.lm_head.weight is model.get_input_embeddings().weight
    assert model.lm_head.weight.requires_grad

    untied = tiny_llama()
    convert_linear_layer_to_lora(untied, "lm_head", lora_dim=2)
    randomize_lora(untied)
    embeddings = untied.get_input_embeddings().weight.detach().clone()
    ids = input_ids()
    with torch.no_grad():
        unfused = untied(ids).logits
        convert_lora_to_linear_layer(untied)
        fused = untied(ids).logits
    torch.testing.assert_close(fused, unfused, rtol=0, atol=1e-5)
    assert torch.equal(untied.get_input_embeddings().weight, embeddings)


def test_zero_init_left_keeps_model_output_at_init():
    base = tiny_opt()
    lora = convert_linear_layer_to_lora(copy.deepcopy(base), "decoder.layers.", lora_dim=4)
    ids = input_ids()
    with torch.no_grad():
        assert torch.equal(lora(ids).logits, base(ids).logits)


def test_convert_keeps_dtype_and_upstream_trainability():
    model = tiny_llama().to(torch.bfloat16)
    convert_linear_layer_to_lora(model, "layers.", lora_dim=4)
    q = model.model.layers[0].self_attn.q_proj
    assert q.lora_right_weight.dtype == q.lora_left_weight.dtype == torch.bfloat16
    # Wrapped base weights are frozen even without only_optimize (upstream); the rest stays trainable.
    frozen = sorted(n for n, p in model.named_parameters() if not p.requires_grad)
    assert frozen == sorted(f"{m}.weight" for m in LLAMA_LORA_MODULES)


def test_only_optimize_lora_parameters_with_forced_names():
    model = convert_linear_layer_to_lora(tiny_opt(), "decoder.layers.", lora_dim=2)
    only_optimize_lora_parameters(model, force_optimize_params=["model.decoder.final_layer_norm.weight"])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    expected = ["model.decoder.final_layer_norm.weight"] + [
        f"{m}.{f}" for m in OPT_LORA_MODULES for f in ("lora_right_weight", "lora_left_weight")]
    assert sorted(trainable) == sorted(expected)


def test_gradient_reaches_lora_parameters_only():
    model = only_optimize_lora_parameters(convert_linear_layer_to_lora(tiny_opt(), "decoder.layers.", lora_dim=4))
    ids = input_ids()
    model(input_ids=ids, labels=ids).loss.backward()
    for name, p in model.named_parameters():
        if "lora" in name:
            assert p.grad is not None, name
        else:
            assert p.grad is None, name
    # At init left == 0, so d loss / d right = 0 exactly; left gets the signal.
    layer = model.model.decoder.layers[0].self_attn.q_proj
    assert torch.count_nonzero(layer.lora_right_weight.grad) == 0
    assert torch.count_nonzero(layer.lora_left_weight.grad) > 0
    # Once left is non-zero, right receives gradient too.
    model.zero_grad()
    randomize_lora(model)
    model(input_ids=ids, labels=ids).loss.backward()
    assert torch.count_nonzero(layer.lora_right_weight.grad) > 0


class _ToyLM(nn.Module):
    """No ``enable_input_require_grads``: exercises the forward-hook fallback."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, VOCAB)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.block, self.embed(ids), use_reentrant=True)
        return self.head(h)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_gradient_checkpointing_compat_hook_fallback():
    def lora_grads(compat: bool) -> list:
        model = convert_linear_layer_to_lora(_ToyLM(), "block.", lora_dim=2)
        # the head stays trainable so backward() has a graph to run either way
        only_optimize_lora_parameters(model, force_optimize_params=["head.weight"])
        randomize_lora(model)
        if compat:
            make_model_gradient_checkpointing_compatible(model)
        model(input_ids()).sum().backward()
        return [p.grad for n, p in model.named_parameters() if "lora" in n]

    # Reentrant checkpointing with a frozen embedding drops the graph: LoRA gets nothing (DSE #658) ...
    assert all(g is None for g in lora_grads(compat=False))
    # ... unless the embedding output is made to require grad.
    assert all(g is not None and torch.count_nonzero(g) > 0 for g in lora_grads(compat=True))


def test_gradient_checkpointing_compat_on_hf_model():
    model = only_optimize_lora_parameters(convert_linear_layer_to_lora(tiny_llama(), "layers.", lora_dim=2))
    make_model_gradient_checkpointing_compatible(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    ids = input_ids()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_left_weight" in n]
    assert len(grads) == 14 and all(g is not None and torch.count_nonzero(g) > 0 for g in grads)


def test_fused_state_dict_without_lora_keys_loads_into_plain_model():
    lora = convert_linear_layer_to_lora(tiny_llama(), "layers.", lora_dim=4)
    randomize_lora(lora)
    ids = input_ids()
    with torch.no_grad():
        expected = lora(ids).logits
    convert_lora_to_linear_layer(lora)
    assert all(m.fuse_lora for m in lora.modules() if isinstance(m, LinearLayer_LoRA))
    state = {k: v for k, v in lora.state_dict().items() if "lora" not in k}
    plain = tiny_llama(seed=123)
    plain.load_state_dict(state, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lora(ids).logits, expected, rtol=1e-5, atol=1e-5)
    # and unfuse_lora brings the LoRA model back to its un-fused weights
    unfuse_lora(lora)
    assert not any(m.fuse_lora for m in lora.modules() if isinstance(m, LinearLayer_LoRA))
    with torch.no_grad():
        torch.testing.assert_close(lora(ids).logits, expected, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------- DeepSpeed Hybrid Engine contract


def _he_container(container_cls, layer: nn.Module, matched: dict):
    """A stand-in for DeepSpeed's inference container that runs DeepSpeed's own LoRA code.

    ``set_lora_params``/``get_lora_matched_pair`` come from the real family container and
    ``fuse_lora``/``unfuse_lora`` from ``HybridEngineContainer``; only the weight handles that
    ``initialize_tensors`` would set are filled in by hand (``matched``: attribute -> Parameter).
    """
    from deepspeed.module_inject.containers.features.hybrid_engine import HybridEngineContainer

    class Fake(HybridEngineContainer):
        set_lora_params = container_cls.set_lora_params
        get_lora_matched_pair = container_cls.get_lora_matched_pair

    fake = Fake()
    fake.policy = SimpleNamespace(client_module=layer)
    for attr, param in matched.items():
        setattr(fake, attr, param)
    return fake


def _check_he_fuse_matches_ours(layer: nn.Module, container, lora_modules: list) -> None:
    # maybe_get_lora found [right, left, scaling] for every module: nothing silently skipped
    assert all(len(p) == 3 for p in container.get_lora_params())
    for (right, left, scaling), m in zip(container.get_lora_params(), lora_modules):
        assert right is m.lora_right_weight and left is m.lora_left_weight and scaling == m.lora_scaling
    before = [m.weight.detach().clone() for m in lora_modules]
    container.fuse_lora()                                  # DeepSpeed's W += s * left.T @ right.T
    he_fused = [m.weight.detach().clone() for m in lora_modules]
    container.unfuse_lora()
    for m, w0 in zip(lora_modules, before):
        torch.testing.assert_close(m.weight, w0, rtol=0, atol=1e-6)
    for m, w0, expected in zip(lora_modules, before, he_fused):
        m.weight.data.copy_(w0)
        m.fuse_lora_weight()                               # ours, from the same W
        assert torch.equal(m.weight, expected)


def test_hybrid_engine_contract_opt_container():
    from deepspeed.module_inject.containers.opt import DS_OPTContainer

    model = convert_linear_layer_to_lora(tiny_opt(), "decoder.layers.", lora_dim=4)
    randomize_lora(model)
    layer = model.model.decoder.layers[0]
    attn = layer.self_attn
    container = _he_container(DS_OPTContainer, layer, {
        "_h4h_w": layer.fc1.weight, "_4hh_w": layer.fc2.weight, "dense_w": attn.out_proj.weight,
        "qw": attn.q_proj.weight, "kw": attn.k_proj.weight, "vw": attn.v_proj.weight})
    # OPT's container passes modules to maybe_get_lora, in this order:
    lora_modules = [layer.fc1, layer.fc2, attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj]
    _check_he_fuse_matches_ours(layer, container, lora_modules)


def test_hybrid_engine_contract_llama_container_reads_weights():
    """DeepSpeed's LLaMA container calls maybe_get_lora(q_proj.weight): the triple must be on the weight."""
    from deepspeed.module_inject.containers.llama import DS_LLAMAContainer
    from deepspeed.module_inject.policy import maybe_get_lora

    model = convert_linear_layer_to_lora(tiny_llama(), "layers.", lora_dim=4)
    randomize_lora(model)
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    assert maybe_get_lora(attn.q_proj.weight) == [attn.q_proj.lora_right_weight, attn.q_proj.lora_left_weight,
                                                   attn.q_proj.lora_scaling]
    container = _he_container(DS_LLAMAContainer, layer, {
        "inter_up_w": mlp.up_proj.weight, "inter_gate_w": mlp.gate_proj.weight, "_4hh_w": mlp.down_proj.weight,
        "dense_w": attn.o_proj.weight, "qw": attn.q_proj.weight, "kw": attn.k_proj.weight,
        "vw": attn.v_proj.weight})
    lora_modules = [mlp.up_proj, mlp.gate_proj, mlp.down_proj, attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
    _check_he_fuse_matches_ours(layer, container, lora_modules)


# --------------------------------------------------------------------------------------- QLoRA


def test_qlora_layer_forward_backward_on_cpu():
    torch.manual_seed(0)
    lin = nn.Linear(128, 64)
    w = lin.weight.detach().clone()
    layer = LinearLayer_LoRA(lin.weight, lora_dim=4, bias=lin.bias, quantize_base="nf4")
    assert layer.is_quantized and layer.weight.dtype == torch.uint8 and not layer.weight.requires_grad
    assert layer.lora_right_weight.dtype == torch.float32               # factors stay full precision
    x = torch.randn(5, 128, requires_grad=True)
    y = layer(x)
    assert y.shape == (5, 64)
    # 4-bit base: close to the fp32 layer within NF4 rounding, not equal
    base = nn.functional.linear(x, w, lin.bias)
    rel = ((y - base).abs().mean() / base.abs().mean()).item()
    assert 0 < rel < 0.1, rel
    y.square().sum().backward()
    assert x.grad is not None and layer.lora_left_weight.grad is not None
    assert layer.bias.grad is not None and layer.weight.grad is None


def test_qlora_dequantises_rows_that_straddle_blocks_correctly():
    """in_features=32 < blocksize 64: bitsandbytes 0.50.2's CPU kernel mis-scales this case."""
    from dschat.models.lora import _dequantize_4bit, _quantize_4bit

    torch.manual_seed(0)
    for shape in [(64, 32), (48, 96), (32, 64)]:
        w = torch.randn(shape)
        dense = _dequantize_4bit(_quantize_4bit(w, "nf4", 64))
        assert dense.shape == w.shape and dense.dtype == w.dtype
        # NF4 on N(0,1) data: mean |error| ~0.075; the kernel bug gives ~0.15-0.28
        assert (dense - w).abs().mean().item() < 0.09, shape


def test_qlora_fuse_gives_dense_weight_and_plain_checkpoint():
    model = convert_linear_layer_to_lora(tiny_llama(), "layers.", lora_dim=4, quantize_base="nf4")
    assert all(m.is_quantized for m in model.modules() if isinstance(m, LinearLayer_LoRA))
    randomize_lora(model)
    ids = input_ids()
    with torch.no_grad():
        before = model(ids).logits
    convert_lora_to_linear_layer(model)
    q = model.model.layers[0].self_attn.q_proj
    assert not q.is_quantized and q.weight.dtype == torch.float32 and not q.weight.requires_grad
    state = {k: v for k, v in model.state_dict().items() if "lora" not in k}
    plain = tiny_llama(seed=7)
    plain.load_state_dict(state, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, before, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_qlora_unfused_model_saves_a_dense_checkpoint_in_the_compute_dtype(tmp_path, dtype):
    """Saving adds the LoRA delta to the *dequantised* base (not to the packed uint8 codes, which
    crashed), in the compute dtype; the live 4-bit model is left as it was."""
    from transformers import AutoModelForCausalLM

    from dschat.models.registry import resolve_model_path
    from dschat.models.save import save_hf_model
    from dschat.models.tokenizer import load_hf_tokenizer

    path = resolve_model_path("tiny-llama")
    tok = load_hf_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    convert_linear_layer_to_lora(model, "layers.", lora_dim=4, quantize_base="nf4")
    randomize_lora(model)
    q = model.model.layers[0].self_attn.q_proj
    codes = q.weight.detach().clone()
    delta = q.lora_scaling * (q.lora_left_weight.t().float() @ q.lora_right_weight.t().float())
    expected_q = (q.dense_weight().float() + delta).to(dtype)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        expected = model(ids).logits.float()
    save_hf_model(model, tok, tmp_path / "out")
    assert q.is_quantized and not q.fuse_lora and torch.equal(q.weight, codes)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    saved_q = loaded.model.layers[0].self_attn.q_proj.weight
    assert saved_q.dtype == dtype and torch.equal(saved_q, expected_q)
    with torch.no_grad():
        logits = loaded(ids).logits.float()
    rel = ((logits - expected).norm() / expected.norm()).item()
    assert rel < (1e-5 if dtype == torch.float32 else 3e-2), rel  # bf16: its rounding in every layer


def test_qlora_trains_lora_only():
    model = only_optimize_lora_parameters(
        convert_linear_layer_to_lora(tiny_opt(), "decoder.layers.", lora_dim=4, quantize_base="fp4"))
    ids = input_ids()
    model(input_ids=ids, labels=ids).loss.backward()
    assert all((p.grad is not None) == ("lora" in n) for n, p in model.named_parameters())


def test_qlora_rejects_bad_inputs():
    with pytest.raises(UserError, match="4-bit quant type"):
        LinearLayer_LoRA(nn.Linear(64, 64).weight, lora_dim=2, quantize_base="int3")
    w = nn.Linear(64, 64).weight
    w.ds_id = 0  # what ZeRO-3 partitioning leaves on a parameter
    with pytest.raises(UserError, match="ZeRO-3"):
        LinearLayer_LoRA(w, lora_dim=2, quantize_base="nf4")


@pytest.mark.gpu
def test_qlora_on_cuda():
    model = convert_linear_layer_to_lora(tiny_llama().cuda().to(torch.bfloat16), "layers.", lora_dim=4,
                                         quantize_base="nf4")
    model = only_optimize_lora_parameters(model)
    ids = input_ids().cuda()
    loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)
    loss.backward()
    assert all((p.grad is not None) == ("lora" in n) for n, p in model.named_parameters())


def test_a_model_fused_before_its_save_is_saved_once_fused(tmp_path):
    """Upstream's scripts fuse (convert_lora_to_linear_layer) and then save: the saved weights carry the
    LoRA delta once, so the reloaded plain model gives the LoRA model's logits."""
    from transformers import AutoModelForCausalLM

    from dschat.models.lora import convert_linear_layer_to_lora, convert_lora_to_linear_layer
    from dschat.models.registry import resolve_model_path
    from dschat.models.save import save_hf_model
    from dschat.models.tokenizer import load_hf_tokenizer

    path = resolve_model_path("tiny-opt")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    convert_linear_layer_to_lora(model, "decoder.layers.", lora_dim=4)
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_left_weight" in name:  # zero at init: give the adapter a delta
            param.data.normal_(0, 0.5)
    ids = torch.tensor([[2, 100, 200, 300, 400]])
    want = model.eval()(ids).logits
    convert_lora_to_linear_layer(model)
    save_hf_model(model, load_hf_tokenizer(path), tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    torch.testing.assert_close(back(ids).logits, want, atol=1e-4, rtol=1e-4)
