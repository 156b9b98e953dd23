"""Gradient reduction on one data-parallel rank at ZeRO stage 0, without DeepSpeed's flat copy.

At ZeRO stage 0 DeepSpeed "all-reduces" the gradients after every backward that ends an accumulation
step, also when the data-parallel group has one rank: it copies every gradient into new flat buffers
of up to 5e8 elements, casts them to the communication dtype, reduces them over the one rank, casts
them back and copies them into the gradients. On one rank the reduction is the identity, so what the
whole round trip does to the numbers is only:

* a trainable parameter without a gradient gets a zero gradient (the optimizer then steps it: Adam's
  moments decay, and weight decay applies);
* each gradient is rounded to the communication dtype where that differs from the gradient's own
  (at ZeRO-0 DeepSpeed communicates in the training dtype, the gradients' own, so the cast is exact
  in every config dschat builds; a ``communication_data_type`` narrower than the gradients would round).

:func:`reduce_on_one_rank` does exactly those two things in place, per tensor, and nothing else, so
training is bit for bit the same. It saves two copies of every gradient, the flat buffers (up to 5e8
elements at once: 1 GB of bf16 gradients beside a 1.3B model's training state) and the collective
call (what that costs: ``benchmarks/step3.py --profile``, benchmarks/results.md).

It applies only where it is that identity: one rank in the data-parallel group, no pipeline,
sequence or expert parallelism (nor AutoEP's tensor-parallel folding), an optimizer that reduces the
model's own gradients (not DeepSpeed's BF16 optimizer with its fp32 copies, which stage 0 builds only
with pipeline parallelism), no sparse gradients, and no gradient pre-division factor (``mul_(1/f)``
then ``mul_(f)`` rounds). Everywhere else DeepSpeed's own reduction runs.
"""
from __future__ import annotations

from typing import Any

import torch


def one_rank_reduction_applies(engine: Any) -> bool:
    """Whether ``engine``'s ZeRO-0 gradient all-reduce is over one rank and :func:`reduce_on_one_rank`
    reproduces it exactly."""
    return (engine.optimizer is not None
            and engine.zero_optimization_stage() == 0
            and engine.dp_world_size == 1
            and getattr(engine, "seq_dp_world_size", 1) == 1
            and getattr(engine, "sequence_parallel_size", 1) == 1
            and not engine.pipeline_parallelism
            and not engine.has_moe_layers
            and getattr(engine, "_autoep_folding_spec", None) is None
            and not hasattr(engine.optimizer, "get_grads_for_reduction")  # the BF16 optimizer's fp32 copies
            and engine.gradient_predivide_factor() == 1.0
            and not (hasattr(engine, "is_deepcompile_active") and engine.is_deepcompile_active()))


def reduce_on_one_rank(engine: Any, deepspeeds: Any) -> None:
    """What ``engine.allreduce_gradients()`` does to the gradients on one rank, in place: at the end
    of an accumulation step, trainable parameters without a gradient get zeros, and gradients are
    rounded to the communication dtype. Sparse gradients go to ``deepspeeds`` (DeepSpeed's own)."""
    optimizer = engine.optimizer
    if hasattr(optimizer, "set_gradient_accumulation_boundary"):
        optimizer.set_gradient_accumulation_boundary(engine.is_gradient_accumulation_boundary())
    if not engine.is_gradient_accumulation_boundary():
        return
    grads = []
    for param in engine.module.parameters():
        if not param.requires_grad or param.numel() == 0:
            continue
        if param.grad is None:
            param.grad = torch.zeros(param.size(), dtype=param.dtype, device=param.device)
        grads.append(param.grad)
    if any(g.is_sparse for g in grads):
        deepspeeds()
        return
    comm = engine.communication_data_type
    with torch.no_grad():
        for g in grads:
            if g.dtype != comm:
                g.copy_(g.to(comm))


def reduce_gradients_in_place_on_one_rank(engine: Any) -> bool:
    """Give ``engine`` :func:`reduce_on_one_rank` as its ``allreduce_gradients`` where that is exactly
    DeepSpeed's reduction (:func:`one_rank_reduction_applies`); whether it did."""
    if not one_rank_reduction_applies(engine):
        return False
    deepspeeds = engine.allreduce_gradients
    engine.allreduce_gradients = lambda *args, **kwargs: reduce_on_one_rank(engine, deepspeeds)
    return True
