"""EMA of the actor: the formula, the initial copy, and ZeRO-3 (where upstream's update was lost)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dschat.rlhf.actor_ema import EMA_BETA, moving_average

from helpers.step3 import base_argv, step3_main


def test_moving_average_formula_and_copy():
    torch.manual_seed(0)
    actor, ema = nn.Linear(3, 2), nn.Linear(3, 2)
    ema_before = [p.detach().clone() for p in ema.parameters()]
    moving_average(actor, ema)
    for p, e, e0 in zip(actor.parameters(), ema.parameters(), ema_before):
        # ema = 0.992 * ema + 0.008 * actor (hand form of lerp(actor, ema, 0.992))
        assert torch.allclose(e, EMA_BETA * e0 + (1 - EMA_BETA) * p, atol=1e-7)
    moving_average(actor, ema, beta=0.0)
    assert all(torch.equal(p, e) for p, e in zip(actor.parameters(), ema.parameters()))
    with pytest.raises(ValueError, match="parameters"):
        moving_average(actor, nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2)))


def test_moving_average_moves_bf16_weights():
    # (1 - 0.992) * delta is below bf16's rounding step for most weights; fp32 arithmetic keeps it.
    actor = nn.Linear(64, 64).to(torch.bfloat16)
    ema = nn.Linear(64, 64).to(torch.bfloat16)
    with torch.no_grad():
        ema.weight.fill_(1.0)
        actor.weight.fill_(2.0)
    for _ in range(20):
        moving_average(actor, ema)
    expected = 2.0 - 0.992 ** 20  # 1 + (1 - 0.992^20) = 1.1484
    # Within half a bf16 step at 1.15 (one rounding of the fp32 average); rounding to bf16 after
    # every update ends a whole step away, at 1.15625.
    assert abs(float(ema.weight[0, 0].detach()) - expected) <= 2 ** -8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_moving_average_closes_a_small_gap_in_half_precision(dtype):
    # A 2% gap: 0.008 x 0.02 = 1.6e-4 per update is far below the rounding step at 1.0 (bf16 0.0078,
    # fp16 0.00098), so averaging into the half-precision weights never moved them. After 500
    # updates the gap is 0.02 x 0.992^500 = 3.6e-4: the EMA is 1.02 to within a rounding step.
    actor, ema = nn.Linear(8, 8).to(dtype), nn.Linear(8, 8).to(dtype)
    with torch.no_grad():
        ema.weight.fill_(1.0)
        actor.weight.fill_(1.02)
    for _ in range(500):
        moving_average(actor, ema)
    step = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    target = float(actor.weight[0, 0].detach())  # 1.02 rounded to dtype
    assert abs(float(ema.weight[0, 0].detach()) - target) <= step


def test_half_precision_ema_follows_weights_written_outside_it():
    # The fp32 shadow must never override weights set by someone else (a checkpoint load, a copy).
    actor, ema = nn.Linear(4, 4).to(torch.bfloat16), nn.Linear(4, 4).to(torch.bfloat16)
    with torch.no_grad():
        actor.weight.fill_(2.0)
        ema.weight.fill_(1.0)
    moving_average(actor, ema)  # shadow created
    with torch.no_grad():
        ema.weight.fill_(-3.0)  # e.g. Checkpointer.resume loading the EMA's saved weights
    moving_average(actor, ema)
    expected = 0.992 * -3.0 + 0.008 * 2.0
    assert abs(float(ema.weight[0, 0]) - expected) < 0.02
    moving_average(actor, ema, beta=0.0)  # an exact copy drops the shadow
    assert torch.equal(ema.weight, actor.weight)


def test_zero3_ema_update_is_kept_for_partitioned_and_persistent_params(critic_dirs, data_cache):
    import deepspeed

    from dschat.models.tokenizer import load_hf_tokenizer
    from dschat.rlhf.rlhf_engine import DeepSpeedRLHFEngine
    from dschat.runtime.dist import init_distributed

    init_distributed()
    args = step3_main().parse_args(base_argv("tiny-llama", critic_dirs["tiny-llama"], data_cache,
                                             "--actor_zero_stage", "3", "--enable_ema", "--actor_lora_dim", "4"))
    engine = DeepSpeedRLHFEngine("tiny-llama", str(critic_dirs["tiny-llama"]), load_hf_tokenizer("tiny-llama"), args, 10)
    actor, ema = engine.actor.module, engine.actor_ema.module

    def full(module):
        out = {}
        for name, p in module.named_parameters():
            with deepspeed.zero.GatheredParameters([p]):
                out[name] = p.detach().clone()
        return out

    start = full(ema)
    assert all(torch.equal(start[n], v) for n, v in full(actor).items())  # EMA starts as an exact copy
    for p in actor.parameters():  # move the actor by +1 everywhere (rank 0's edit is broadcast)
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            p.data.add_(1.0)
    moving_average(engine.actor, engine.actor_ema, zero_stage=3)
    after = full(ema)
    persistent = {n for n, p in ema.named_parameters() if getattr(p, "ds_persist", False)}
    assert persistent and len(persistent) < len(after)  # both kinds are covered
    for name, value in after.items():
        assert torch.allclose(value, start[name] + (1 - EMA_BETA), atol=1e-6), name
