"""ZeRO-0 on one rank: dschat's in-place gradient reduction trains bit for bit as DeepSpeed's own flat
all-reduce (fp32 and bf16, with and without gradient accumulation, with a trainable parameter that
gets no gradient), and is not used where it would not be that identity."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dschat.runtime.dist import init_distributed
from dschat.runtime.ds_config import get_train_ds_config
from dschat.runtime.grad_reduction import one_rank_reduction_applies, reduce_on_one_rank
from dschat.training.engine_setup import OptimSettings, initialize_engine

pytestmark = pytest.mark.usefixtures("one_thread")


def _model() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    model.unused = nn.Parameter(torch.ones(8))  # trainable, never in the forward: gets no gradient
    return model


def _train(dtype: str, accumulation: int, deepspeeds: bool) -> tuple[dict, list[float]]:
    init_distributed()
    config = get_train_ds_config(False, dtype, 0, micro_batch_size=2, gradient_accumulation_steps=accumulation,
                                 world_size=1)
    optim = OptimSettings(lr=1e-2, weight_decay=0.1, lora_lr=1e-2, offload=False, scheduler="constant",
                          num_warmup_steps=0, num_training_steps=10)
    engine = initialize_engine(_model(), config, optim)
    assert ("allreduce_gradients" in vars(engine)) is True  # dschat's reduction is installed
    if deepspeeds:
        del engine.allreduce_gradients  # DeepSpeed's method again
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3 * accumulation):
        ids = torch.randint(0, 64, (2, 12), generator=g)
        loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = {name: p.detach().float().clone() for name, p in engine.module.named_parameters()}
    return state, losses


@pytest.mark.parametrize("dtype, accumulation", [("fp32", 1), ("fp32", 2), ("bf16", 1), ("bf16", 2)])
def test_training_is_bit_for_bit_deepspeeds(dtype, accumulation):
    ours, our_losses = _train(dtype, accumulation, deepspeeds=False)
    theirs, their_losses = _train(dtype, accumulation, deepspeeds=True)
    assert our_losses == their_losses
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    # The unused parameter was stepped on zero gradients (weight decay moved it), as DeepSpeed does.
    assert not torch.equal(ours["unused"], torch.ones(8))


def test_gradients_are_rounded_to_a_narrower_communication_dtype_at_the_boundary_only():
    param = nn.Parameter(torch.zeros(2))
    param.grad = torch.tensor([1.0 + 2.0 ** -12, 3.0])  # the first is not a bf16 value
    frozen, missing = nn.Parameter(torch.zeros(2), requires_grad=False), nn.Parameter(torch.zeros(3))
    engine = SimpleNamespace(optimizer=SimpleNamespace(), module=SimpleNamespace(parameters=lambda: [param, frozen, missing]),
                             communication_data_type=torch.bfloat16, is_gradient_accumulation_boundary=lambda: False)
    reduce_on_one_rank(engine, deepspeeds=None)
    assert param.grad.tolist() == [1.0 + 2.0 ** -12, 3.0] and missing.grad is None  # mid-accumulation: untouched
    engine.is_gradient_accumulation_boundary = lambda: True
    reduce_on_one_rank(engine, deepspeeds=None)
    assert param.grad.dtype == torch.float32 and param.grad.tolist() == [1.0, 3.0]
    assert frozen.grad is None and missing.grad.tolist() == [0.0, 0.0, 0.0]


def test_sparse_gradients_go_to_deepspeeds_reduction():
    param = nn.Parameter(torch.zeros(4, 2))
    param.grad = torch.sparse_coo_tensor([[1]], torch.ones(1, 2), (4, 2))
    called = []
    engine = SimpleNamespace(optimizer=SimpleNamespace(), module=SimpleNamespace(parameters=lambda: [param]),
                             communication_data_type=torch.float32, is_gradient_accumulation_boundary=lambda: True)
    reduce_on_one_rank(engine, deepspeeds=lambda: called.append(True))
    assert called == [True]


@pytest.mark.parametrize("change", [
    {}, {"stage": 1}, {"dp": 2}, {"predivide": 2.0}, {"moe": True}, {"pipeline": True}, {"optimizer": None},
    {"optimizer": SimpleNamespace(get_grads_for_reduction=list)}, {"autoep": object()}])
def test_applies_only_where_it_is_deepspeeds_reduction_exactly(change):
    engine = SimpleNamespace(
        _autoep_folding_spec=change.get("autoep"),
        optimizer=change.get("optimizer", object()), zero_optimization_stage=lambda: change.get("stage", 0),
        dp_world_size=change.get("dp", 1), seq_dp_world_size=1, sequence_parallel_size=1,
        pipeline_parallelism=change.get("pipeline", False), has_moe_layers=change.get("moe", False),
        gradient_predivide_factor=lambda: change.get("predivide", 1.0), is_deepcompile_active=lambda: False)
    assert one_rank_reduction_applies(engine) is (change == {})
