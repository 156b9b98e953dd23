"""LoRA fuse / unfuse puts the frozen base weight back bit for bit (dschat.models.lora).

Step 3 fuses the actor's LoRA factors into their base weights for every rollout and unfuses them
after. Adding the delta in place and subtracting it again rounds twice; in bf16 one rollout moved
about 1% of a layer's entries, and since the factors change between rollouts the errors add up
over a run. Here: plain layers in every dtype, and ZeRO-3 weights fused while partitioned.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dschat.models.lora import (
    LinearLayer_LoRA,
    convert_linear_layer_to_lora,
    convert_lora_to_linear_layer,
    unfuse_lora,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _layer(dtype: torch.dtype, size: int = 256, rank: int = 64) -> LinearLayer_LoRA:
    torch.manual_seed(0)
    lin = nn.Linear(size, size)
    layer = LinearLayer_LoRA(lin.weight, rank, 1, 0, lin.bias).to(dtype)
    with torch.no_grad():
        layer.lora_left_weight.normal_(0, 0.05)  # a trained-looking delta (left starts at zero)
    return layer


def _expected_fused(layer: LinearLayer_LoRA, weight: torch.Tensor) -> torch.Tensor:
    """W + scaling * left.T @ right.T, summed in fp32 and rounded once to W's dtype."""
    delta = layer.lora_scaling * (layer.lora_left_weight.float().t() @ layer.lora_right_weight.float().t())
    return (weight.float() + delta).to(weight.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fuse_unfuse_over_many_rollouts_leaves_the_base_weight_bit_identical(dtype):
    layer = _layer(dtype)
    w0 = layer.weight.detach().clone()
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        layer.fuse_lora_weight()
        assert layer.fuse_lora
        assert torch.equal(layer.weight, _expected_fused(layer, w0))
        layer.unfuse_lora_weight()
        assert not layer.fuse_lora and torch.equal(layer.weight, w0)
        with torch.no_grad():  # an optimizer step changes the factors between rollouts
            for factor in (layer.lora_left_weight, layer.lora_right_weight):
                factor.add_((torch.randn(factor.shape, generator=gen) * 1e-3).to(dtype))


def test_fused_forward_equals_the_lora_forward_in_fp32():
    layer = _layer(torch.float32)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2))
    unfused = layer(x)
    layer.fuse_lora_weight()
    torch.testing.assert_close(layer(x), unfused, rtol=1e-5, atol=1e-5)
    layer.fuse_lora_weight()  # fusing twice fuses once
    torch.testing.assert_close(layer(x), unfused, rtol=1e-5, atol=1e-5)
    layer.unfuse_lora_weight()
    layer.unfuse_lora_weight()  # and unfusing an unfused layer does nothing
    assert torch.equal(layer(x), unfused)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fuse_never_writes_into_the_base_weights_tensor(dtype):
    """Under ZeRO-3 on one rank the gathered weight *is* the partition (DeepSpeed's
    _no_gather_coalesced): fusing must swap in a new tensor and put the very same one back."""
    layer = _layer(dtype)
    original = layer.weight.data
    snapshot, version = original.clone(), original._version
    layer.fuse_lora_weight()
    assert layer.weight.data.data_ptr() != original.data_ptr()
    assert original._version == version and torch.equal(original, snapshot)
    layer.unfuse_lora_weight()
    assert layer.weight.data is original or layer.weight.data.data_ptr() == original.data_ptr()
    assert original._version == version
    assert layer.weight.lora_left_weight is layer.lora_left_weight  # the Hybrid Engine tags survive


def test_unfuse_without_a_kept_weight_is_an_error():
    layer = _layer(torch.float32)
    layer.fuse_lora = True  # set by hand, as nothing in dschat does
    with pytest.raises(RuntimeError, match="holds no unfused weight"):
        layer.unfuse_lora_weight()


# ------------------------------------------------------------------------------------ ZeRO-3 partitions


@pytest.fixture(scope="module")
def dist_info():
    from dschat.runtime.dist import init_distributed

    return init_distributed()


def _tiny_opt(dtype: torch.dtype):
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    cfg = OPTConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
                    max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0)
    return OPTForCausalLM(cfg).to(dtype).eval()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("persistence", [0, 10_000], ids=["partitioned", "resident"])
def test_zero3_weights_fused_while_partitioned_come_back_bit_identical(dist_info, dtype, persistence):
    """Outside a gather the fused weight is written into the partition (every forward re-gathers it
    from there) and the saved partition is copied back on unfuse. With the persistence threshold the
    tiny weights stay gathered after a forward; unfuse must drop that fused copy too."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from dschat.runtime.ds_config import get_eval_ds_config

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    cfg = get_eval_ds_config(False, dtype, 3, micro_batch_size=2)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = persistence
    model = _tiny_opt(torch_dtype)
    deepspeed.zero.Init(module=model, config_dict_or_path=cfg)
    convert_linear_layer_to_lora(model, "decoder.layers.", lora_dim=4)
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    layers = [m for m in engine.module.modules() if isinstance(m, LinearLayer_LoRA)]
    for layer in layers:
        factors = [layer.lora_left_weight, layer.lora_right_weight]
        with deepspeed.zero.GatheredParameters(factors, modifier_rank=0), torch.no_grad():
            layer.lora_left_weight.normal_(0, 0.2)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = engine(input_ids=ids).logits

    def full(layer):
        """(the gathered weight, what fusing the factors into it gives), copied."""
        with deepspeed.zero.GatheredParameters([layer.weight, layer.lora_left_weight, layer.lora_right_weight]):
            return layer.weight.detach().clone(), _expected_fused(layer, layer.weight).detach()

    weights, expected = zip(*(full(layer) for layer in layers))
    partitions = [layer.weight.ds_tensor.detach().clone() for layer in layers]
    for _ in range(3):
        convert_lora_to_linear_layer(engine.module)
        for layer, fused in zip(layers, expected):
            assert torch.equal(full(layer)[0], fused)
        for _ in range(3):  # DeepSpeed keeps small weights resident from about the third forward on
            with torch.no_grad():
                fused_logits = engine(input_ids=ids).logits  # forwards gather the fused partitions
            if dtype == "fp32":
                torch.testing.assert_close(fused_logits, before, rtol=1e-4, atol=1e-4)
        resident = [layer.weight.ds_status == ZeroParamStatus.AVAILABLE for layer in layers]
        assert all(resident) if persistence else not any(resident)  # the case this run is for
        unfuse_lora(engine.module)
        for layer, w, part in zip(layers, weights, partitions):
            assert torch.equal(layer.weight.ds_tensor, part)
            assert torch.equal(full(layer)[0], w)
        with torch.no_grad():
            assert torch.equal(engine(input_ids=ids).logits, before)  # no stale fused copy is used
