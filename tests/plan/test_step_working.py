"""What DeepSpeed adds beyond the model states, by hand on the tiny OPT config of test_phases.py:
the optimizer step's fp32 gradient copies, ZeRO-1's whole gradients between accumulation boundaries,
the KV cache's head width without the Hybrid Engine, and the host memory while the engines load one
after another.

Tiny OPT's optimizer groups (dschat's: decay, then no-decay): the actor's 6048 weights (the two
embeddings 896 + 1056 and per layer q, k, v, out 4 x 256 and fc1, fc2 2 x 512) and 384 biases and
norms; the critic's body the same plus its value head (16) in the decay group: 6064 and 384. The
actor has 6432 parameters (its LM head is tied), the critic 6448.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dschat.plan.cli import build_parser, plan

from test_phases import TINY_OPT, _argv, _phase

ACTOR_GROUPS, CRITIC_GROUPS = (6048, 384), (6064, 384)
ACTOR_NUMEL, CRITIC_NUMEL = 6432, 6448


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-opt-config")
    (folder / "config.json").write_text(json.dumps(TINY_OPT))
    return folder


def _plan(folder: Path, *extra: str) -> dict:
    argv = _argv(folder, *extra)
    return plan(build_parser().parse_args(argv))


def test_zero0_fp16_step_converts_and_flattens_each_group_to_fp32(tiny):
    # FP16_Optimizer.step, group by group: the group's fp32 grads and their flat copy (8 bytes an element);
    # an earlier group keeps its 4-byte flat and has freed its 2-byte grads.
    def peak(groups):
        return max(sum(groups[:i]) * (4 - 2) + 8 * n for i, n in enumerate(groups))

    step = _phase(_plan(tiny), "optimizer step")
    assert peak(ACTOR_GROUPS) == 48384 and peak(CRITIC_GROUPS) == 48512
    assert step["critic step's fp32 gradients"] == 48512  # the larger of the two steps, one after the other
    assert "actor step's fp32 gradients" not in step


def test_zero2_step_flattens_and_converts_one_partition_at_a_time(tiny):
    two = ("--actor_zero_stage", "2", "--critic_zero_stage", "2", "--gpus_per_node", "2")
    # the largest group's partition: 6064 aligned to 2 x 2 ranks, halved = 3032 elements
    assert _phase(_plan(tiny, *two), "optimizer step")["critic step's fp32 gradients"] == 3032 * (2 + 4)
    # in fp32 the flat copy is fp32 already: no conversion
    fp32 = _phase(_plan(tiny, *two, "--dtype", "fp32"), "optimizer step")
    assert fp32["critic step's fp32 gradients"] == 3032 * 4


def test_zero3_step_flattens_and_converts_one_sub_group_at_a_time(tiny, monkeypatch):
    three = ("--actor_zero_stage", "3", "--critic_zero_stage", "3", "--gpus_per_node", "2")
    # every tiny-OPT parameter has an even size: the critic's decay group is 6064 / 2 = 3032 elements a rank
    assert _phase(_plan(tiny, *three), "optimizer step")["critic step's fp32 gradients"] == 3032 * (2 + 4)
    # DeepSpeed's sub_group_size splits a group once a sub-group reaches it (here 1000 elements)
    from dschat.plan import model_state
    from dschat.plan.inventory import Param

    monkeypatch.setattr(model_state, "ZERO3_SUB_GROUP_SIZE", 1000)
    params = [Param(f"w{i}", 2 * n, True) for i, n in enumerate((600, 500, 300, 100))]  # partitions on 2 ranks
    assert model_state._zero3_sub_groups([params, params[3:]], 2) == [1100, 400, 100]


@pytest.mark.parametrize("extra", [("--dtype", "fp32"),  # ZeRO 0 in fp32: FusedAdam steps the weights' own grads
                                   ("--actor_zero_stage", "2", "--critic_zero_stage", "2", "--offload"),  # on the host
                                   ("--actor_zero_stage", "3", "--critic_zero_stage", "3", "--offload")])
def test_no_step_copy_on_the_gpu_in_fp32_at_zero0_or_with_offload(tiny, extra):
    assert not [k for k in _phase(_plan(tiny, *extra), "optimizer step") if "step's fp32 gradients" in k]


def test_zero1_gradient_accumulation_keeps_whole_gradients_between_boundaries(tiny):
    zero1 = ("--actor_zero_stage", "1", "--critic_zero_stage", "1", "--gpus_per_node", "2")
    accumulating = _plan(tiny, *zero1, "--gradient_accumulation_steps", "2")
    assert _phase(accumulating, "actor training")["actor gradients between accumulation boundaries"] == ACTOR_NUMEL * 2
    critic = _phase(accumulating, "critic training")
    assert critic["critic gradients between accumulation boundaries"] == CRITIC_NUMEL * 2
    for extra in (("--gradient_accumulation_steps", "1"),  # reduced at every backward
                  ("--actor_zero_stage", "2", "--critic_zero_stage", "2", "--gradient_accumulation_steps", "2")):
        result = _plan(tiny, *zero1, *extra)
        assert not [k for p in result["phases"] for k in p["consumers"] if "between accumulation" in k]


def test_the_kv_cache_without_the_hybrid_engine_uses_the_configs_head_dim(tmp_path):
    # Qwen3 sets head_dim apart from hidden / heads (here 8, not 16 / 4).
    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 16, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 32,
              "vocab_size": 50, "max_position_embeddings": 64, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cache = _phase(_plan(tmp_path), "generation")["KV cache"]
    assert cache == 2 * 2 * 3 * (20 + 30) * 2 * 8 * 2  # k and v x layers x batch x tokens x kv heads x head_dim x fp16


def test_host_memory_at_load_is_one_model_read_at_a_time_plus_the_offloaded_states(tiny):
    # No offload: the largest model's fp32 read (the critic's and the reward model's 6448 parameters).
    assert _plan(tiny)["host_bytes_at_load"] == CRITIC_NUMEL * 4
    # ZeRO-2 --offload: the actor's and critic's fp32 master, moments and gradients (16 bytes an element)
    # stay on the host, and DeepSpeed's offload buffers in fp16: a gradient buffer of the largest
    # parameter (the 1056-element position embedding) and a copy of the weight partition; the peak
    # is the last model's read on top of both.
    offload = _plan(tiny, "--actor_zero_stage", "2", "--critic_zero_stage", "2", "--offload")
    buffers = (1056 + ACTOR_NUMEL) * 2 + (1056 + CRITIC_NUMEL) * 2
    assert offload["host_bytes_at_load"] == ACTOR_NUMEL * 16 + CRITIC_NUMEL * 16 + buffers + CRITIC_NUMEL * 4
    # ... and each trained engine's device gradient buffer (the largest parameter) is resident.
    resident = _phase(offload, "generation")
    assert resident["actor offload buffers"] == resident["critic offload buffers"] == 1056 * 2
