"""The phases' consumers of the Hybrid Engine, ``--inference_tp_size``, the ``--zero3_gather_*`` flags,
ZeRO's reduction buckets and ``--enable_ema``, by hand on a tiny OPT config, and the search's
generation changes.

Tiny OPT (hidden 16, 2 layers, 4 heads, ffn 32, vocabulary 50 -> 56 rows as dschat pads it, 64
positions + OPT's offset 2, tied head, pre-norm) has, by parameter:

* ``embed_tokens`` 56 x 16 = 896, ``embed_positions`` 66 x 16 = 1056, the final norm 2 x 16 = 32;
* per layer: q, k, v, out 4 x (16 x 16 + 16) = 1088, two norms 2 x 32 = 64, fc1 16 x 32 + 32 = 544,
  fc2 32 x 16 + 16 = 528: 2224;

6432 in all (1984 outside the layers, 4448 in them).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import OPTConfig, OPTForCausalLM

from dschat.errors import UserError
from dschat.models.decoder.layouts import decoder_spec
from dschat.models.decoder.tensor_parallel import ShardedInferenceWeights
from dschat.plan.cli import build_parser, plan, suggestions
from dschat.rlhf.rollout.dschat_engine import DschatHybridEngine
from dschat.rlhf.rollout.sampling import DecodingSettings

TINY_OPT = {"model_type": "opt", "architectures": ["OPTForCausalLM"], "hidden_size": 16, "num_hidden_layers": 2,
            "num_attention_heads": 4, "ffn_dim": 32, "vocab_size": 50, "max_position_embeddings": 64,
            "word_embed_proj_dim": 16, "do_layer_norm_before": True}
NUMEL = 6432
FP16 = 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-opt-config")
    (folder / "config.json").write_text(json.dumps(TINY_OPT))
    return folder


def _argv(folder: Path, *extra: str) -> list[str]:
    # batch 3, prompt 20 + answer 30 = 50 tokens: the engine's cache capacity rounds it up to 64
    return ["--actor_model_name_or_path", str(folder), "--critic_model_name_or_path", str(folder), "--dtype", "fp16",
            "--gpus_per_node", "1", "--per_device_generation_batch_size", "3", "--per_device_training_batch_size", "3",
            "--max_prompt_seq_len", "20", "--max_answer_seq_len", "30", "--gpu_memory", "80GB", *extra]


def _plan(folder: Path, *extra: str, gpu_bytes: int | None = None) -> dict:
    return plan(build_parser().parse_args(_argv(folder, *extra)), gpu_bytes=gpu_bytes)


def _phase(result: dict, name: str) -> dict[str, int]:
    return next(p for p in result["phases"] if p["name"] == name)["consumers"]


def test_the_hybrid_engine_copy_and_cache_of_tiny_opt(tiny):
    result = _plan(tiny, "--enable_hybrid_engine")
    assert result["model_states"]["actor"]["numel"] == NUMEL
    generation = _phase(result, "generation")
    assert generation["HE inference weights"] == NUMEL * FP16  # 12864
    # 2 (k, v) x 2 layers x 3 rows x 4 kv heads x 64 columns x 4 head_dim x 2 bytes + a (3, 64) bool mask
    assert generation["HE KV cache"] == 2 * 2 * 3 * 4 * 64 * 4 * 2 + 3 * 64 == 24768
    assert generation["logits"] == 3 * 56 * 4  # the last position's fp32 logits
    assert "KV cache" not in generation  # the training module does not decode
    for name in ("scoring", "actor training", "critic training", "optimizer step"):  # kept between rollouts
        assert _phase(result, name)["HE inference weights (kept)"] == 12864
        assert _phase(result, name)["HE KV cache (kept)"] == 24768


# One layer's full activations, tiny OPT at batch 3 x 50 tokens in fp16: 3 x 50 x 16 x (34 + 5 x 4 x 50 / 16)
ONE_LAYER = 3 * 50 * 16 * (34 * 16 + 5 * 4 * 50) // 16  # 231600 (2 bytes per element: the formula's own)


def test_the_scoring_and_training_terms_of_tiny_opt_by_hand(tiny):
    """Logits in the weights' dtype (training: also their gradient) plus their log-probs' fp32 working set:
    two (seq, vocab) rows for fp16 logits (computed a batch row at a time), a whole (batch, seq, vocab)
    temporary for fp32 ones; scoring's hidden states; the module's generation logits; activations."""
    fp16 = _plan(tiny)
    assert _phase(fp16, "generation")["logits"] == 3 * 56 * 4  # the last position's, fp32
    scoring, training = _phase(fp16, "scoring"), _phase(fp16, "actor training")
    assert scoring["logits"] == 3 * 50 * 56 * 2 + 2 * 50 * 56 * 4 == 39200
    assert scoring["hidden states"] == 3 * 50 * 16 * 2 * 4 == 19200
    assert training["logits"] == 2 * 3 * 50 * 56 * 2 + 2 * 50 * 56 * 4 == 56000
    assert training["actor activations"] == 2 * ONE_LAYER == 463200
    fp32 = _plan(tiny, "--dtype", "fp32")
    assert _phase(fp32, "scoring")["logits"] == 2 * 3 * 50 * 56 * 4 == 67200
    assert _phase(fp32, "actor training")["logits"] == 3 * 3 * 50 * 56 * 4 == 100800


def test_each_models_gradient_checkpointing_shrinks_its_own_activations(tiny):
    """Checkpointed: one (batch, seq, hidden) per layer plus one layer's full activations."""
    checkpointed = 2 * 3 * 50 * 16 * 2 + ONE_LAYER
    critic, actor = _plan(tiny, "--critic_gradient_checkpointing"), _plan(tiny, "--actor_gradient_checkpointing")
    assert _phase(critic, "critic training")["critic activations"] == checkpointed == 241200
    assert _phase(critic, "actor training")["actor activations"] == 2 * ONE_LAYER
    assert _phase(actor, "actor training")["actor activations"] == checkpointed
    assert _phase(actor, "critic training")["critic activations"] == 2 * ONE_LAYER


def test_release_inference_cache_keeps_the_copy_out_of_the_other_phases(tiny):
    kept, released = _plan(tiny, "--enable_hybrid_engine"), _plan(tiny, "--enable_hybrid_engine",
                                                                  "--release_inference_cache")
    assert _phase(released, "generation") == _phase(kept, "generation")
    for name in ("scoring", "actor training", "critic training", "optimizer step"):
        assert not any("(kept)" in k for k in _phase(released, name))
        assert sum(_phase(kept, name).values()) - sum(_phase(released, name).values()) == 12864 + 24768


def test_lora_factors_are_fused_out_of_the_inference_copy(tiny):
    generation = _phase(_plan(tiny, "--enable_hybrid_engine", "--actor_lora_dim", "4"), "generation")
    assert generation["HE inference weights"] == NUMEL * FP16


def test_without_the_flag_or_with_zero3_fetched_per_layer_the_module_decodes(tiny):
    assert "HE inference weights" not in _phase(_plan(tiny), "generation")
    off = _phase(_plan(tiny, "--enable_hybrid_engine", "--actor_zero_stage", "3", "--zero3_gather_for_generation",
                       "off"), "generation")
    assert "HE inference weights" not in off and "KV cache" in off


def test_inference_tp_splits_the_weights_over_the_group_and_batches_its_prompts(tiny):
    result = _plan(tiny, "--enable_hybrid_engine", "--gpus_per_node", "2", "--actor_zero_stage", "3",
                   "--inference_tp_size", "2")
    generation = _phase(result, "generation")
    # per layer: q, k, v, out weights 4 x 128, their biases (16, not over hidden) 64, norms 64, fc1 256 + 16,
    # fc2 256 + 16: 1184; embedding ceil(56 / 2) = 28 rows x 16 = 448; positions 1056 and final norm 32 whole
    assert generation["HE inference weights"] == (2 * 1184 + 448 + 1056 + 32) * FP16 == 7808
    # the group decodes 2 x 3 rows; each member keeps 4 / 2 kv heads
    assert generation["HE KV cache"] == 2 * 2 * 6 * 2 * 64 * 4 * 2 + 6 * 64
    assert generation["logits"] == 6 * 28 * 4
    # ZeRO-3 over 2 ranks: both layers (8 at a time) gathered, less this rank's half
    assert generation["ZeRO-3 gathers for the HE copy"] == 4448 * FP16 - 2224 * FP16
    one = _phase(_plan(tiny, "--enable_hybrid_engine", "--gpus_per_node", "2", "--actor_zero_stage", "3",
                       "--inference_tp_size", "2", "--tp_gather_partition_size", "1"), "generation")
    assert one["ZeRO-3 gathers for the HE copy"] == 2224 * FP16 - 1112 * FP16  # one layer (> the 1984 outside)
    whole = _phase(_plan(tiny, "--enable_hybrid_engine", "--gpus_per_node", "2", "--actor_zero_stage", "3",
                         "--zero3_gather_for_generation", "on"), "generation")
    assert whole["HE inference weights"] == NUMEL * FP16 > generation["HE inference weights"]
    assert whole["ZeRO-3 gathers for the HE copy"] == NUMEL * FP16 - NUMEL // 2 * FP16  # the whole actor


def test_an_inference_tp_size_the_run_refuses_is_the_plans_error(tiny):
    with pytest.raises(UserError, match="does not divide the world size"):
        _plan(tiny, "--enable_hybrid_engine", "--gpus_per_node", "2", "--actor_zero_stage", "3",
              "--inference_tp_size", "4")
    with pytest.raises(UserError, match="Hybrid Engine"):
        _plan(tiny, "--gpus_per_node", "2", "--inference_tp_size", "2")


@pytest.mark.parametrize("mode", ["on", "off", "auto"])
def test_zero3_gather_for_scoring(tiny, mode):
    result = _plan(tiny, "--gpus_per_node", "2", "--actor_zero_stage", "3", "--critic_zero_stage", "3",
                   "--zero3_gather_for_scoring", mode)
    scoring = _phase(result, "scoring")
    # auto on an 80 GB GPU: every model fits in half the free memory
    # the largest working set of the passes (one after the other): the critic's, its body (every parameter
    # of the tied model) plus the 16-wide value head, 6448 elements, less this rank's half
    assert ("critic gathered whole" in scoring) == (mode != "off")
    assert ("ZeRO-3 layer gathers" in scoring) == (mode == "off")
    if mode != "off":
        assert scoring["critic gathered whole"] == 6448 * FP16 - 6448 // 2 * FP16
    else:
        assert scoring["ZeRO-3 layer gathers"] == 6448 // 2 * FP16  # one of its two layers' share
    resident = sum(v for k, v in _phase(result, "optimizer step").items() if "step's fp32 gradients" not in k)
    tight = _plan(tiny, "--gpus_per_node", "2", "--actor_zero_stage", "3", "--critic_zero_stage", "3",
                  "--zero3_gather_for_scoring", "auto",
                  gpu_bytes=resident + NUMEL * FP16)  # half the free memory is less than a whole model
    assert "ZeRO-3 layer gathers" in _phase(tight, "scoring")


def test_zero3_gather_for_training(tiny):
    def actor_training(*extra: str, gpus: str = "4") -> dict[str, int]:
        return _phase(_plan(tiny, "--gpus_per_node", gpus, "--actor_zero_stage", "3", *extra), "actor training")

    auto, on, off = (actor_training("--zero3_gather_for_training", m) for m in ("auto", "on", "off"))
    assert auto == off and "ZeRO-3 layer gathers" in off  # auto: more than one data-parallel rank -> the hooks
    assert on["actor gathered whole"] == NUMEL * FP16 - NUMEL // 4 * FP16 and "ZeRO-3 layer gathers" not in on
    assert off["ZeRO-3 layer gathers"] == NUMEL // 2 * FP16  # one of two layers (the weights over the layers)
    assert sum(on.values()) > sum(off.values())
    one_rank = actor_training("--zero3_gather_for_training", "auto", gpus="1")  # a view of the partition: free
    assert "ZeRO-3 layer gathers" not in one_rank and "actor gathered whole" not in one_rank
    offloaded = actor_training("--zero3_gather_for_training", "auto", "--offload", "--critic_zero_stage", "2", gpus="1")
    assert "ZeRO-3 layer gathers" in offloaded


def test_reduction_buckets_are_in_the_training_phases_of_zero_1_2_and_resident_under_zero_3(tiny):
    result = _plan(tiny, "--actor_zero_stage", "2", "--critic_zero_stage", "1")
    two_buckets = 2 * 500_000_000 * FP16  # reduce_bucket_size elements, two with overlap_comm (dschat's config)
    assert _phase(result, "actor training")["actor reduction buckets"] == two_buckets
    assert _phase(result, "critic training")["critic reduction buckets"] == two_buckets
    assert "critic reduction buckets" not in _phase(result, "actor training")
    for name in ("generation", "scoring", "optimizer step"):
        assert not any("buckets" in k for k in _phase(result, name))
    zero3 = _plan(tiny, "--actor_zero_stage", "3")
    for name in ("generation", "scoring", "actor training", "critic training", "optimizer step"):
        assert _phase(zero3, name)["actor buckets"] == 500_000_000 * FP16  # one buffer, kept from the start


def test_the_ema_copy_is_resident_in_every_phase(tiny):
    result = _plan(tiny, "--enable_ema", "--actor_lora_dim", "4")
    # the actor's LoRA layout: per layer q, k, v, out 4 x (16 x 4 + 4 x 16), fc1 16 x 4 + 4 x 32, fc2 32 x 4 + 4 x 16
    lora = 2 * (4 * 128 + 192 + 192)
    assert result["model_states"]["ema"]["numel"] == NUMEL + lora
    for phase in result["phases"]:
        assert phase["consumers"]["ema params"] == (NUMEL + lora) * FP16
        assert not any(k.startswith("ema ") and k != "ema params" for k in phase["consumers"])  # no optimizer
    assert "ema" not in _plan(tiny)["model_states"]
    zero3 = _plan(tiny, "--enable_ema", "--gpus_per_node", "2", "--actor_zero_stage", "3")
    assert _phase(zero3, "optimizer step")["ema params"] == NUMEL // 2 * FP16  # ZeRO-3 with the actor
    offloaded = _plan(tiny, "--enable_ema", "--gpus_per_node", "2", "--actor_zero_stage", "3",
                      "--offload_reference_model")
    assert "ema params" not in _phase(offloaded, "optimizer step")


def _search(tiny: Path, *extra: str, gpu_bytes: int) -> list[dict]:
    argv = _argv(tiny, *extra)
    parser = build_parser()
    return suggestions(argv, parser.parse_args(argv), parser, limit=10_000, gpu_bytes=gpu_bytes)


def test_the_search_releases_the_inference_cache_when_that_is_what_fits(tiny):
    released = _plan(tiny, "--enable_hybrid_engine", "--release_inference_cache")["peak_bytes_per_gpu"]
    kept = _plan(tiny, "--enable_hybrid_engine")["peak_bytes_per_gpu"]
    assert released < kept
    gpu = int(released / 0.9) + 1  # the released copy fits, the kept one does not
    found = _search(tiny, "--enable_hybrid_engine", gpu_bytes=gpu)
    assert found and ["--release_inference_cache"] in [s["flags"] for s in found]
    assert next(s for s in found if s["flags"] == ["--release_inference_cache"])["cost"] == 1
    assert not any("--inference_tp_size" in s["flags"] for s in found)  # one rank: no group


def test_the_search_tries_inference_tp_where_the_world_and_heads_allow(tiny):
    base = ("--enable_hybrid_engine", "--gpus_per_node", "2", "--actor_zero_stage", "3", "--critic_zero_stage", "3")
    tp2 = _plan(tiny, *base, "--inference_tp_size", "2")["peak_bytes_per_gpu"]
    assert tp2 < _plan(tiny, *base)["peak_bytes_per_gpu"]
    found = _search(tiny, *base, gpu_bytes=int(tp2 / 0.9) + 1)
    flags = [s["flags"] for s in found]
    assert ["--inference_tp_size", "2"] in flags
    assert not any("4" in f[f.index("--inference_tp_size") + 1] for f in flags if "--inference_tp_size" in f)
    gather_off = [s for s in found if "--zero3_gather_for_generation" in s["flags"]]
    assert all(s["cost"] >= 4 for s in gather_off)
    costs = [s["cost"] for s in found]
    assert costs == sorted(costs)


def test_the_planned_copy_and_cache_are_the_live_engines_bytes(tiny):
    # dschat's Hybrid Engine on the CPU (fp32) decoding tiny OPT: its inference weights and its KV cache
    # after one rollout are the bytes the plan gives them.
    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(**{k: v for k, v in TINY_OPT.items() if k != "architectures"})).eval()
    model.resize_token_embeddings(56, mean_resizing=False)  # dschat's rows: the vocabulary rounded up to 8
    engine = DschatHybridEngine(model.config, decoding=DecodingSettings("greedy"), max_new_tokens=30,
                                eos_token_id=-1, pad_token_id=1)
    prompts = torch.randint(3, 50, (3, 20))
    engine.rollout(model, prompts, torch.ones_like(prompts))
    planned = _phase(_plan(tiny, "--enable_hybrid_engine", "--dtype", "fp32"), "generation")
    assert engine.model.weights.nbytes() == planned["HE inference weights"] == NUMEL * 4
    assert engine.cache.nbytes() == planned["HE KV cache"] == 2 * 2 * 3 * 4 * 64 * 4 * 4 + 3 * 64


def test_the_planned_tensor_parallel_shard_bounds_each_members_live_shard(tiny):
    # Each of 2 members' shard of tiny OPT, copied by the engine's own ShardedInferenceWeights (fp32):
    # the plan counts the q, k and v biases (16, not over hidden) whole where each member holds half
    # of them, 2 layers x 3 x 8 elements more; the rest is exact.
    model = OPTForCausalLM(OPTConfig(**{k: v for k, v in TINY_OPT.items() if k != "architectures"})).eval()
    model.resize_token_embeddings(56, mean_resizing=False)
    planned = _phase(_plan(tiny, "--enable_hybrid_engine", "--dtype", "fp32", "--gpus_per_node", "2",
                           "--actor_zero_stage", "3", "--inference_tp_size", "2"), "generation")["HE inference weights"]
    assert planned == 3904 * 4
    for member in (0, 1):
        shard = ShardedInferenceWeights(decoder_spec(model.config), 2, member)
        shard.refresh(model, torch.float32, torch.device("cpu"))
        assert planned - shard.nbytes() == 2 * 3 * 8 * 4


def test_align_overflow_plans_the_critics_training_inside_the_actors(tiny):
    """fp16 --align_overflow runs the critic's forward and backward while the actor's graph is alive
    (both losses are checked before either backward): the actor-training phase holds both."""
    plain = _plan(tiny, "--actor_zero_stage", "2", "--critic_zero_stage", "2")
    aligned = _plan(tiny, "--actor_zero_stage", "2", "--critic_zero_stage", "2", "--align_overflow")
    assert "critic activations" not in _phase(plain, "actor training")
    both = _phase(aligned, "actor training")
    assert both["critic activations"] == _phase(plain, "critic training")["critic activations"]
    assert both["critic reduction buckets"] == _phase(plain, "critic training")["critic reduction buckets"]
    assert _phase(aligned, "critic training") == _phase(plain, "critic training")
