"""Steps 1 and 2 planned: the model-state bytes of the one trained engine equal the live engine's, to
the byte (built by the step scripts' own ``build_model`` and DeepSpeed config, fp32 on the CPU, one
rank); the phases and the command line.
"""
from __future__ import annotations

import json

import pytest

from dschat.plan.cli import build_parser, main, plan
from dschat.plan.training_steps import plan_step_engine

from helpers.steps import base_argv, load_script

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = {
    "step1-opt-zero0": (1, "tiny-opt", ("--zero_stage", "0")),
    "step1-llama-zero3-lora": (1, "tiny-llama", ("--zero_stage", "3", "--lora_dim", "4", "--lora_module_name",
                                                 "layers.")),
    "step1-opt-zero2-offload-lora-only": (1, "tiny-opt", ("--zero_stage", "2", "--offload", "--lora_dim", "4",
                                                           "--lora_module_name", "decoder.layers.",
                                                           "--only_optimize_lora")),
    "step2-opt-zero1-freeze": (2, "tiny-opt", ("--zero_stage", "1", "--freeze_layers", "1")),
    "step2-llama-zero2-lora-only-freeze": (2, "tiny-llama", ("--zero_stage", "2", "--lora_dim", "4",
                                                             "--lora_module_name", "layers.", "--only_optimize_lora",
                                                             "--freeze_layers", "1")),
    "step2-llama-zero3": (2, "tiny-llama", ("--zero_stage", "3")),
}
SCRIPTS = {1: "step1", 2: "step2"}


def _live(step: int, args) -> dict[str, int]:
    """The step's engine built as its main builds it, counted (tests/plan/engine_bytes.py)."""
    import engine_bytes  # noqa: PLC0415 - the counting script beside this file
    import torch

    from dschat.models.tokenizer import load_hf_tokenizer
    from dschat.runtime.dist import init_distributed
    from dschat.training.engine_setup import initialize_engine, optim_settings, step_ds_config

    init_distributed()
    script = load_script(SCRIPTS[step])
    tokenizer = load_hf_tokenizer(args.model_name_or_path)
    ds_config = step_ds_config(args, dtype="fp32", world_size=1)
    torch.manual_seed(0)
    engine = initialize_engine(script.build_model(args, tokenizer, ds_config, 0), ds_config, optim_settings(args, 10))
    return engine_bytes.count(engine, True, engine_bytes._actor_step if step == 1 else engine_bytes._critic_step)


@pytest.mark.parametrize("case", sorted(CASES))
def test_model_state_bytes_are_exact(case, tmp_path):
    step, model, extra = CASES[case]
    args = build_parser(step).parse_args(base_argv(model, tmp_path, *extra))
    planned = plan_step_engine(args, 1, step=step, dtype="fp32", cpu_accelerator=True).state.counted()
    live = _live(step, args)
    assert planned == {k: live[k] for k in planned}


def test_freezing_and_lora_only_leave_their_parameters_untrained(tmp_path):
    """Step 2 with --freeze_layers 1 and LoRA only: the value head trains, the frozen block's LoRA
    factors do not, the higher block's do."""
    args = build_parser(2).parse_args(base_argv("tiny-llama", tmp_path, "--lora_dim", "4", "--lora_module_name",
                                                "layers.", "--only_optimize_lora", "--freeze_layers", "1"))
    trained = {p.name for p in plan_step_engine(args, 1, step=2, dtype="fp32").inventory.trainable}
    assert "v_head.weight" in trained
    assert not any(".layers.0." in name for name in trained)
    assert any(".layers.1." in name and "lora_" in name for name in trained)
    assert all("lora_" in name or name == "v_head.weight" for name in trained)


def test_a_lora_filter_matching_a_tied_lm_head_is_refused_as_the_step_refuses_it(tmp_path):
    """Tiny OPT ties its lm_head to the embeddings: steps 1 and 3 refuse LoRA on it, and so does the
    plan (it planned an actor with nothing to train and said it fits)."""
    from dschat.errors import UserError

    args = build_parser(1).parse_args(base_argv("tiny-opt", tmp_path, "--lora_dim", "4", "--lora_module_name",
                                                "lm_head", "--only_optimize_lora"))
    with pytest.raises(UserError, match=r"matches lm_head, whose weight is tied to model.decoder.embed_tokens"):
        plan(args)


def test_step2_plans_chosen_and_rejected_rows(tmp_path):
    """Step 2's activations are those of twice the batch (each pair's two rows); step 1 has logits."""
    one = plan(build_parser(1).parse_args(base_argv("tiny-opt", tmp_path, "--gpu_memory", "1GB")))
    two = plan(build_parser(2).parse_args(base_argv("tiny-opt", tmp_path, "--gpu_memory", "1GB")))
    act = {r["step"]: {c["consumer"]: c["bytes"] for c in r["phases"][0]["top"]} for r in (one, two)}
    assert "logits" in act[1] and "logits" not in act[2]
    assert act[2]["reward activations"] == 2 * act[1]["actor activations"]  # same body, twice the rows


def test_gradient_checkpointing_and_the_gpus_per_node_change_what_they_should(tmp_path):
    """--gradient_checkpointing keeps one (batch, seq, hidden) per layer plus one layer's activations; the
    host memory at load is every rank's (each reads the model whole in fp32), the GPU's peak one rank's."""
    def planned(*extra):
        return plan(build_parser(1).parse_args(base_argv("tiny-opt", tmp_path, "--gpu_memory", "1GB", *extra)))

    def activations(result):
        return result["phases"][0]["consumers"]["actor activations"]

    full, checkpointed = planned(), planned("--gradient_checkpointing")
    layers = 2
    one_layer = activations(full) // layers
    hidden_rows = activations(checkpointed) - one_layer
    assert activations(full) == layers * one_layer and hidden_rows > 0 and hidden_rows % layers == 0
    assert activations(checkpointed) < activations(full)
    one_gpu = planned("--gpus_per_node", "1")
    two_gpus = planned("--gpus_per_node", "2")
    assert two_gpus["host_bytes_at_load"] == 2 * one_gpu["host_bytes_at_load"] > 0


def test_the_command_plans_step_1_and_suggests_what_fits(tmp_path, capsys):
    argv = ["--step", "1", *base_argv("tiny-opt", tmp_path, "--max_seq_len", "512", "--per_device_train_batch_size",
                                      "32"), "--gpu_memory", "1GB", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["step"] == 1 and not result["fits"]
    assert [p["name"] for p in result["phases"]] == ["training", "optimizer step"]
    assert result["suggestions"], "a smaller batch fits a tiny model"
    first = result["suggestions"][0]["flags"]
    assert set(first) & {"--gradient_checkpointing", "--per_device_train_batch_size"}
    # The suggestion, applied, fits.
    again = plan(build_parser(1).parse_args([*argv[2:-1], *first]))
    assert again["fits"]


def test_steps_refuse_another_step_s_flags(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--step", "1", *base_argv("tiny-opt", tmp_path), "--actor_zero_stage", "3"])
    assert stop.value.code == 2
    assert "unrecognized arguments: --actor_zero_stage 3" in capsys.readouterr().err
