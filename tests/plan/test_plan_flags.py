"""``python -m dschat.plan`` plans what the step runs: the step's own flag checks (a refused flag set is
the planner's one-line error, never a suggestion), only the engines a critic-free or function-scored
run builds, the critic from the model step 3 builds it from, a malformed ``config.json`` as one line,
suggestions that each change the configuration (and no generation flag that changes nothing), no
tensor-parallel group across nodes, and a verdict that names the host memory when that is the reason."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dschat.errors import EXIT_USAGE, UserError
from dschat.models.registry import resolve_model_path
from dschat.plan.cli import build_parser, main, plan, suggestions
from dschat.rlhf.guards import validate_step3_args
from dschat.rlhf.rlhf_engine import resolve_model_sources
from dschat.training.step_data import load_tokenizer

from test_cli import OPT_1_3B
from test_phases import TINY_OPT, _argv, _phase


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-opt-config")
    (folder / "config.json").write_text(json.dumps(TINY_OPT))
    return folder


def _error_line(argv: list[str], capsys) -> str:
    capsys.readouterr()
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("extra", [("--offload",), ("--offload_reference_model",),
                                   ("--enable_hybrid_engine", "--inference_tp_size", "2"),
                                   ("--actor_zero_stage", "5"), ("--max_answer_seq_len", "-10")])
def test_flags_step3_refuses_are_the_planners_error_with_step3s_line(tiny, extra, capsys):
    argv = _argv(tiny, "--gpus_per_node", "2", *extra)
    with pytest.raises(UserError) as refused:
        validate_step3_args(build_parser().parse_args(argv), accelerator="cuda", dtype="fp16")
    assert _error_line(argv, capsys) == f"error: {refused.value}"


def test_flags_step1_refuses_are_the_planners_error(tiny, capsys):
    line = _error_line(["--step", "1", "--model_name_or_path", str(tiny), "--zero_stage", "0", "--offload",
                        "--gpus_per_node", "1"], capsys)
    assert "--offload needs ZeRO" in line


def test_rows_past_the_position_table_are_the_planners_error(tiny, capsys):
    limit = TINY_OPT["max_position_embeddings"]
    line = _error_line(["--step", "1", "--model_name_or_path", str(tiny), "--max_seq_len", str(limit + 1),
                        "--gpus_per_node", "1"], capsys)
    assert f"--max_seq_len {limit + 1} is longer than {tiny} can read" in line
    line = _error_line(_argv(tiny, "--max_prompt_seq_len", str(limit - 1), "--max_answer_seq_len", "2"), capsys)
    assert f"--max_prompt_seq_len + --max_answer_seq_len {limit + 1} is longer than {tiny} can read" in line
    line = _error_line(["--step", "2", "--model_name_or_path", str(tiny), "--max_seq_len", "1", "--gpus_per_node", "1"],
                       capsys)
    assert "--max_seq_len must be at least 2 for chosen/rejected pairs" in line
    line = _error_line(["--step", "1", "--model_name_or_path", str(tiny), "--max_seq_len", "1", "--gpus_per_node", "1"],
                       capsys)
    assert "--max_seq_len must be at least 2 for step 1" in line


def test_the_search_proposes_no_flag_set_step3_refuses(tiny):
    # The Hybrid Engine on 2 ranks at ZeRO 0: --inference_tp_size 2 fits but needs --actor_zero_stage 3.
    argv = _argv(tiny, "--gpus_per_node", "2", "--enable_hybrid_engine")
    parser = build_parser()
    args = parser.parse_args(argv)
    found = suggestions(argv, args, parser, limit=1000, gpu_bytes=plan(args)["peak_bytes_per_gpu"])
    assert found
    for s in found:
        validate_step3_args(parser.parse_args([*argv, *s["flags"]]), accelerator="cuda", dtype="fp16")


def test_a_critic_free_algorithm_plans_no_critic(tiny):
    result = plan(build_parser().parse_args(_argv(tiny, "--algorithm", "grpo", "--num_generations", "3")))
    assert set(result["model_states"]) == {"actor", "ref", "reward"}
    assert [p["name"] for p in result["phases"]] == ["generation", "scoring", "actor training", "optimizer step"]
    assert not [k for p in result["phases"] for k in p["consumers"] if k.startswith("critic")]
    # Its suggestions offload the actor's optimizer without asking the critic's stage, and set no critic
    # checkpointing: neither is trained (step 3 checks --offload's stage on the engines it trains)
    argv = _argv(tiny, "--algorithm", "grpo", "--num_generations", "3")
    parser = build_parser()
    found = [s["flags"] for s in suggestions(argv, parser.parse_args(argv), parser, limit=1000, gpu_bytes=80 * 10**9)]
    assert ["--actor_zero_stage", "3", "--offload"] in found
    assert not [f for f in found if "--critic_gradient_checkpointing" in f]


def test_a_run_scored_by_functions_alone_plans_neither_critic_nor_reward_model(tiny):
    argv = ["--actor_model_name_or_path", str(tiny), "--algorithm", "grpo", "--num_generations", "3",
            "--reward_fn", "dschat.rewards:gold", "--gpus_per_node", "1", "--per_device_generation_batch_size", "3",
            "--per_device_training_batch_size", "3",
            "--max_prompt_seq_len", "32", "--max_answer_seq_len", "32"]  # within the config's 64 positions
    parser = build_parser()
    result = plan(parser.parse_args(argv))  # no critic folder is needed
    assert set(result["model_states"]) == {"actor", "ref"}
    # Its suggestions name no critic flag, which would change nothing
    found = suggestions(argv, parser.parse_args(argv), parser, limit=1000, gpu_bytes=2 * result["peak_bytes_per_gpu"])
    assert found and not [s for s in found if any(f.startswith("--critic_") for f in s["flags"])]
    assert any("--actor_gradient_checkpointing" in s["flags"] for s in found)
    # ... also beside --offload: step 3 checks its stage on the engines it trains only
    from dschat.plan.cli import _without_critic_flags
    assert _without_critic_flags(["--actor_zero_stage", "3", "--critic_zero_stage", "3", "--offload",
                                  "--critic_gradient_checkpointing"]) == ["--actor_zero_stage", "3", "--offload"]
    roomy = suggestions(argv, parser.parse_args(argv), parser, limit=1000, gpu_bytes=80 * 10**9)
    assert ["--actor_zero_stage", "3", "--offload"] in [s["flags"] for s in roomy]  # the critic's stage is not asked
    assert _without_critic_flags(["--critic_zero_stage", "3", "--actor_lora_dim", "128"]) == ["--actor_lora_dim", "128"]
    # PPO with --reward_fn keeps its critic, without the reward model
    ppo = plan(build_parser().parse_args(_argv(tiny, "--reward_fn", "dschat.rewards:gold")))
    assert set(ppo["model_states"]) == {"actor", "ref", "critic"}


@pytest.mark.parametrize("text", ["[1, 2]", '{"model_type": "opt", "vocab_size": null}',
                                  '{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 0, '
                                  '"num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100}'])
def test_a_malformed_config_is_one_line_naming_the_file(tiny, tmp_path, text, capsys):
    (tmp_path / "config.json").write_text(text)
    line = _error_line(["--actor_model_name_or_path", str(tmp_path), "--critic_model_name_or_path", str(tiny)], capsys)
    assert str(tmp_path / "config.json") in line


@pytest.mark.parametrize("change", [{"vocab_size": 0}, {"hidden_size": -64}])
def test_a_config_value_the_models_code_rejects_is_one_line(tiny, tmp_path, change, capsys):
    """Rejected by an assert (an embedding's padding index past no rows) or by a tensor's shape: both were
    tracebacks."""
    (tmp_path / "config.json").write_text(json.dumps({**TINY_OPT, **change}))
    line = _error_line(_argv(tmp_path, "--critic_model_name_or_path", str(tiny)), capsys)
    assert line.startswith(f"error: cannot build a opt model from {tmp_path} (") and "pass a decoder-only" in line


@pytest.mark.parametrize("config, expected", [
    ({**TINY_OPT, "num_hidden_layers": -1}, "num_hidden_layers is -1; a count of layers, heads or widths must be "
                                            "positive"),  # it planned negative activations and KV cache
    ({"model_type": "clip"}, "sets no top-level vocab_size (a clip config)"),  # an AttributeError traceback
    ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
      "intermediate_size": 128, "vocab_size": 100, "rope_scaling": {"rope_type": "nonsense", "factor": 2.0}},
     "(KeyError: 'nonsense')"),  # a KeyError traceback
])
def test_config_values_that_gave_a_traceback_or_a_negative_plan_are_one_line(tiny, tmp_path, config, expected, capsys):
    (tmp_path / "config.json").write_text(json.dumps(config))
    line = _error_line(_argv(tmp_path, "--critic_model_name_or_path", str(tiny)), capsys)
    assert str(tmp_path) in line and expected in line, line


def test_a_batch_pair_step3_refuses_is_the_planners_error_and_never_a_suggestion(tiny, capsys):
    """A generation batch that does not split into training micro-batches: step 3 refuses it before its
    preflight, so the planner does too; halving both batches (20/10 -> 5/2) is such a pair, never offered."""
    line = _error_line(_argv(tiny, "--per_device_generation_batch_size", "8", "--per_device_training_batch_size", "3"),
                       capsys)
    assert "per_device_generation_batch_size 8 rows does not split into micro-batches" in line
    argv = _argv(tiny, "--per_device_generation_batch_size", "20", "--per_device_training_batch_size", "10")
    parser = build_parser()
    for found in suggestions(argv, parser.parse_args(argv), parser, limit=1000, gpu_bytes=80 * 10**9):
        trial = parser.parse_args([*argv, *found["flags"]])
        assert trial.per_device_generation_batch_size % trial.per_device_training_batch_size == 0, found


def test_each_suggestion_changes_the_configuration_once(tmp_path):
    # OPT-1.3B already at LoRA 128 with --only_optimize_lora and batch 1: the search's LoRA change and
    # halvings change nothing, and must not fill the list.
    (tmp_path / "config.json").write_text(json.dumps(OPT_1_3B))
    argv = _argv(tmp_path, "--actor_lora_dim", "128", "--only_optimize_lora", "--per_device_generation_batch_size", "1",
                 "--per_device_training_batch_size", "1", "--gpus_per_node", "2")
    parser = build_parser()
    args = parser.parse_args(argv)
    found = suggestions(argv, args, parser, limit=1000, gpu_bytes=plan(args)["peak_bytes_per_gpu"])
    configurations = [vars(parser.parse_args([*argv, *s["flags"]])) for s in found]
    assert found and vars(args) not in configurations
    assert all(a != b for i, a in enumerate(configurations) for b in configurations[i + 1:])


def test_host_memory_verdict_names_the_host_and_its_own_margin(tiny, capsys):
    assert main(_argv(tiny, "--host_memory", "1KB")) == 0
    out = capsys.readouterr().out
    gpu_line = next(x for x in out.splitlines() if x.startswith("peak "))
    host_line = next(x for x in out.splitlines() if x.startswith("host memory at load time"))
    assert "GPU: fits (margin " in gpu_line
    assert host_line == ("host memory at load time: 0.00 GB per node of 0.00 GB: does NOT fit (0.00 GB more than the "
                         "host has)")
    assert "the run does NOT fit: the host memory at load time is the reason, not the GPU" in out
    result = plan(build_parser().parse_args(_argv(tiny, "--host_memory", "1KB")))
    assert (result["fits"], result["gpu_fits"], result["host_fits"]) == (False, True, False)
    assert _phase(result, "generation")  # the phases are planned as ever


def _critic_plan(actor: str, critic: str) -> dict:
    return plan(build_parser().parse_args(["--actor_model_name_or_path", actor, "--critic_model_name_or_path", critic,
                                           "--gpus_per_node", "1", "--max_prompt_seq_len", "32",
                                           "--max_answer_seq_len", "32"]))


def test_the_critic_is_planned_from_the_model_step3_builds_it_from(tiny, tmp_path, capsys):
    # Step 3 starts the critic from the actor, with a fresh value head, where the critic folder's
    # tokenizer is not the actor's (rlhf_engine.resolve_model_sources); the reward model stays the folder's.
    assert main(["--actor_model_name_or_path", "tiny-llama", "--critic_model_name_or_path", "tiny-opt",
                 "--gpus_per_node", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    numel = {role: states["numel"] for role, states in result["model_states"].items()}
    llama, opt = _critic_plan("tiny-llama", "tiny-llama"), _critic_plan("tiny-opt", "tiny-opt")
    assert not llama["critic_from_actor"] and not opt["critic_from_actor"] and not llama["notes"]
    assert result["critic_from_actor"] and numel["critic"] == llama["model_states"]["critic"]["numel"]
    assert numel["reward"] == opt["model_states"]["critic"]["numel"] != numel["critic"]
    step3 = resolve_model_sources("tiny-llama", "tiny-opt", None, load_tokenizer("tiny-llama", False),
                                  needs_critic=True, needs_reward=False)
    assert step3.critic_from_actor and result["notes"] == list(step3.notes)  # step 3's own line
    # The table says it first, and the preflight plans the same critic when step 3 tells it.
    assert main(["--actor_model_name_or_path", "tiny-llama", "--critic_model_name_or_path", "tiny-opt",
                 "--gpus_per_node", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == step3.notes[0]
    # The actor's tokenizer in a folder of another shape: that folder's model is the critic.
    shutil.copytree(resolve_model_path("tiny-opt"), tmp_path / "critic", ignore=shutil.ignore_patterns("*.safetensors"))
    (tmp_path / "critic" / "config.json").write_text(json.dumps(TINY_OPT))
    same = _critic_plan("tiny-opt", str(tmp_path / "critic"))
    assert not same["critic_from_actor"] and not same["notes"]
    folder_critic = _critic_plan(str(tiny), str(tiny))["model_states"]["critic"]["numel"]
    assert same["model_states"]["critic"]["numel"] == folder_critic
    # A folder holding config.json alone: its model, and a note that says what step 3 may do instead.
    only_config = _critic_plan("tiny-opt", str(tiny))
    assert not only_config["critic_from_actor"] and len(only_config["notes"]) == 1
    assert only_config["notes"][0].startswith(f"note: the critic is planned from {tiny}'s config.json; step 3 starts "
                                              "it from the actor tiny-opt with a fresh value head where their "
                                              "tokenizers differ, which the planner cannot compare here (")


def test_a_tensor_parallel_group_across_nodes_is_the_planners_error_in_step3s_words(tiny, capsys):
    # runtime/dist.tensor_parallel_group refuses a group whose ranks span hosts: 2 nodes of 3 GPUs put
    # ranks 2-3 of --inference_tp_size 2 on both (the degree divides the world size, 6).
    he = ("--enable_hybrid_engine", "--actor_zero_stage", "3", "--inference_tp_size", "2")
    line = _error_line(_argv(tiny, *he, "--gpus_per_node", "3", "--num_nodes", "2"), capsys)
    assert line == ("error: --inference_tp_size 2: ranks 2-3 span nodes 0 and 1 (3 GPUs per node); a tensor-parallel "
                    "group must sit within one node (its all-reduces run every layer): give each node a multiple of "
                    "2 ranks")
    assert plan(build_parser().parse_args(_argv(tiny, *he, "--gpus_per_node", "4", "--num_nodes", "2")))["phases"]


def test_the_search_offers_no_tensor_parallel_degree_that_spans_nodes(tmp_path):
    # 2 nodes of 2 GPUs: --inference_tp_size 4 divides the world size (4) but every group spans both
    # nodes. OPT-1.3B with the Hybrid Engine's copy kept, on GPUs where --inference_tp_size 2 just fits.
    (tmp_path / "config.json").write_text(json.dumps(OPT_1_3B))
    argv = _argv(tmp_path, "--enable_hybrid_engine", "--actor_zero_stage", "3", "--critic_zero_stage", "3",
                 "--gpus_per_node", "2", "--num_nodes", "2", "--per_device_generation_batch_size", "32",
                 "--per_device_training_batch_size", "1", "--max_prompt_seq_len", "512", "--max_answer_seq_len", "512")
    parser = build_parser()
    args = parser.parse_args(argv)
    gpu_bytes = int(plan(parser.parse_args([*argv, "--inference_tp_size", "2"]))["peak_bytes_per_gpu"] / 0.9) + 1
    assert not plan(args, gpu_bytes=gpu_bytes)["fits"]
    found = suggestions(argv, args, parser, limit=1000, gpu_bytes=gpu_bytes)
    degrees = {s["flags"][s["flags"].index("--inference_tp_size") + 1]
               for s in found if "--inference_tp_size" in s["flags"]}
    assert degrees == {"2"}


def test_no_suggestion_adds_a_generation_change_that_changes_nothing(tmp_path):
    # docs/memory-plan.md's OPT-13B command: at --actor_zero_stage 3 under "auto" the actor is not
    # gathered for generation, so the Hybrid Engine does not decode and --release_inference_cache
    # changes nothing; it was listed after --actor_zero_stage 3 with the same 73.37 GB.
    for name, (hidden, layers, heads, ffn, proj) in {"13b": (5120, 40, 40, 20480, 5120),
                                                     "350m": (1024, 24, 16, 4096, 512)}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({
            **OPT_1_3B, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "ffn_dim": ffn, "word_embed_proj_dim": proj, "do_layer_norm_before": name != "350m"}))
    argv = ["--actor_model_name_or_path", str(tmp_path / "13b"), "--critic_model_name_or_path", str(tmp_path / "350m"),
            "--actor_zero_stage", "0", "--critic_zero_stage", "0", "--actor_lora_dim", "128", "--only_optimize_lora",
            "--actor_gradient_checkpointing", "--per_device_generation_batch_size", "8",
            "--per_device_training_batch_size", "8", "--max_prompt_seq_len", "256", "--max_answer_seq_len", "256",
            "--enable_hybrid_engine", "--gpu_memory", "80GiB", "--gpus_per_node", "1"]
    parser = build_parser()
    args = parser.parse_args(argv)
    found = [s["flags"] for s in suggestions(argv, args, parser, limit=1000)]
    assert found[0] == ["--actor_zero_stage", "3"]
    assert ["--actor_zero_stage", "3", "--release_inference_cache"] not in found
    generation = ("--release_inference_cache", "--inference_tp_size", "--zero3_gather_for_generation")
    for flags in found:
        at = next((i for i, f in enumerate(flags) if f in generation), None)
        if at is not None:  # the generation change, the last flags: without it the plan differs
            with_it, without = (plan(parser.parse_args([*argv, *f])) for f in (flags, flags[:at]))
            assert with_it["phases"] != without["phases"], flags
