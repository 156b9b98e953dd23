"""The paper's Table 3 (DeepSpeed-Chat, single GPU): the largest OPT actor that fits each GPU with
upstream's ``opt/single_gpu/run_6.7b_lora.sh`` (ZeRO 0, actor LoRA 128, actor and critic gradient
checkpointing, OPT-350m critic, batch 8, 256 + 256 tokens, Hybrid Engine, fp16) and LoRA-only
training (``--only_optimize_lora``), planned from configs alone.

dschat's Hybrid Engine decodes OPT from an inference copy of the actor's weights (fp16, the whole
model at ``--inference_tp_size 1``) with its own KV cache, kept between rollouts unless
``--release_inference_cache``; the copy is what moves the rows. Pinned below with their numbers:

* the recipe as written (copy kept, so resident in every phase): V100-32G OPT-2.7B (reproduced,
  26.9 GiB, in the optimizer step), A6000-48G OPT-2.7B, A100-80G OPT-6.7B;
* with ``--release_inference_cache`` (the copy in the generation phase only): V100-32G OPT-2.7B
  (reproduced, 24.4 GiB), A6000-48G OPT-2.7B (OPT-6.7B's generation plans at 49.3 GiB), A100-80G
  OPT-6.7B (OPT-13B's generation at 87.5 GiB);
* A100-40G -> OPT-6.7B is not reproduced either way.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dschat.plan.cli import build_parser, plan
from dschat.recipes.loading import get_recipe

GIB = 2**30
# hidden, layers, heads, ffn, word_embed_proj_dim (the published OPT configs)
OPT = {"350m": (1024, 24, 16, 4096, 512), "2.7b": (2560, 32, 32, 10240, 2560), "6.7b": (4096, 32, 32, 16384, 4096),
       "13b": (5120, 40, 40, 20480, 5120), "30b": (7168, 48, 56, 28672, 7168)}
#: Upstream's recipe as configs/step3.yaml holds it (read, not written out here, so the two cannot
#: drift apart), and the paper's setting: LoRA-only training, fp16, one GPU.
RECIPE = get_recipe("step3", "opt/single_gpu/6.7b_lora")
PAPER = ("--only_optimize_lora", "--dtype", "fp16", "--gpus_per_node", "1")


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("opt_configs")
    out = {}
    for size, (hidden, layers, heads, ffn, proj) in OPT.items():
        folder = root / f"opt-{size}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({
            "model_type": "opt", "architectures": ["OPTForCausalLM"], "hidden_size": hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads, "ffn_dim": ffn, "vocab_size": 50272,
            "max_position_embeddings": 2048, "word_embed_proj_dim": proj, "do_layer_norm_before": size != "350m"}))
        out[size] = folder
    return out


def test_the_recipe_is_the_one_the_table_describes():
    flags = dict(RECIPE.flags)
    assert {k: flags[k] for k in ("actor_lora_dim", "actor_gradient_checkpointing", "critic_gradient_checkpointing",
                                  "per_device_generation_batch_size", "per_device_training_batch_size",
                                  "max_prompt_seq_len", "max_answer_seq_len", "enable_hybrid_engine")} == {
        "actor_lora_dim": "128", "actor_gradient_checkpointing": True, "critic_gradient_checkpointing": True,
        "per_device_generation_batch_size": "8", "per_device_training_batch_size": "8", "max_prompt_seq_len": "256",
        "max_answer_seq_len": "256", "enable_hybrid_engine": True}
    assert (str(RECIPE.defaults["actor_zero_stage"]), str(RECIPE.defaults["critic_zero_stage"])) == ("0", "0")


def _plan(configs, size: str, gpu: str, *extra: str) -> dict:
    argv = RECIPE.render({"actor_model": str(configs[size]), "critic_model": str(configs["350m"])},
                         [*PAPER, "--gpu_memory", gpu, *extra])
    return plan(build_parser().parse_args(argv))


SIZES = ("2.7b", "6.7b", "13b", "30b")


def _largest(configs, gpu: str, *extra: str) -> str | None:
    fitting = [size for size in SIZES if _plan(configs, size, gpu, *extra)["fits"]]
    return fitting[-1] if fitting else None


@pytest.mark.parametrize("gpu,paper,kept,released", [("32GiB", "2.7b", "2.7b", "2.7b"),
                                                      ("48GiB", "6.7b", "2.7b", "2.7b"),
                                                      ("80GiB", "13b", "6.7b", "6.7b")])
def test_the_largest_opt_actor_that_fits_each_gpu(configs, gpu, paper, kept, released):
    assert _largest(configs, gpu) == kept
    assert _largest(configs, gpu, "--release_inference_cache") == released
    if released != paper:  # not reproduced: the Hybrid Engine's copy in generation is over the margin
        refused = _plan(configs, paper, gpu, "--release_inference_cache")
        assert refused["peak_phase"] == "generation" and refused["margin_bytes"] < 0


@pytest.mark.parametrize("size,kept,released", [("2.7b", 26.9, 24.4), ("6.7b", 52.1, 49.3), ("13b", 91.1, 87.5)])
def test_the_planned_peaks(configs, size, kept, released):
    assert round(_plan(configs, size, "80GiB")["peak_bytes_per_gpu"] / GIB, 1) == kept
    assert round(_plan(configs, size, "80GiB", "--release_inference_cache")["peak_bytes_per_gpu"] / GIB, 1) == released


def test_a100_40g_with_opt_6_7b_is_reported_with_its_numbers(configs):
    result = _plan(configs, "6.7b", "40GiB", "--release_inference_cache")
    assert not result["fits"] and result["peak_phase"] == "generation"
    assert 49 * GIB < result["peak_bytes_per_gpu"] < 50 * GIB
