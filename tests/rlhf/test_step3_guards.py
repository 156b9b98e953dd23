"""Step-3 start-up guards: batch arithmetic, the on-policy rule, contradictory flags (pure, fast),
the CLI's one-line exit-2 errors (subprocesses), and the folders the run saves into, checked before
anything loads (in-process)."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dschat.errors import UserError
from dschat.rlhf.config import BatchPlan, num_total_iters, plan_batches
from dschat.rlhf.ppo_loop import batches_per_epoch
from dschat.rlhf.guards import validate_step3_args

from helpers import REPO
from helpers.step3 import STEP3_MAIN, base_argv, refused_in_process, step3_main, subprocess_env


def _args(**overrides):
    """Step-3 defaults from the real parser, with overrides."""
    argv = ["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c"]
    args = step3_main().parse_args(argv)
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


# ------------------------------------------------------------------------------------ batch plan


@pytest.mark.parametrize(
    "gen_bs, gen_batches, train_bs, epochs, ga, micro, on_policy",
    [
        (16, 1, 16, 1, 1, 1, True),  # upstream's recommended setting
        (4, 1, 2, 1, 2, 2, True),  # 2 micro-batches, both accumulated into one step
        (4, 1, 2, 1, 1, 2, False),  # step after the first half of the rollout
        (4, 2, 4, 1, 2, 2, True),  # two generation batches, one step
        (4, 2, 4, 1, 1, 2, False),
        (4, 1, 4, 2, 1, 1, False),  # second PPO epoch runs after a step
        (4, 1, 4, 2, 2, 1, True),
        (4, 1, 4, 1, 3, 1, True),  # a step spans three rollouts: still on-policy
        (8, 1, 2, 1, 2, 4, False),
    ],
)
def test_plan_on_policy_rule(gen_bs, gen_batches, train_bs, epochs, ga, micro, on_policy):
    args = SimpleNamespace(per_device_generation_batch_size=gen_bs, generation_batches=gen_batches,
                           per_device_training_batch_size=train_bs, ppo_epochs=epochs,
                           gradient_accumulation_steps=ga)
    plan = plan_batches(args, world_size=1)
    assert plan.micro_batches_per_rollout == micro
    assert plan.on_policy is on_policy
    # on-policy <=> GA is a multiple of (micro-batches per rollout x ppo epochs)
    assert plan.on_policy == (ga % (micro * epochs) == 0)
    assert ("on-policy" if on_policy else "OFF-POLICY") in plan.describe()


def test_the_off_policy_warning_names_the_ratios_clip_range_with_clip_higher():
    args = SimpleNamespace(per_device_generation_batch_size=4, generation_batches=1,
                           per_device_training_batch_size=2, ppo_epochs=1, gradient_accumulation_steps=1)
    plan = plan_batches(args, world_size=1)
    assert "gradient_accumulation_steps=1 is not a multiple of 2 micro-batches" in plan.off_policy_warning(0.2)
    assert "clipped to [0.8, 1.2];" in plan.off_policy_warning(0.2)
    assert "clipped to [0.8, 1.28];" in plan.off_policy_warning(0.2, 0.28)  # --cliprange_high 0.28 (DAPO)
    assert "clipped to [0.9997, 1.0004];" in plan.off_policy_warning(3e-4, 4e-4)  # GSPO's, per answer


def test_plan_line_counts_prompts_and_answers():
    """With --num_generations K a generation batch of N rows holds N / K prompts."""
    args = SimpleNamespace(per_device_generation_batch_size=4, generation_batches=2,
                           per_device_training_batch_size=4, ppo_epochs=1, gradient_accumulation_steps=2)
    plan = plan_batches(args, world_size=1)
    assert plan.describe().startswith("PPO batch plan (per rank): rollout = 4 prompts x 2 generation batches = 8 rows")
    assert plan.describe(2).startswith(
        "PPO batch plan (per rank): rollout = 2 prompts x 2 answers x 2 generation batches = 8 rows")


def test_plan_refuses_a_rollout_that_does_not_split():
    args = SimpleNamespace(per_device_generation_batch_size=6, generation_batches=1,
                           per_device_training_batch_size=4, ppo_epochs=1, gradient_accumulation_steps=1)
    with pytest.raises(UserError, match="does not split into micro-batches"):
        plan_batches(args, world_size=1)
    # Two generation batches make 12 rows, but MiniDataset splits each generation batch on its own
    # (as upstream): 4 + 2 and 4 + 2, i.e. 4 micro-batches with two short ones, not 3. Refused too.
    from dschat.utils.data.data_utils import MiniDataset

    mini = MiniDataset(2, 4)
    mini.add(torch.zeros(6, 1))
    assert [len(b) for b in mini.add(torch.zeros(6, 1))] == [4, 2, 4, 2]
    args.generation_batches = 2
    with pytest.raises(UserError, match="does not split into micro-batches"):
        plan_batches(args, world_size=1)
    args.per_device_training_batch_size = 3  # 6 = 2 x 3: fine, 2 micro-batches per generation batch
    assert plan_batches(args, world_size=1).micro_batches_per_rollout == 4


def test_plan_ptx_doubles_actor_accumulation_and_step_normalisation_rule():
    args = SimpleNamespace(per_device_generation_batch_size=4, generation_batches=1,
                           per_device_training_batch_size=2, ppo_epochs=1, gradient_accumulation_steps=2)
    plan = plan_batches(args, world_size=2, ptx=True)
    assert plan.gradient_accumulation_steps_actor == 4
    assert plan.step_normalizable and plan.on_policy
    assert not BatchPlan(4, 1, 2, 1, 3, 3, 1, False).step_normalizable  # a step straddles rollouts


def test_num_total_iters_upstream_formula():
    plan = BatchPlan(16, 1, 8, 2, 4, 4, 1, False)
    # 100 batches x (16/8) x 2 epochs / GA 4 = 100 optimizer steps, per train epoch
    assert num_total_iters(plan, 100, 1) == 100
    assert num_total_iters(plan, batches_per_epoch(range(100), range(50)), 2) == 100  # ptx shorter: min x 2 epochs
    assert batches_per_epoch(range(30), range(50)) == 30 and batches_per_epoch(range(30), None) == 30
    assert num_total_iters(BatchPlan(4, 1, 4, 1, 8, 8, 1, False), 3, 1) == 1  # rounded up, >= 1


# ------------------------------------------------------------------------------------ flags


@pytest.mark.parametrize(
    "overrides, accelerator, message",
    [
        ({"inference_tp_size": 2}, "cuda", "needs --actor_zero_stage 3"),
        ({"actor_zero_stage": 4}, "cpu", "must be 0, 1, 2 or 3"),
        ({"actor_zero_stage": 2, "critic_zero_stage": 2, "enable_hybrid_engine": True, "offload": True},
         "cuda", "unsupported due to training instability"),
        ({"enable_mixed_precision_lora": True}, "cuda", "needs actor LoRA and ZeRO-3"),
        ({"enable_mixed_precision_lora": True, "actor_lora_dim": 8, "actor_zero_stage": 3}, "cpu",
         "CUDA quantisation kernels"),
        ({"only_optimize_lora": True}, "cpu", "needs --actor_lora_dim"),
        ({"temperature": 0.0}, "cpu", "--temperature must be > 0"),
        ({"top_p": 0.0}, "cpu", "--top_p"),
        ({"max_prompt_seq_len": 1}, "cpu", "--max_prompt_seq_len must be >= 2"),
        ({"deepspeed_config": "ds.json"}, "cpu", "--deepspeed_config is not used"),
        ({"max_answer_seq_len": 1}, "cpu", "^--max_answer_seq_len must be >= 2 .*would never train"),
        ({"algorithm": "grpo", "lam": 0.9}, "cpu", "^--lam is GAE's lambda.*; --algorithm grpo has no critic: drop"),
        ({"algorithm": "rloo", "cliprange_value": 0.5}, "cpu", "^--cliprange_value clips .*rloo has no critic"),
        ({"algorithm": "remax", "gamma": 0.99}, "cpu", "^--gamma discounts .*remax gives each answer one advantage"),
    ],
)
def test_contradictory_flags_are_refused(overrides, accelerator, message):
    with pytest.raises(UserError, match=message):
        validate_step3_args(_args(**overrides), accelerator=accelerator, dtype="fp32")


@pytest.mark.parametrize("flag, value, rule", [
    ("clip_reward_value", -5.0, "a number > 0"),  # would clamp every score to -5
    ("clip_reward_value", float("nan"), "a number > 0"),
    ("cliprange", -0.2, "a finite number > 0"),  # would stop every positive-advantage token learning
    ("cliprange", 0.0, "a finite number > 0"),
    ("cliprange_value", -1.0, "a finite number > 0"),
    ("kl_ctl", float("nan"), "a finite number >= 0"),
    ("kl_ctl", -0.1, "a finite number >= 0"),
    ("gamma", 1.5, "in \\[0, 1\\]"),
    ("lam", 1.5, "in \\[0, 1\\]"),
    ("lam", -0.1, "in \\[0, 1\\]"),
    ("missing_eos_penalty", -1.0, "a finite number >= 0"),
    ("unsup_coef", float("inf"), "a finite number >= 0"),
])
def test_ppo_numbers_out_of_range_are_one_line(flag, value, rule):
    with pytest.raises(UserError, match=f"^--{flag} must be {rule}.*, got {value}$"):
        validate_step3_args(_args(**{flag: value}), accelerator="cpu", dtype="fp32")


@pytest.mark.parametrize("value", [0, -1])
def test_preprocessing_workers_are_a_positive_count_or_unset(value):
    with pytest.raises(UserError, match=f"^--preprocessing_num_workers must be a positive integer, got {value}$"):
        validate_step3_args(_args(preprocessing_num_workers=value), accelerator="cpu", dtype="fp32")
    ptx = _args(preprocessing_num_workers=4, unsupervised_dataset_name="dschat/builtin")
    assert validate_step3_args(ptx, accelerator="cpu", dtype="fp32") == []


@pytest.mark.parametrize("value", [1e-300, 1e-7, float("inf")])
def test_a_temperature_that_overflows_the_logits_or_is_infinite_is_one_line(value):
    """logits / 1e-300 are inf and the sampler's probabilities nan: a traceback at the first rollout."""
    with pytest.raises(UserError, match=rf"^--temperature must be > 0 for --decoding sample: a finite number of at "
                                        rf"least 1e-06 \(below: --decoding greedy\), got {value}$"):
        validate_step3_args(_args(temperature=value), accelerator="cpu", dtype="fp32")
    assert validate_step3_args(_args(temperature=1e-6), accelerator="cpu", dtype="fp32") == []
    # fp16 (the scoring passes divide half-precision logits; its largest number is 65504): 1e-2 at least.
    with pytest.raises(UserError, match=r"at least 0.01 in fp16 \(below: --decoding greedy\), got 0.001$"):
        validate_step3_args(_args(temperature=1e-3), accelerator="cuda", dtype="fp16")
    assert validate_step3_args(_args(temperature=1e-2), accelerator="cuda", dtype="fp16") == []


def test_flags_that_do_nothing_in_this_run_are_said_and_a_bad_gather_partition_is_refused():
    said = validate_step3_args(_args(decoding="greedy", temperature=0.5, top_k=7), accelerator="cpu", dtype="fp32")
    assert said == ["--decoding greedy takes each most likely token: --temperature, --top_k not used"]
    said = validate_step3_args(_args(unsup_coef=5.0, unsupervised_dataset_config_name="wikitext-2-raw-v1"),
                               accelerator="cpu", dtype="fp32")
    assert said == ["--unsup_coef, --unsupervised_dataset_config_name not used: PPO-ptx needs "
                    "--unsupervised_dataset_name"]
    assert validate_step3_args(_args(unsupervised_dataset_name="dschat/builtin", unsup_coef=5.0),
                               accelerator="cpu", dtype="fp32") == []
    for value in (0, -3):
        with pytest.raises(UserError, match=f"^--tp_gather_partition_size must be a positive integer, got {value}$"):
            validate_step3_args(_args(tp_gather_partition_size=value), accelerator="cpu", dtype="fp32")
    # Read only by DeepSpeed's Hybrid Engine (never built under transformers 5): it did nothing, silently.
    [said] = validate_step3_args(_args(unpin_actor_parameters=True), accelerator="cpu", dtype="fp32")
    assert said.startswith("--unpin_actor_parameters not used: only DeepSpeed's Hybrid Engine reads it")
    assert validate_step3_args(_args(tp_gather_partition_size=4), accelerator="cpu", dtype="fp32") == [
        "--tp_gather_partition_size not used: it sizes the tensor-parallel Hybrid Engine's gathers "
        "(--inference_tp_size > 1)"]
    assert validate_step3_args(_args(tp_gather_partition_size=4, inference_tp_size=2, actor_zero_stage=3,
                                     enable_hybrid_engine=True), accelerator="cpu", dtype="fp32") == []


def test_gamma_applies_to_reinforce_pp_and_gae_flags_to_ppo():
    assert validate_step3_args(_args(algorithm="reinforce_pp", gamma=0.99), accelerator="cpu", dtype="fp32") == []
    assert validate_step3_args(_args(lam=0.9, gamma=0.99, cliprange_value=0.5), accelerator="cpu", dtype="fp32") == []


def test_ppo_numbers_at_their_edges_pass():
    edges = {"kl_ctl": 0.0, "gamma": 0.0, "lam": 1.0, "missing_eos_penalty": 0.0, "unsup_coef": 0.0,
             "clip_reward_value": float("inf"), "cliprange": 1.0, "unsupervised_dataset_name": "dschat/builtin"}
    assert validate_step3_args(_args(**edges), accelerator="cpu", dtype="fp32") == []


@pytest.mark.parametrize("beta, smoothing, message", [
    (0.0, 0.0, "--beta must be a finite number > 0"),
    (float("nan"), 0.0, "--beta must be a finite number > 0"),
    (0.1, 0.5, r"--label_smoothing must be in \[0, 0.5\)"),  # from 0.5 on it prefers the rejected answers
    (0.1, -0.1, r"--label_smoothing must be in \[0, 0.5\)"),
])
def test_dpo_numbers_out_of_range_are_one_line(beta, smoothing, message):
    from dschat.training.dpo import check_dpo_args

    check_dpo_args(0.1, 0.0)
    check_dpo_args(0.5, 0.49)
    with pytest.raises(UserError, match=message):
        check_dpo_args(beta, smoothing)


def test_valid_flag_combinations_pass_and_align_overflow_warns_outside_fp16():
    assert validate_step3_args(_args(), accelerator="cpu", dtype="fp32") == []
    assert validate_step3_args(_args(inference_tp_size=2, actor_zero_stage=3), accelerator="cuda", dtype="fp16") == []
    warnings = validate_step3_args(_args(align_overflow=True), accelerator="cpu", dtype="fp32")
    assert len(warnings) == 1 and "no effect" in warnings[0]
    assert validate_step3_args(_args(align_overflow=True), accelerator="cuda", dtype="fp16") == []


def test_seed_default_is_reproducible():
    assert _args().seed == 1234  # upstream's None was not reproducible


# ------------------------------------------------------------------------------------ CLI


def _run_cli(argv, cwd):
    return subprocess.run([sys.executable, str(STEP3_MAIN), *argv], cwd=cwd, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_cli_errors_are_one_line_exit_2_and_write_nothing(tmp_path, critic_dirs, data_cache):
    out = tmp_path / "out"
    common = ["--actor_model_name_or_path", "tiny-opt", "--data_path", "dschat/builtin",
              "--data_output_path", str(data_cache), "--output_dir", str(out)]
    cases = [
        # Critic path is a plain model folder, not a step-2 output.
        (["--critic_model_name_or_path", str(critic_dirs["tiny-opt"].parent / "nope")], "does not exist"),
        (["--critic_model_name_or_path", "tiny-opt"], "is not a step-2 reward model output"),
        # A generation batch of 6 rows cannot split into micro-batches of 4.
        (["--critic_model_name_or_path", str(critic_dirs["tiny-opt"]), "--per_device_generation_batch_size", "6",
          "--per_device_training_batch_size", "4"], "does not split into micro-batches"),
        (["--critic_model_name_or_path", str(critic_dirs["tiny-opt"]), "--inference_tp_size", "2"],
         "needs --actor_zero_stage 3"),
        (["--critic_model_name_or_path", str(critic_dirs["tiny-opt"]), "--inference_tp_size", "2",
          "--actor_zero_stage", "3", "--enable_hybrid_engine"], "does not divide the world size 1"),
    ]
    for extra, message in cases:
        proc = _run_cli(common + extra, tmp_path)
        assert proc.returncode == 2, proc.stderr[-2000:]
        error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(error_lines) == 1 and message in error_lines[0], proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
        assert not out.exists()


@pytest.mark.parametrize("folder, extra", [("critic", []), ("actor", []), ("actor_ema", ["--enable_ema"])])
def test_a_file_where_the_run_saves_a_model_is_refused_before_anything_loads(folder, extra, tmp_path, critic_dirs,
                                                                            data_cache, capsys, monkeypatch):
    from dschat.training import run_setup

    out = tmp_path / "out"
    out.mkdir()
    (out / folder).write_text("the user's notes\n")
    monkeypatch.setattr(run_setup, "setup_run", lambda *a, **k: pytest.fail("got past the path checks"))
    argv = base_argv("tiny-opt", critic_dirs["tiny-opt"], data_cache, "--output_dir", str(out), *extra)
    line = refused_in_process(argv, capsys)
    assert f"{out / folder} is a file" in line and "move the file away or give another --output_dir" in line
    assert (out / folder).read_text() == "the user's notes\n"


def test_a_model_folder_the_run_cannot_write_is_refused(tmp_path, critic_dirs, data_cache, capsys, monkeypatch):
    from dschat.runtime import fs
    from dschat.training import run_setup

    out = tmp_path / "out"
    (out / "critic").mkdir(parents=True)
    monkeypatch.setattr(run_setup, "setup_run", lambda *a, **k: pytest.fail("got past the path checks"))
    access = os.access  # permission bits do not stop root: the check's own question answered "no" here
    monkeypatch.setattr(fs.os, "access", lambda path, mode: Path(path) != out / "critic" and access(path, mode))
    line = refused_in_process(base_argv("tiny-opt", critic_dirs["tiny-opt"], data_cache, "--output_dir", str(out)),
                              capsys)
    assert f"the folder for the critic {out / 'critic'} cannot be written" in line


def test_a_rollout_of_more_generation_batches_than_the_run_has_is_refused(tmp_path, critic_dirs, data_cache, capsys):
    """It never completed a rollout: no PPO step, exit 0, and the untouched models saved as trained."""
    argv = base_argv("tiny-opt", critic_dirs["tiny-opt"], data_cache, "--output_dir", str(tmp_path / "out"),
                     "--generation_batches", "1000")
    line = refused_in_process(argv, capsys)
    assert ("--generation_batches 1000 makes a rollout of more generation batches than the run has (" in line
            and "x --num_train_epochs 1), so it would never train" in line), line
    assert not (tmp_path / "out" / "actor").exists()


# ------------------------------------------------------------------------------------ DeepSpeed configs


@pytest.mark.parametrize("actor_stage, critic_stage", [(0, 0), (2, 3), (3, 0), (3, 3)])
def test_engine_configs_follow_upstream_stage_rules(actor_stage, critic_stage):
    from dschat.rlhf.config import zero_config
    from dschat.rlhf.rlhf_engine import ds_config_for

    args = _args(actor_zero_stage=actor_stage, critic_zero_stage=critic_stage, per_device_training_batch_size=4,
                 gradient_accumulation_steps=3, offload=True, offload_reference_model=True,
                 unsupervised_dataset_name="dschat/builtin", max_prompt_seq_len=64, max_answer_seq_len=32)
    cfg = {role: ds_config_for(role, zero_config(args), dtype="bf16", hybrid_engine=True, world_size=2)
           for role in ("actor", "ref", "ema", "critic", "reward")}
    stage = {role: c["zero_optimization"]["stage"] for role, c in cfg.items()}
    assert stage == {"actor": actor_stage, "ref": 3 if actor_stage == 3 else 0, "ema": 3 if actor_stage == 3 else 0,
                     "critic": critic_stage, "reward": 3 if critic_stage == 3 else 0}
    # PPO-ptx doubles the actor's (and its clones') accumulation: 4 x 2 ranks x (3 x 2).
    assert [cfg[r]["train_batch_size"] for r in ("actor", "ref", "ema", "critic", "reward")] == [48, 48, 48, 24, 24]
    assert all(c["train_micro_batch_size_per_gpu"] == 4 and "bfloat16" in c for c in cfg.values())
    offload = {role: c["zero_optimization"]["offload_param"]["device"] for role, c in cfg.items()}
    assert offload == {"actor": "cpu", "ref": "cpu", "ema": "cpu", "critic": "cpu", "reward": "none"}
    assert cfg["actor"]["hybrid_engine"]["enabled"] and cfg["actor"]["hybrid_engine"]["max_out_tokens"] == 96
    assert not cfg["critic"]["hybrid_engine"]["enabled"] and "hybrid_engine" not in cfg["ref"]
    assert cfg["actor"]["tensorboard"]["job_name"] == "step3_actor_tensorboard"


# ------------------------------------------------------------------------------------ upstream-style args


def _dschat_only_flags() -> set[str]:
    """Step-3 flags dschat added (their help says so): an upstream main.py does not define them."""
    import argparse

    from dschat.cli import shared, step3

    parser = argparse.ArgumentParser(add_help=False)
    for add in (step3.add_step3_model_args, step3.add_step3_training_args, step3.add_ppo_args,
                step3.add_step3_lora_args, step3.add_step3_deepspeed_args, step3.add_step3_logging_args,
                shared.add_checkpoint_args):
        add(parser)
    return {a.dest for a in parser._actions if (a.help or "").startswith("(dschat")}


def test_engine_and_trainer_read_dschat_flags_only_through_the_config():
    # DeepSpeedRLHFEngine and DeepSpeedPPOTrainer get the Namespace of whoever calls them; one built
    # by an upstream-style main.py lacks dschat's flags, so a plain `args.<dschat flag>` would raise
    # AttributeError (after all five models loaded).
    import ast

    def is_args(node):  # `args`, `self.args`, `engine.args`, ...
        return ((isinstance(node, ast.Name) and node.id == "args")
                or (isinstance(node, ast.Attribute) and node.attr == "args"))

    def flags_read(tree):
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and is_args(node.value):
                yield node.attr
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) >= 2 and is_args(node.args[0]) and isinstance(node.args[1], ast.Constant)):
                yield node.args[1].value

    dschat_only = _dschat_only_flags()
    assert {"kl_ctl", "decoding", "generation_loop", "max_nonfinite_steps"} <= dschat_only
    probe = ("args.kl_ctl; self.args.decoding; self.engine.args.generation_loop;"
             " getattr(self.args, 'max_nonfinite_steps', 1)")
    assert set(flags_read(ast.parse(probe))) == {"kl_ctl", "decoding", "generation_loop", "max_nonfinite_steps"}
    for rel in ("dschat/rlhf/rlhf_engine.py", "dschat/rlhf/ppo_trainer.py", "dschat/rlhf/rollout/generator.py"):
        read = set(flags_read(ast.parse((REPO / rel).read_text())))
        assert not read & dschat_only, (rel, sorted(read & dschat_only))


def test_an_upstream_style_namespace_gets_dschats_flags_at_their_defaults_once():
    from dschat.cli.step3 import complete_step3_args
    from dschat.rlhf.config import step3_config

    upstream_style = SimpleNamespace(actor_zero_stage=3, kl_ctl=0.5)
    completed = complete_step3_args(upstream_style)
    assert completed.actor_zero_stage == 3 and completed.kl_ctl == 0.5
    assert completed.decoding == "sample" and completed.max_nonfinite_steps == 10 and completed.algorithm == "ppo"
    assert not hasattr(upstream_style, "decoding")  # the caller's object stays as it was
    full = _args()
    assert complete_step3_args(full) is full
    # Upstream's flags only: every part of the config is what the full parser's defaults give.
    upstream_only = argparse.Namespace(**{k: v for k, v in vars(full).items() if k not in _dschat_only_flags()})
    assert not hasattr(upstream_only, "kl_ctl")
    assert step3_config(upstream_only, world_size=2) == step3_config(full, world_size=2)


def test_upstream_debug_helpers(capsys):
    # A 2-parameter model: weights [3, 4] and bias [12] -> L2 norm sqrt(9 + 16 + 144) = 13.
    from dschat.rlhf.ppo_trainer import DeepSpeedPPOTrainer, get_model_norm, print_all_ranks

    layer = torch.nn.Linear(2, 1)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[3.0, 4.0]]))
        layer.bias.fill_(12.0)
    assert get_model_norm(layer) == pytest.approx(13.0)
    print_all_ranks("tag", 13.0, 0)
    assert capsys.readouterr().out.strip() == "tag [13.0]"
    assert callable(DeepSpeedPPOTrainer.dump_model_norms)
