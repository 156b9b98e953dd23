"""Numeric flags refused in one line before anything runs: learning rates and dropouts (steps 1-3),
the launchers' GPU and node counts, the planner's GPU memory, the memory preflight's flag errors,
rw_eval's ``--max_seq_len`` and the data generators' ``--out`` and row counts. The CLI-level cases
(exit 2, nothing written) are in tests/e2e/test_bad_input.py."""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys

import pytest

from dschat.cli.shared import add_step1_args
from dschat.errors import EXIT_USAGE, UserError, cli_main

from helpers import PYTHON, REPO
from helpers.steps import cli_env


def _step1_args(*argv: str) -> argparse.Namespace:
    return add_step1_args(argparse.ArgumentParser()).parse_args(
        ["--model_name_or_path", "tiny-llama", "--data_path", "dschat/builtin", *argv])


@pytest.mark.parametrize("flag, value", [("--learning_rate", "-1"), ("--learning_rate", "nan"),
                                         ("--learning_rate", "inf"), ("--lora_learning_rate", "-0.5"),
                                         ("--weight_decay", "nan"), ("--weight_decay", "-1")])
def test_step_learning_rates_are_finite_and_not_negative(flag, value):
    from dschat.training.run_setup import check_common_args

    with pytest.raises(UserError, match=f"^{flag} must be a finite number >= 0, got "):
        check_common_args(_step1_args(flag, value))
    check_common_args(_step1_args(flag, "0"))  # 0: upstream accepts any rate, a frozen run included


@pytest.mark.parametrize("value", ["-0.1", "1", "2", "nan"])
def test_step_dropout_is_a_probability_below_1(value):
    from dschat.training.run_setup import check_common_args

    with pytest.raises(UserError, match=r"^--dropout must be in \[0, 1\)"):
        check_common_args(_step1_args("--dropout", value))
    check_common_args(_step1_args("--dropout", "0"))


@pytest.mark.parametrize("flag, value, message", [
    ("--actor_lora_learning_rate", "-1", "--actor_lora_learning_rate must be a finite number >= 0"),
    ("--critic_lora_learning_rate", "nan", "--critic_lora_learning_rate must be a finite number >= 0"),
    ("--actor_learning_rate", "inf", "--actor_learning_rate must be a finite number >= 0"),
    ("--actor_weight_decay", "-0.1", "--actor_weight_decay must be a finite number >= 0"),
    ("--critic_weight_decay", "nan", "--critic_weight_decay must be a finite number >= 0"),
    ("--critic_dropout", "1", r"--critic_dropout must be in \[0, 1\)"),
])
def test_step3_learning_rates_and_dropouts(flag, value, message):
    from dschat.cli.step3 import add_step3_args
    from dschat.rlhf.guards import validate_step3_args

    args = add_step3_args(argparse.ArgumentParser()).parse_args(
        ["--actor_model_name_or_path", "tiny-opt", "--data_path", "dschat/builtin", flag, value])
    with pytest.raises(UserError, match=f"^{message}"):
        validate_step3_args(args, accelerator="cpu", dtype="fp32")


@pytest.mark.parametrize("flag, value", [("--num_gpus", "-2"), ("--num_gpus", "0"), ("--num_nodes", "0")])
def test_launch_refuses_fewer_than_one_gpu_or_node(flag, value, capsys):
    from dschat.launch import _entry

    assert _entry(["step1", "cpu/tiny", flag, value, "--dry-run"]) == EXIT_USAGE
    assert f"error: {flag} must be >= 1, got {value}" in capsys.readouterr().err


@pytest.mark.parametrize("memory", ["0", "0GB", "0.1B"])
def test_plan_refuses_a_gpu_without_memory(memory, capsys):
    from dschat.plan.cli import main

    assert main(["--step", "1", "--model_name_or_path", "tiny-llama", "--gpu_memory", memory]) == EXIT_USAGE
    assert f"error: --gpu_memory must be more than 0 bytes, got '{memory}'" in capsys.readouterr().err


def test_preflight_raises_flags_the_step_refuses_instead_of_a_note():
    """A flag error is the user's to fix (e2e stops before step 1), not a gap of the planner."""
    from dschat.plan.preflight import preflight

    notes: list[str] = []
    argv = ["--actor_model_name_or_path", "tiny-opt", "--critic_model_name_or_path", "tiny-opt",
            "--data_path", "dschat/builtin", "--algorithm", "grpo", "--num_generations", "0"]
    with pytest.raises(UserError, match="^--num_generations must be a positive integer, got 0"):
        preflight(argv, world=1, gpus_per_node=1, accelerator="cpu", gpu_bytes=10**10, echo=notes.append)
    assert notes == []


def _rw_eval():
    spec = importlib.util.spec_from_file_location(
        "dschat_rw_eval_flags", REPO / "training" / "step2_reward_model_finetuning" / "rw_eval.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_rw_eval_max_seq_len_fits_positions_the_model_computes():
    """A rotary model (tiny-llama, 512 positions) is not refused by the steps' position-table check;
    rw_eval pads every pair to --max_seq_len, so it refuses past the trained positions."""
    rw_eval = _rw_eval()
    with pytest.raises(UserError, match="^--max_seq_len 100000 is longer than the 512 positions tiny-llama"):
        rw_eval.check_max_seq_len("tiny-llama", 100000)
    rw_eval.check_max_seq_len("tiny-llama", 512)


@pytest.mark.parametrize("module", ["dschat.data.builtin", "dschat.data.wordgame"])
@pytest.mark.parametrize("out, rows, message", [
    ("{file}", (), "--out {file} exists and is not a folder"),
    ("{file}/x", (), "--out {file}/x cannot be created: {file} is a file"),
    ("{ws}/new", ("--train_rows", "-5"), "--train_rows must be >= 0 (a number of rows), got -5"),
    ("{ws}/new", ("--eval_rows", "-1"), "--eval_rows must be >= 0 (a number of rows), got -1"),
])
def test_data_generators_refuse_bad_out_and_row_counts(module, out, rows, message, tmp_path):
    """Run as ``python -m``: one line, exit 2, nothing written."""
    (tmp_path / "file.txt").write_text("a regular file\n")
    values = {"file": str(tmp_path / "file.txt"), "ws": str(tmp_path)}
    proc = subprocess.run([PYTHON, "-m", module, "--out", out.format(**values), *rows], cwd=tmp_path,
                          env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == EXIT_USAGE, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message.format(**values)}"), proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


def test_wordgame_refuses_more_games_than_numbers(tmp_path, capsys):
    from dschat.data import wordgame

    argv = ["--out", str(tmp_path / "out"), "--train_rows", "9000", "--eval_rows", "1"]
    assert cli_main(wordgame.main, argv) == EXIT_USAGE
    assert "--train_rows + --eval_rows must be at most 9000" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _step3_args(*argv: str) -> argparse.Namespace:
    from dschat.cli.step3 import add_step3_args

    return add_step3_args(argparse.ArgumentParser()).parse_args(
        ["--actor_model_name_or_path", "tiny-opt", "--data_path", "dschat/builtin", *argv])


def test_step3_flags_of_a_critic_apply_only_where_there_is_one():
    """A critic-free algorithm builds no critic: --offload needs no ZeRO stage of it, and
    --only_optimize_lora needs the actor's LoRA (the critic's adds no layer; the whole actor trained)."""
    from dschat.rlhf.guards import validate_step3_args

    grpo = ("--algorithm", "grpo", "--num_generations", "2", "--reward_fn", "dschat.rewards:gold")
    validate_step3_args(_step3_args(*grpo, "--offload", "--actor_zero_stage", "2"), accelerator="cpu", dtype="fp32")
    with pytest.raises(UserError, match=r"^--offload needs ZeRO"):
        validate_step3_args(_step3_args("--offload", "--actor_zero_stage", "2"), accelerator="cpu", dtype="fp32")
    with pytest.raises(UserError, match=r"^--only_optimize_lora needs --actor_lora_dim > 0: --algorithm grpo trains "
                                        r"no critic"):
        validate_step3_args(_step3_args(*grpo, "--critic_lora_dim", "4", "--only_optimize_lora"), accelerator="cpu",
                            dtype="fp32")
    validate_step3_args(_step3_args("--critic_lora_dim", "4", "--only_optimize_lora"), accelerator="cpu", dtype="fp32")
    with pytest.raises(UserError) as err:
        validate_step3_args(_step3_args(*grpo, "--only_optimize_lora"), accelerator="cpu", dtype="fp32")
    assert str(err.value) == ("--only_optimize_lora needs --actor_lora_dim > 0: --algorithm grpo trains no critic "
                              "(the whole actor would train)")


def test_step3_offload_reward_model_without_a_reward_model_is_refused(tmp_path, capsys):
    from helpers.step3 import refused_in_process

    argv = ["--actor_model_name_or_path", "tiny-opt", "--data_path", "dschat/builtin", "--algorithm", "grpo",
            "--num_generations", "2", "--reward_fn", "dschat.rewards:gold", "--offload_reward_model",
            "--output_dir", str(tmp_path / "out")]
    assert refused_in_process(argv, capsys) == (
        "error: --offload_reward_model: this run loads no reward model (its reward comes from --reward_fn, "
        "--reward_url or --env); drop the flag")
    assert not (tmp_path / "out").exists()
    # The same check for the planner and e2e (validate_step3_args), before the flag's ZeRO-3 rule; a
    # reward model weighted in beside the function is offloaded, and so is main's Python reward_fn counted.
    from dschat.rlhf.guards import validate_step3_args

    stage3 = ("--actor_zero_stage", "3", "--critic_zero_stage", "3")
    with pytest.raises(UserError, match="^--offload_reward_model: this run loads no reward model"):
        validate_step3_args(_step3_args(*argv[4:11]), accelerator="cpu", dtype="fp32")
    validate_step3_args(_step3_args(*argv[4:11], *stage3, "--reward_model_weight", "0.5"), accelerator="cpu",
                        dtype="fp32")
    with pytest.raises(UserError, match="^--offload_reward_model: this run loads no reward model"):
        validate_step3_args(_step3_args("--offload_reward_model", *stage3), accelerator="cpu", dtype="fp32",
                            python_reward_fn=True)


@pytest.mark.parametrize("flag, value", [("--max_turns", "3"), ("--env_timeout", "60")])
def test_step3_episode_flags_need_env(flag, value):
    """As e2e's --max-turns / --env-timeout: without --env they did nothing, silently."""
    from dschat.rlhf.guards import validate_step3_args

    with pytest.raises(UserError) as err:
        validate_step3_args(_step3_args(flag, value), accelerator="cpu", dtype="fp32")
    assert str(err.value) == (f"{flag} applies to multi-turn episodes only; add --env MODULE:FACTORY "
                              f"(docs/environments.md) or drop {flag}")
    validate_step3_args(_step3_args(flag, value, "--env", "dschat.envs_examples:calculator"), accelerator="cpu",
                        dtype="fp32")


@pytest.mark.parametrize("flag, value", [("--reward_url_weight", "2"), ("--reward_url_timeout", "5"),
                                         ("--reward_url_retries", "0")])
def test_step3_reward_url_flags_need_reward_url(flag, value):
    """They were accepted without --reward_url and did nothing, silently."""
    from dschat.rlhf.guards import validate_step3_args

    with pytest.raises(UserError) as err:
        validate_step3_args(_step3_args(flag, value), accelerator="cpu", dtype="fp32")
    assert str(err.value) == f"{flag} applies to a reward server only; add --reward_url URL or drop {flag}"
    validate_step3_args(_step3_args(flag, value, "--reward_url", "http://127.0.0.1:1/get_reward"), accelerator="cpu",
                        dtype="fp32")


def test_step3_a_reward_model_folder_the_run_would_not_load_is_refused():
    """With --reward_fn (--reward_url, --env, main's Python function) the reward model's weight defaults
    to 0 and it is not loaded: a --reward_model_name_or_path given beside it went unused, silently. Given
    the weight, it is used; for PPO without a critic folder it is how the critic starts from the actor."""
    from dschat.rlhf.guards import validate_step3_args

    def check(*argv, python_reward_fn=False):
        validate_step3_args(_step3_args(*argv), accelerator="cpu", dtype="fp32", python_reward_fn=python_reward_fn)

    rm, fn = ("--reward_model_name_or_path", "rm"), ("--reward_fn", "dschat.rewards:gold")
    grpo = ("--algorithm", "grpo", "--num_generations", "2")
    defaulted = "its --reward_model_weight defaults to 0 beside --reward_fn, --reward_url, --env or main's reward_fn"
    for argv, python, why in (((*grpo, *rm, *fn), False, defaulted),
                              ((*rm, *fn, "--critic_model_name_or_path", "c"), False, defaulted),
                              ((*grpo, *rm, "--reward_url", "http://127.0.0.1:1/get_reward"), False, defaulted),
                              ((*grpo, *rm), True, defaulted),
                              ((*grpo, *rm, *fn, "--reward_model_weight", "0"), False, "--reward_model_weight 0")):
        with pytest.raises(UserError) as err:
            check(*argv, python_reward_fn=python)
        assert str(err.value) == (
            f"--reward_model_name_or_path rm: this run loads no reward model ({why}); give a non-zero "
            "--reward_model_weight W to add its score, or drop --reward_model_name_or_path")
    check(*grpo, *rm, *fn, "--reward_model_weight", "0.5")
    check(*rm, *fn)  # PPO without --critic_model_name_or_path: the critic starts from the actor
    check(*grpo, *rm)
