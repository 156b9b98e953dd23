"""``python -m dschat.plan``: the JSON keys, the search when a run does not fit, and bad input (exit 2)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dschat.errors import EXIT_USAGE
from dschat.plan.cli import main, parse_size
from dschat.errors import UserError

from helpers.steps import cli_env

OPT_1_3B = {"model_type": "opt", "architectures": ["OPTForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 24,
            "num_attention_heads": 32, "ffn_dim": 8192, "vocab_size": 50272, "max_position_embeddings": 2048,
            "word_embed_proj_dim": 2048, "do_layer_norm_before": True}


@pytest.fixture(scope="module")
def config_only(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("opt-1.3b-config")
    (folder / "config.json").write_text(json.dumps(OPT_1_3B))
    return folder


def _argv(folder: Path, *extra: str) -> list[str]:
    return ["--actor_model_name_or_path", str(folder), "--critic_model_name_or_path", str(folder),
            "--dtype", "fp16", "--gpus_per_node", "1", *extra]


def test_a_config_only_folder_plans_to_json_with_the_documented_keys(config_only, capsys):
    assert main(_argv(config_only, "--gpu_memory", "80GB", "--json")) == 0
    result = json.loads(capsys.readouterr().out)
    assert {"fits", "peak_bytes_per_gpu", "phases", "suggestions"} <= set(result)
    # OPT-1.3B: 1,315,758,080 parameters with its 50272 rows; the critic adds the 2048-wide value head.
    assert result["model_states"]["actor"]["numel"] == 1_315_758_080
    assert result["model_states"]["critic"]["numel"] == 1_315_758_080 + 2048  # tied head: the body has them all
    assert [p["name"] for p in result["phases"]][0] == "generation"


def test_a_run_that_does_not_fit_names_configurations_that_do(config_only, capsys):
    assert main(_argv(config_only, "--gpu_memory", "24GB", "--per_device_generation_batch_size", "4",
                      "--per_device_training_batch_size", "4", "--json")) == 0
    result = json.loads(capsys.readouterr().out)
    assert not result["fits"] and result["suggestions"]
    costs = [s["cost"] for s in result["suggestions"]]
    assert costs == sorted(costs)
    assert all(s["peak_bytes_per_gpu"] <= 24e9 * 0.9 for s in result["suggestions"])
    # A slower configuration is listed only for more room: one with a peak no lower than a faster
    # one's (a ZeRO-3 critic on one GPU, a smaller batch where the optimizer step sets the peak) is not.
    for lora in (True, False):  # LoRA changes what is trained: each kind keeps its own fastest fits
        peaks = [s["peak_bytes_per_gpu"] for s in result["suggestions"] if ("--only_optimize_lora" in s["flags"]) == lora]
        assert peaks and peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks), peaks


def test_whole_model_fits_are_listed_beside_cheaper_lora_ones(config_only, capsys):
    """OPT-1.3B on a 72 GB GPU: gradient checkpointing alone (the whole model trained, 57.89 GB) is
    listed though LoRA with it peaks lower at the same speed, not only offload's slower fits."""
    assert main(_argv(config_only, "--gpu_memory", "72GB", "--json")) == 0
    flags = [s["flags"] for s in json.loads(capsys.readouterr().out)["suggestions"]]
    assert ["--actor_gradient_checkpointing", "--critic_gradient_checkpointing"] in flags, flags


def test_a_run_nothing_fits_says_so_and_what_to_do(config_only, capsys):
    """Even ZeRO-3, offload, LoRA, checkpointing and batch 1 on 16 times the nodes need more than 2 GB:
    the table ends with one line saying nothing tried fits and to use GPUs with more memory."""
    from dschat.plan.cli import NOTHING_FITS

    assert main(_argv(config_only, "--gpu_memory", "2GB")) == 0
    out = capsys.readouterr().out.splitlines()
    assert any("does NOT fit" in line for line in out) and out[-1] == NOTHING_FITS and not any("fits with" in line for line in out)
    assert main(_argv(config_only, "--gpu_memory", "24GB")) == 0
    assert NOTHING_FITS not in capsys.readouterr().out


@pytest.mark.parametrize("problem", ["size", "no-config", "architecture"])
def test_bad_input_is_one_line_and_exit_2(problem, config_only, tmp_path):
    folder = config_only
    extra = ["--gpu_memory", "80 parsecs"] if problem == "size" else []
    if problem == "no-config":
        folder = tmp_path
    if problem == "architecture":
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
        folder = tmp_path
    proc = subprocess.run([sys.executable, "-m", "dschat.plan", *_argv(folder, *extra)], capture_output=True, text=True,
                          env=cli_env(), timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == EXIT_USAGE and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_sizes():
    assert parse_size("80GB", "--gpu_memory") == 80 * 10**9
    assert parse_size("40GiB", "--gpu_memory") == 40 * 2**30
    assert parse_size("512B", "--host_memory") == 512 and parse_size(" 1.5 TB ", "--host_memory") == 15 * 10**11
    with pytest.raises(UserError):
        parse_size("lots", "--gpu_memory")
    with pytest.raises(UserError, match="is too large to be a memory size"):  # was an OverflowError traceback
        parse_size("1" + "0" * 320 + "GB", "--gpu_memory")


@pytest.mark.parametrize("flag", ["--gpu_memory", "--host_memory"])
def test_a_size_without_a_unit_is_one_line_naming_the_fix(flag, config_only, capsys):
    # "80" was read as 80 bytes ("on a 0.00 GB GPU: does NOT fit"): bytes or gigabytes, it cannot tell.
    with pytest.raises(UserError, match="give a unit, like 80GB"):
        parse_size("80", flag)
    capsys.readouterr()
    assert main(_argv(config_only, flag, "80")) == EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.err.strip() == f"error: {flag} '80' has no unit: give a unit, like 80GB or 80GiB"
    assert "fit" not in captured.out


def test_preflight_stops_a_run_that_cannot_fit_with_the_phase_the_shortfall_and_a_fix(config_only):
    from dschat.plan.preflight import preflight  # noqa: PLC0415 - one test of it

    argv = ["--actor_model_name_or_path", str(config_only), "--critic_model_name_or_path", str(config_only),
            "--dtype", "fp16", "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "4"]
    with pytest.raises(UserError, match=r"step 3 does not fit: .* needs .* per GPU, .* more than .*; add --"):
        preflight(argv, world=1, gpus_per_node=1, accelerator="cuda", gpu_bytes=24 * 10**9)
    assert preflight(argv, world=1, gpus_per_node=1, accelerator="cuda", gpu_bytes=200 * 10**9)["fits"]
    printed = []
    result = preflight(argv, world=1, gpus_per_node=1, accelerator="cpu", gpu_bytes=24 * 10**9, echo=printed.append)
    assert not result["fits"] and "does NOT fit" in printed[0]


LLAMA_1B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256,
            "max_position_embeddings": 2048, "tie_word_embeddings": True}


@pytest.mark.parametrize("mode", ["on", "off", "auto"])
def test_a_zero3_actor_is_gathered_for_generation_only_where_the_run_gathers_it(mode, config_only, capsys):
    # The run's rule (runtime/zero3.fits_gathered): "auto" gathers when the full model fits in half the
    # memory left free. OPT-1.3B in fp16 is 2.6 GB: on 8 GPUs of 4 GB "auto" fetches layer by layer.
    assert main(_argv(config_only, "--actor_zero_stage", "3", "--critic_zero_stage", "3", "--gpu_memory", "4GB",
                      "--gpus_per_node", "8",
                      "--zero3_gather_for_generation", mode, "--json")) == 0
    generation = json.loads(capsys.readouterr().out)["phases"][0]["consumers"]
    assert ("actor gathered whole" in generation) == (mode == "on")
    assert ("ZeRO-3 layer gathers" in generation) == (mode != "on")


def test_the_search_skips_options_a_model_cannot_take(tmp_path, capsys):
    # LoRA's default filter ("decoder.layers.") matches no LLaMA layer: the search leaves that option out
    # instead of stopping with the LoRA error the user never asked for.
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_1B))
    assert main(_argv(tmp_path, "--gpu_memory", "16GB", "--json")) == 0
    result = json.loads(capsys.readouterr().out)
    assert not result["fits"] and result["suggestions"]
    assert all("--only_optimize_lora" not in s["flags"] for s in result["suggestions"])
