"""e2e_rlhf.py: deployment types and aliases, model -> recipe mapping, output checks, OOM advice, and
the whole pipeline on tiny models (steps 1, 2, 3 and the report) through the real step scripts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import REPO
from helpers.step3 import step3_main
from helpers.steps import load_script

sys.path.insert(0, str(REPO))
import e2e_rlhf as E  # noqa: E402

from dschat.errors import UserError  # noqa: E402
from dschat.launch import LAUNCHER_ENV  # noqa: E402


@pytest.fixture(scope="module")
def config() -> E.E2EConfig:
    return E.load_e2e_config()


def _args(config: E.E2EConfig, *argv: str):
    args = E.parse_args(list(argv), config)
    return args


def _e2e(*argv: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, str(REPO / "e2e_rlhf.py"), *argv], env=full_env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def e2e_here(capsys):
    """``_e2e`` in this process, for a dry run or a run refused before any step starts (nothing is
    launched): the same exit code and output, without a fresh interpreter's seconds of imports."""
    def run(*argv: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        code = E._entry(list(argv))
        out = capsys.readouterr()
        return subprocess.CompletedProcess(["e2e_rlhf.py", *argv], code, out.out, out.err)
    return run


def test_deployment_types_and_aliases(config):
    assert config.deployment("single_gpu").name == "single_gpu"
    assert config.deployment("singlenode").name == "single_node"
    assert config.deployment("single_node").name == "single_node"
    assert config.deployment("multinode").name == "multi_node"
    assert config.deployment("multi-node").name == "multi_node"
    assert config.deployment("cpu").name == "cpu"
    with pytest.raises(UserError, match="unknown deployment type 'two_gpus'"):
        config.deployment("two_gpus")
    assert set(config.choices()) == {"single_gpu", "single_node", "singlenode", "multi_node", "multinode", "cpu"}


def test_upstream_sizes_map_to_upstream_recipes(config):
    expected = {
        ("single_gpu", 1, "1.3b"): "opt/single_gpu/1.3b", ("single_gpu", 1, "6.7b"): "opt/single_gpu/6.7b_lora",
        ("single_node", 1, "13b"): "opt/single_node/13b", ("multi_node", 3, "66b"): "opt/multi_node/66b",
        ("single_gpu", 2, "350m"): "opt/single_gpu/350m", ("multi_node", 2, "350m"): "opt/multi_node/350m",
        ("cpu", 1, "smollm2-135m"): "cpu/smollm2-135m", ("cpu", 3, "tiny-llama"): "cpu/tiny",
    }
    for (dep, step, model), rid in expected.items():
        assert E.choose_recipe(config.deployment(dep), step, model) == (rid, False)
    with pytest.raises(UserError, match="use --deployment-type multi_node"):
        E.choose_recipe(config.deployment("single_node"), 1, "66b")


def test_reward_model_choices_bug_is_fixed(config):
    # Upstream's choices=("350m") is a string: "35" or "0m" passed as if they were 350m.
    args = _args(config, "--reward-model", "facebook/opt-350m", "--deployment-type", "single_gpu")
    assert args.reward_model == "350m"
    assert E.choose_recipe(config.deployment("single_gpu"), 2, "350m") == ("opt/single_gpu/350m", False)
    assert E.choose_recipe(config.deployment("single_gpu"), 2, "35") == ("opt/single_gpu/350m", True)
    assert E.model_id("35") == "35" and E.model_id("125m") == "facebook/opt-125m"


def test_output_folders_and_step3_inputs_are_upstreams(config, tmp_path):
    with pytest.warns(UserWarning, match="Non-default zero stages"):  # upstream's warning
        args = _args(config, "--actor-model", "1.3b", "--reward-model", "350m", "--output-dir", str(tmp_path),
                     "--actor-zero-stage", "3", "--reward-zero-stage", "2")
    runs = E.build_steps(args, config.deployment("single_gpu"))
    assert [r.output_dir for r in runs] == [tmp_path / "actor-models/1.3b", tmp_path / "reward-models/350m",
                                           tmp_path / "step3-models/1.3b"]
    assert runs[0].params == {"output_dir": str(tmp_path / "actor-models/1.3b"), "zero_stage": "3"}
    assert runs[1].params["zero_stage"] == "2"
    assert runs[2].params == {"actor_model": str(tmp_path / "actor-models/1.3b"),
                              "critic_model": str(tmp_path / "reward-models/350m"),
                              "actor_zero_stage": "3", "critic_zero_stage": "2",
                              "output_dir": str(tmp_path / "step3-models/1.3b")}
    assert all(r.note is None and r.extra == [] for r in runs)


def _step_parser(step: int):
    """``parse_args`` of training/step<step>/main.py."""

    return step3_main().parse_args if step == 3 else load_script(f"step{step}").parse_args


def test_save_format_reaches_every_step(config, tmp_path):
    """--save-format bin is passed to all three steps, whose main.py parse it (upstream's test looks
    for pytorch_model.bin); without it the steps keep their default, safetensors."""
    args = _args(config, "--actor-model", "1.3b", "--reward-model", "350m", "--output-dir", str(tmp_path),
                 "--save-format", "bin")
    runs = E.build_steps(args, config.deployment("single_node"))
    for run_ in runs:
        argv = run_.recipe.render(run_.params, run_.extra)
        assert argv[-2:] == ["--save_format", "bin"]
        assert _step_parser(run_.number)(argv).save_format == "bin"
    assert "--save-format bin" in E.reproduce_command(args, config.deployment("single_node"), 1)
    args = _args(config, "--actor-model", "1.3b", "--reward-model", "350m", "--output-dir", str(tmp_path))
    for run_ in E.build_steps(args, config.deployment("single_node")):
        argv = run_.recipe.render(run_.params, run_.extra)
        assert "--save_format" not in argv and _step_parser(run_.number)(argv).save_format == "safetensors"
    with pytest.raises(SystemExit):
        _args(config, "--save-format", "pickle")


def test_any_model_uses_the_generic_recipe_with_family_fixes(config, tmp_path):
    from dschat.models.registry import resolve_model_path

    llama = resolve_model_path("tiny-llama")  # a local LLaMA folder, like a user's own model
    args = _args(config, "--actor-model", llama, "--reward-model", llama, "--output-dir", str(tmp_path), "--seed", "9")
    runs = E.build_steps(args, config.deployment("single_gpu"))
    assert runs[0].recipe.id == "opt/single_gpu/1.3b" and "no single_gpu recipe names" in runs[0].note
    # The OPT recipe's LoRA would match no LLaMA module: the family table supplies "layers.".
    assert runs[0].extra == ["--model_name_or_path", llama, "--lora_module_name", "layers.", "--seed", "9"]
    assert runs[1].extra == ["--model_name_or_path", llama, "--num_padding_at_beginning", "0", "--seed", "9"]
    # Step 3's leading pads follow its critic's family too (the recipe leaves them at step 3's default, OPT's 1).
    assert runs[2].extra == ["--actor_lora_module_name", "layers.", "--num_padding_at_beginning", "0", "--seed", "9"]
    assert runs[0].output_dir == tmp_path / "actor-models" / Path(llama).name


def test_a_listed_actor_recipe_adapts_step_3_to_another_reward_model_family(config, tmp_path):
    """The 1.3b recipe names OPT for both models; a LLaMA reward model gets its family's leading pads in
    step 3 though the actor's recipe is listed (they were adapted only for a recipe substituted for the
    actor). The recipe trains no LoRA, so no LoRA filter is added."""
    from dschat.models.registry import resolve_model_path

    llama = resolve_model_path("tiny-llama")
    args = _args(config, "--actor-model", "facebook/opt-1.3b", "--reward-model", llama, "--output-dir", str(tmp_path))
    step3 = E.build_steps(args, config.deployment("single_gpu"))[2]
    assert step3.recipe.id == "opt/single_gpu/1.3b" and step3.note is None
    assert step3.extra == ["--num_padding_at_beginning", "0"]


def test_a_listed_recipe_fetches_no_config_for_its_own_hub_ids(config, tmp_path, monkeypatch):
    """Upstream's 1.3b + 350m: the hub ids are the recipe's own models; no config is read for them (with
    the hub online that is a download, offline and uncached a wait)."""
    def no_lookup(model):
        raise AssertionError(f"looked up {model}")

    monkeypatch.setattr(E, "_family", no_lookup)
    args = _args(config, "--actor-model", "1.3b", "--reward-model", "350m", "--output-dir", str(tmp_path))
    step3 = E.build_steps(args, config.deployment("single_gpu"))[2]
    assert step3.recipe.id == "opt/single_gpu/1.3b" and step3.extra == []


def test_dry_run_without_gpu_picks_the_cpu_demo_and_says_so(tmp_path):
    proc = _e2e("--dry-run", "--output-dir", str(tmp_path), env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("No GPU found: running the CPU demo (--deployment-type cpu)")
    assert sum(line.startswith("No GPU found") for line in lines) == 1
    for n in (1, 2, 3):
        assert f"---=== Running Step {n} ===---" in lines
    commands = [line for line in lines if "main.py" in line]
    assert len(commands) == 3 and all(c.startswith("DS_ACCELERATOR=cpu ") for c in commands)
    assert "--model_name_or_path smollm2-135m" in commands[0]
    assert f"--critic_model_name_or_path {tmp_path}/reward-models/smollm2-135m" in commands[2]
    assert "estimated" in proc.stdout


def test_gpu_deployment_without_gpu_is_refused(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = _e2e("--deployment-type", "single_gpu", "--output-dir", str(tmp_path), env={"DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: --deployment-type single_gpu needs a CUDA GPU")


def test_missing_step_outputs_name_the_folder_and_the_command(tmp_path, e2e_here):
    proc = e2e_here("--step", "3", "--deployment-type", "cpu", "--actor-model", "tiny-llama", "--reward-model",
                "tiny-llama", "--output-dir", str(tmp_path))
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert err.count("\n") == 0
    assert f"step 3 needs the step-1 actor in {tmp_path}/actor-models/tiny-llama" in err
    assert (f"python e2e_rlhf.py --step 1 --actor-model tiny-llama --deployment-type cpu --output-dir {tmp_path}"
            in err)
    # With step 1's folder in place, the step-2 folder is the one named.
    actor = tmp_path / "actor-models/tiny-llama"
    actor.mkdir(parents=True)
    (actor / "config.json").write_text("{}")
    (actor / "model.safetensors").write_bytes(b"x")
    proc = e2e_here("--step", "3", "--deployment-type", "cpu", "--actor-model", "tiny-llama", "--reward-model",
                "tiny-llama", "--output-dir", str(tmp_path))
    assert proc.returncode == 2
    assert f"the step-2 reward model in {tmp_path}/reward-models/tiny-llama" in proc.stderr
    assert "python e2e_rlhf.py --step 2 --reward-model tiny-llama" in proc.stderr


def test_a_missing_input_of_step_3_stops_e2e_before_the_steps_it_runs_first(tmp_path, e2e_here):
    """--step 2 3 without step 1's actor: refused before step 2 trains, not after."""
    proc = e2e_here("--step", "2", "3", "--deployment-type", "cpu", "--actor-model", "tiny-llama", "--reward-model",
                "tiny-llama", "--output-dir", str(tmp_path))
    assert proc.returncode == 2, proc.stdout[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"error: step 3 needs the step-1 actor in {tmp_path}/actor-models/tiny-llama, but the folder does not exist")
    assert "Running Step" not in proc.stdout and not (tmp_path / "reward-models").exists()


def test_folder_problem_checks_weights_and_value_head(tmp_path):
    assert E.folder_problem(tmp_path / "nope", "actor") == "the folder does not exist"
    (tmp_path / "config.json").write_text("{}")
    assert "no model weights" in E.folder_problem(tmp_path, "actor")
    (tmp_path / "model.safetensors").write_bytes(b"x")
    assert E.folder_problem(tmp_path, "actor") is None
    assert "v_head.safetensors" in E.folder_problem(tmp_path, "reward")  # upstream checked pytorch_model.bin only


def test_simulated_oom_gives_memory_advice(tmp_path):
    fake = tmp_path / "fake_deepspeed.py"
    fake.write_text(textwrap.dedent("""
        import sys
        print("Traceback (most recent call last):")
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB", flush=True)
        sys.exit(1)
    """))
    proc = _e2e("--step", "1", "--deployment-type", "cpu", "--actor-model", "tiny-llama", "--output-dir", str(tmp_path),
                env={LAUNCHER_ENV: f"{sys.executable} {fake}"})
    assert proc.returncode == 1
    assert "---=== Running Step 1 ===---" in proc.stdout
    assert "CUDA out of memory" in proc.stdout  # streamed
    err = proc.stderr
    assert "Step 1 exited with non-zero status 1" in err
    assert "It looks like the step ran out of memory (CUDA out of memory)" in err
    assert "--gradient_checkpointing" in err and "--actor-zero-stage / --reward-zero-stage" in err
    assert (tmp_path / "actor-models/tiny-llama/training.log").read_text().count("CUDA out of memory") == 1
    assert "Finished Step 1" not in proc.stdout


def test_failure_without_oom_gives_the_rerun_command(tmp_path):
    fake = tmp_path / "fake_deepspeed.py"
    fake.write_text("import sys; print('ValueError: something else'); sys.exit(3)\n")
    proc = _e2e("--step", "2", "--deployment-type", "cpu", "--reward-model", "tiny-llama", "--output-dir", str(tmp_path),
                env={LAUNCHER_ENV: f"{sys.executable} {fake}"})
    assert proc.returncode == 3
    assert "ran out of memory" not in proc.stderr
    assert "To rerun only this step: python e2e_rlhf.py --step 2 --reward-model tiny-llama" in proc.stderr


def test_a_step_refusing_its_input_exits_2_and_leaves_no_folder(tmp_path):
    fake = tmp_path / "fake_deepspeed.py"
    fake.write_text("import sys; print('error: --some_flag is wrong; pass another', file=sys.stderr); sys.exit(2)\n")
    out = tmp_path / "out"
    proc = _e2e("--step", "1", "--deployment-type", "cpu", "--actor-model", "tiny-llama", "--output-dir", str(out),
                env={LAUNCHER_ENV: f"{sys.executable} {fake}"})
    assert proc.returncode == 2
    assert "error: --some_flag is wrong" in proc.stdout  # the step's line, streamed
    assert "Step 1 refused its input (exit status 2" in proc.stderr and "Log output" not in proc.stderr
    assert not out.exists()  # the folder made for training.log is removed again
    # An earlier finished record of that step stays as it was: the step changed nothing.
    args = E.parse_args(["--deployment-type", "cpu", "--actor-model", "tiny-llama", "--reward-model", "tiny-llama",
                         "--output-dir", str(out)], E.load_e2e_config())
    E.save_step_record(out, E.build_steps(args, E.pick_deployment(args, E.load_e2e_config()))[0], finished=True)
    before = (out / E.STEPS_FILE).read_text()
    proc = _e2e("--step", "1", "--seed", "3", "--deployment-type", "cpu", "--actor-model", "tiny-llama", "--output-dir",
                str(out), env={LAUNCHER_ENV: f"{sys.executable} {fake}"})
    assert proc.returncode == 2 and (out / E.STEPS_FILE).read_text() == before


def test_a_second_e2e_on_the_output_folder_of_a_running_one_stops_and_writes_nothing(tmp_path):
    """A second e2e on a running one's --output-dir would retrain each step and replace the first's
    finished models (and their records) while the first still reads them: one line, exit 2, nothing
    written, no step launched. Once the first has ended, the folder is free again."""
    fake = tmp_path / "fake_deepspeed.py"
    fake.write_text("import sys; print('launched'); sys.exit(2)\n")
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys
        sys.path.insert(0, sys.argv[2])
        import e2e_rlhf
        from dschat.runtime.run_lock import hold_run_lock

        class Args: pass
        args = Args()
        hold_run_lock(sys.argv[1], args, "--output-dir")
        print("held", flush=True)
        sys.stdin.read()
    """), str(out), str(REPO)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        argv = ("--step", "1", "--deployment-type", "cpu", "--actor-model", "tiny-llama", "--output-dir", str(out),
                "--preflight", "off")
        proc = _e2e(*argv, env={LAUNCHER_ENV: f"{sys.executable} {fake}"})
        assert proc.returncode == 2, proc.stderr
        assert "--output-dir" in proc.stderr and str(holder.pid) in proc.stderr
        assert "launched" not in proc.stdout and "Running Step" not in proc.stdout
        assert sorted(p.name for p in out.iterdir()) == [".dschat-run.lock"]
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    proc = _e2e(*argv, env={LAUNCHER_ENV: f"{sys.executable} {fake}"})
    assert "launched" in proc.stdout  # the folder is free: the (fake) step runs


# ------------------------------------------------------------------------------------------------
# The real thing on tiny models
# ------------------------------------------------------------------------------------------------
STEP_SCRIPTS = [REPO / f"training/{d}/main.py" for d in
                ("step1_supervised_finetuning", "step2_reward_model_finetuning", "step3_rlhf_finetuning")]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    missing = [str(p.relative_to(REPO)) for p in STEP_SCRIPTS if not p.is_file()]
    if missing:
        pytest.skip(f"cannot run the pipeline yet: {', '.join(missing)} missing")
    out = tmp_path_factory.mktemp("e2e_tiny")
    proc = _e2e("--deployment-type", "cpu", "--actor-model", "tiny-llama", "--reward-model", "tiny-llama",
                "--output-dir", str(out), env={"OMP_NUM_THREADS": "2"}, timeout=1800)
    return out, proc


@pytest.mark.slow
def test_e2e_runs_all_three_steps_on_tiny_models(tiny_run):
    out, proc = tiny_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for n in (1, 2, 3):
        assert f"---=== Running Step {n} ===---" in lines
        assert any(line.startswith(f"---=== Finished Step {n} in 0:") for line in lines)
    assert any(line.startswith("---=== Finished Steps [1, 2, 3] in ") for line in lines)
    # A finished step is set beside the estimate printed before it (scaled by the steps before), not the recipe's
    told = [line.split()[1] for line in lines if line.startswith("estimated ") and " for this step" in line]
    compared = [line.rsplit("(estimated ", 1)[1].rstrip(")") for line in lines if line.startswith("---=== Finished Step ")
                and "(estimated " in line]
    assert len(told) == 3 and compared == told, (told, compared)
    for folder in ("actor-models/tiny-llama", "reward-models/tiny-llama", "step3-models/tiny-llama/actor",
                   "step3-models/tiny-llama/critic", "step3-models/tiny-llama/actor_ema"):
        assert (out / folder / "config.json").is_file(), folder
    assert (out / "reward-models/tiny-llama/v_head.safetensors").is_file()
    for folder in ("actor-models/tiny-llama", "reward-models/tiny-llama", "step3-models/tiny-llama"):
        log = (out / folder / "training.log").read_text()
        assert log.startswith("[dschat.launch] ") and "main.py" in log.splitlines()[0]
    timings = json.loads((out / "e2e_timings.json").read_text())
    assert set(timings) == {"1", "2", "3"} and all(v > 0 for v in timings.values())
    records = E.load_step_records(out)  # what --resume compares a finished step's flags with
    assert set(records) == {"actor-models/tiny-llama", "reward-models/tiny-llama", "step3-models/tiny-llama"}
    assert all(r["finished"] for r in records.values())
    assert "<output-dir>/actor-models/tiny-llama" in records["step3-models/tiny-llama"]["flags"]


@pytest.mark.slow
def test_e2e_writes_the_report(tiny_run):
    import math

    out, proc = tiny_run
    assert proc.returncode == 0
    report = json.loads((out / "report.json").read_text())
    assert report["total_seconds"] > sum(report["steps"][k]["seconds"] for k in ("1", "2", "3")) > 0
    assert 0.0 <= report["reward_model"]["heldout_accuracy_vs_gold"] <= 1.0
    for actor in ("sft_actor", "rlhf_actor"):
        for key in ("gold_score", "reward_score", "mean_response_tokens"):
            assert math.isfinite(report[actor][key])
    assert math.isfinite(report["rlhf_actor"]["kl_to_sft"])
    assert (out / "ppo_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "==================== dschat report ====================" in proc.stdout
    assert "Chat with the RLHF actor: python chat.py --path" in proc.stdout


@pytest.mark.slow
def test_step3_writes_metrics_for_the_ppo_plot(tiny_run):
    from dschat.eval.report import read_metrics

    out, proc = tiny_run
    assert proc.returncode == 0
    records = read_metrics(out / "step3-models/tiny-llama/metrics.jsonl")
    assert len(records) == 2  # cpu/tiny stops after 2 PPO steps
    assert all({"step", "reward", "kl_to_ref", "response_length"} <= set(r) for r in records)


def test_resume_skips_finished_steps_and_resumes_the_first_unfinished_one(tmp_path, e2e_here):
    for folder in ("actor-models/tiny-llama", "reward-models/tiny-llama"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "config.json").write_text("{}")
        (tmp_path / folder / "model.safetensors").write_bytes(b"x")
    (tmp_path / "reward-models/tiny-llama/v_head.safetensors").write_bytes(b"x")
    proc = e2e_here("--dry-run", "--resume", "--save-interval", "5", "--deployment-type", "cpu", "--actor-model",
                "tiny-llama", "--reward-model", "tiny-llama", "--output-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert f"---=== Step 1 is complete in {tmp_path}/actor-models/tiny-llama; skipping it (--resume) ===---" in proc.stdout
    assert "Step 2 is complete" in proc.stdout and "---=== Running Step 3 ===---" in proc.stdout
    command = next(line for line in proc.stdout.splitlines() if "main.py" in line)
    assert "step3_rlhf_finetuning" in command and command.endswith("--save_interval 5 --resume")
    # Without step 2's value head, step 2 is the one resumed and step 3 runs afresh after it.
    (tmp_path / "reward-models/tiny-llama/v_head.safetensors").unlink()
    proc = e2e_here("--dry-run", "--resume", "--deployment-type", "cpu", "--actor-model", "tiny-llama", "--reward-model",
                "tiny-llama", "--output-dir", str(tmp_path))
    commands = [line for line in proc.stdout.splitlines() if "main.py" in line]
    assert len(commands) == 2 and commands[0].endswith("--resume") and not commands[1].endswith("--resume")


def test_resume_refuses_a_finished_step_trained_with_other_flags(tmp_path, e2e_here):
    models = ("--deployment-type", "cpu", "--actor-model", "tiny-llama", "--reward-model", "tiny-llama",
              "--output-dir", str(tmp_path))
    folder = tmp_path / "actor-models/tiny-llama"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x")
    args = E.parse_args(list(models), E.load_e2e_config())
    step1 = E.build_steps(args, E.pick_deployment(args, E.load_e2e_config()))[0]
    E.save_step_record(tmp_path, step1, finished=True)
    assert list(E.load_step_records(tmp_path)) == ["actor-models/tiny-llama"]  # one record per model folder
    proc = e2e_here("--dry-run", "--resume", *models)
    assert proc.returncode == 0, proc.stderr
    assert "Step 1 is complete" in proc.stdout and "not on record" not in proc.stdout
    proc = e2e_here("--dry-run", "--resume", "--save-format", "both", *models)  # the same weights, saved otherwise
    assert proc.returncode == 0 and "Step 1 is complete" in proc.stdout, proc.stderr
    proc = e2e_here("--dry-run", "--resume", "--seed", "7", *models)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith(
        f"--resume: step 1's model in {folder} was trained with other flags (--seed: then 1234, now 7); to "
        "train it again with these, run without --resume and with --step 1 2 3 (it replaces that model), or "
        "pass another --output-dir")
    assert (folder / "model.safetensors").read_bytes() == b"x"
    # The output folder moved: the recorded paths under it still match.
    moved = tmp_path.with_name(tmp_path.name + "-moved")
    tmp_path.rename(moved)
    proc = e2e_here("--dry-run", "--resume", *models[:-1], str(moved))
    assert proc.returncode == 0 and "Step 1 is complete" in proc.stdout, proc.stderr
    moved.rename(tmp_path)
    # A step that started again and did not finish (its earlier model still in place) resumes.
    E.save_step_record(tmp_path, step1, finished=False)
    proc = e2e_here("--dry-run", "--resume", *models)
    assert proc.returncode == 0 and "step 1 started in" in proc.stdout and "Running Step 1" in proc.stdout
    proc = e2e_here("--dry-run", "--resume", "--seed", "7", *models)  # its checkpoints hold other flags' training
    assert proc.returncode == 2 and (f"--resume: step 1 in {folder} started with other flags (--seed: then 1234, now "
                                     "7) and did not finish; to start it again with these, delete") in proc.stderr
    (tmp_path / E.STEPS_FILE).unlink()  # no record (a step run by hand): finished, with a note
    proc = e2e_here("--dry-run", "--resume", "--seed", "7", *models)
    assert proc.returncode == 0 and "step 1's flags are not on record" in proc.stdout


def test_resume_refuses_an_interrupted_step_with_checkpoints_of_other_flags(tmp_path, e2e_here):
    """A step killed after a checkpoint and before its model was written has no model folder: --resume
    with other flags would finish it, trained partly with each set, and record it as this run's."""
    from dschat.training.rotation import MARKER, checkpoint_name

    models = ("--deployment-type", "cpu", "--actor-model", "tiny-llama", "--reward-model", "tiny-llama",
              "--output-dir", str(tmp_path))
    args = E.parse_args([*models, "--seed", "7"], E.load_e2e_config())
    step1 = E.build_steps(args, E.pick_deployment(args, E.load_e2e_config()))[0]
    E.save_step_record(tmp_path, step1, finished=False)  # started with --seed 7, killed
    checkpoint = step1.output_dir / "checkpoints" / checkpoint_name(1)
    checkpoint.mkdir(parents=True)
    (checkpoint / MARKER).write_text("{}")
    proc = e2e_here("--dry-run", "--resume", *models)
    assert proc.returncode == 2, proc.stdout
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"error: --resume: step 1 in {step1.output_dir} started with other flags (--seed: then 7, now 1234) and did "
        "not finish; to start it again with these, delete")
    assert (checkpoint / MARKER).is_file()
    proc = e2e_here("--dry-run", "--resume", *models, "--seed", "7")  # its own flags: it resumes
    assert proc.returncode == 0 and "Running Step 1" in proc.stdout, proc.stderr
    import shutil

    shutil.rmtree(checkpoint)  # no checkpoint to go on from: it starts again with these flags
    proc = e2e_here("--dry-run", "--resume", *models)
    assert proc.returncode == 0 and "Running Step 1" in proc.stdout, proc.stderr


@pytest.mark.parametrize("text", ['{"1": null}', '{"1": [1]}', "[1]", "{", "[" * 100000])
def test_damaged_timings_and_step_records_are_read_as_none(tmp_path, text):
    (tmp_path / E.TIMINGS_FILE).write_text(text)
    assert E.load_timings(tmp_path) == {}
    (tmp_path / E.STEPS_FILE).write_text(text)
    assert E.load_step_records(tmp_path) == {}


def test_a_repeated_flag_differs_by_any_of_its_values():
    assert E.flags_difference(["--reward_fn", "a:f", "--reward_fn", "b:g"], ["--reward_fn", "c:h", "--reward_fn", "b:g"]) == (
        "--reward_fn: then a:f / b:g, now c:h / b:g")
    assert E.flags_difference(["--a=1", "--b"], ["--b", "--a", "1"]) is None


@pytest.mark.slow
def test_e2e_resume_after_a_lost_step3(tiny_run, tmp_path):
    """Steps 1 and 2 done, step 3 lost: --resume skips 1 and 2 and trains step 3 with checkpoints."""
    import shutil

    out, proc = tiny_run
    assert proc.returncode == 0
    for folder in ("actor-models", "reward-models"):
        shutil.copytree(out / folder, tmp_path / folder)
    proc = _e2e("--resume", "--save-interval", "1", "--report", "never", "--deployment-type", "cpu", "--actor-model",
                "tiny-llama", "--reward-model", "tiny-llama", "--output-dir", str(tmp_path),
                env={"OMP_NUM_THREADS": "2"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Step 1 is complete" in proc.stdout and "Step 2 is complete" in proc.stdout
    assert "---=== Finished Step 3 in " in proc.stdout
    log = (tmp_path / "step3-models/tiny-llama/training.log").read_text()
    assert "--resume: no complete checkpoint under" in log
    checkpoints = sorted(p.name for p in (tmp_path / "step3-models/tiny-llama/checkpoints").iterdir())
    assert checkpoints == ["step_00000001", "step_00000002"]


# ------------------------------------------------------------------------------------------------
# Launcher options: a free port on one node, hostfile / master address / port / nodes for several
# ------------------------------------------------------------------------------------------------
def _dry_run_commands(capsys, *argv: str) -> list[list[str]]:
    import shlex

    assert E._entry(["--dry-run", "--deployment-type", "cpu", "--actor-model", "tiny-llama", "--reward-model",
                     "tiny-llama", *argv]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "main.py" in line]
    assert len(lines) == 3
    return [shlex.split(line) for line in lines]


def test_e2e_single_node_steps_take_free_ports(tmp_path, capsys, monkeypatch):
    from dschat import multinode as M

    monkeypatch.setattr(M, "DEFAULT_HOSTFILE", str(tmp_path / "no-job-hostfile"))
    for argv in _dry_run_commands(capsys, "--output-dir", str(tmp_path)):
        port = int(argv[argv.index("--master_port") + 1])
        assert port != 29500 and M.port_is_free(port)
    fixed = M.free_port()
    for argv in _dry_run_commands(capsys, "--output-dir", str(tmp_path), "--master_port", str(fixed)):
        assert argv[argv.index("--master_port") + 1] == str(fixed)


def test_e2e_passes_every_launcher_option_and_keeps_them_out_of_main_py(tmp_path, capsys, monkeypatch):
    from dschat import multinode as M

    monkeypatch.setattr(M, "DEFAULT_HOSTFILE", str(tmp_path / "no-job-hostfile"))
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1.invalid slots=1\nnode2.invalid slots=1\n")
    for argv in _dry_run_commands(capsys, "--output-dir", str(tmp_path), "--hostfile", str(hostfile),
                                  "--master_addr", "10.0.0.7", "--master-port", "29777", "--num_nodes", "2",
                                  "--num_gpus", "1"):
        main = next(i for i, token in enumerate(argv) if token.endswith("main.py"))
        assert argv[main - 10:main] == ["--hostfile", str(hostfile), "--num_nodes", "2", "--num_gpus", "1",
                                        "--master_addr", "10.0.0.7", "--master_port", "29777"]
        assert not {"--hostfile", "--master_addr", "--master_port", "--num_nodes"} & set(argv[main:])
    # On several nodes a value that the remote shell would interpret is refused before any step runs.
    bad = tmp_path / "out$(id)"
    assert E._entry(["--dry-run", "--deployment-type", "cpu", "--actor-model", "tiny-llama", "--output-dir", str(bad),
                     "--hostfile", str(hostfile)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds '$()'" in err and not bad.exists()


def test_a_recipe_shared_by_several_models_trains_the_model_asked_for(config, tmp_path):
    """The CPU table maps tiny-opt to cpu/tiny, a recipe written for tiny-llama: steps 1 and 2 load
    tiny-opt (it had trained tiny-llama into a folder named tiny-opt)."""
    args = _args(config, "--actor-model", "tiny-opt", "--reward-model", "tiny-opt-quirk", "--output-dir", str(tmp_path))
    step1, step2, step3 = E.build_steps(args, config.deployment("cpu"))
    assert step1.recipe.flag("model_name_or_path") == "tiny-llama"
    argv1, argv2 = (run_.recipe.render(run_.params, run_.extra) for run_ in (step1, step2))
    assert _step_parser(1)(argv1).model_name_or_path == "tiny-opt"
    assert _step_parser(2)(argv2).model_name_or_path == "tiny-opt-quirk"
    assert step3.params["actor_model"] == str(tmp_path / "actor-models" / "tiny-opt")
    args = _args(config, "--actor-model", "tiny-llama", "--reward-model", "tiny-llama", "--output-dir", str(tmp_path))
    assert [run_.extra for run_ in E.build_steps(args, config.deployment("cpu"))] == [[], [], []]


def test_algorithm_and_reward_functions_pass_through_to_step3(config, tmp_path):
    models = ("--actor-model", "smollm2-135m", "--reward-model", "smollm2-135m", "--output-dir", str(tmp_path))
    args = _args(config, *models, "--algorithm", "grpo", "--reward-fn", "dschat.rewards:gold")
    runs = E.build_steps(args, config.deployment("cpu"))
    assert runs[2].extra == ["--algorithm", "grpo", "--num_generations", "4", "--reward_fn", "dschat.rewards:gold"]
    assert runs[0].extra == [] and runs[1].extra == []
    args = _args(config, *models, "--algorithm", "remax", "--num-generations", "2")
    assert E.build_steps(args, config.deployment("cpu"))[2].extra == ["--algorithm", "remax", "--num_generations", "2"]
    # A finished critic-free step 3 has an actor and no critic.
    run3 = E.build_steps(args, config.deployment("cpu"))[2]
    (run3.output_dir / "actor").mkdir(parents=True)
    (run3.output_dir / "actor" / "config.json").write_text("{}")
    (run3.output_dir / "actor" / "model.safetensors").write_bytes(b"x")
    assert E.output_problem(run3) is None
    assert E.output_problem(E.build_steps(_args(config, *models), config.deployment("cpu"))[2])  # PPO: no critic


def test_environment_options_pass_through_to_step3_only(config, tmp_path, capsys, monkeypatch):
    from dschat import multinode as M

    models = ("--actor-model", "smollm2-135m", "--reward-model", "smollm2-135m", "--output-dir", str(tmp_path))
    args = _args(config, *models, "--algorithm", "grpo", "--env", "dschat.envs_examples:calculator",
                 "--max-turns", "3", "--env-timeout", "30")
    runs = E.build_steps(args, config.deployment("cpu"))
    assert runs[2].extra == ["--algorithm", "grpo", "--num_generations", "4",
                             "--env", "dschat.envs_examples:calculator", "--max_turns", "3", "--env_timeout", "30.0"]
    assert runs[0].extra == [] and runs[1].extra == []
    # Only what is given is passed: step 3's own defaults otherwise.
    args = _args(config, *models, "--env", "dschat.envs_examples:calculator")
    assert E.build_steps(args, config.deployment("cpu"))[2].extra == ["--env", "dschat.envs_examples:calculator"]
    assert E.build_steps(_args(config, *models), config.deployment("cpu"))[2].extra == []
    # The launched step-3 command carries step 3's spelling; steps 1 and 2 get none of it.
    monkeypatch.setattr(M, "DEFAULT_HOSTFILE", str(tmp_path / "no-job-hostfile"))
    step1, step2, step3 = _dry_run_commands(capsys, "--output-dir", str(tmp_path), "--env",
                                            "dschat.envs_examples:calculator", "--max-turns", "2",
                                            "--env-timeout", "0")
    main = next(i for i, token in enumerate(step3) if token.endswith("main.py"))
    flags = step3[main + 1:]
    assert flags[flags.index("--env") + 1] == "dschat.envs_examples:calculator"
    assert flags[flags.index("--max_turns") + 1] == "2" and flags[flags.index("--env_timeout") + 1] == "0.0"
    for argv in (step1, step2):
        assert not {"--env", "--max_turns", "--env_timeout"} & set(argv)


@pytest.mark.parametrize(("argv", "message"), [
    (("--max-turns", "0", "--env", "dschat.envs_examples:calculator"),
     "--max-turns must be a whole number >= 1, got 0"),
    (("--env-timeout", "-1", "--env", "dschat.envs_examples:calculator"),
     "--env-timeout must be a number of seconds from 0 to 1e9 (0: no limit), got -1.0"),
    (("--env-timeout", "nan", "--env", "dschat.envs_examples:calculator"), "got nan"),
    (("--env-timeout", "2e9", "--env", "dschat.envs_examples:calculator"), "from 0 to 1e9 (0: no limit), got 2000000000.0"),
    (("--max-turns", "2"), "--max-turns applies to multi-turn episodes only; add --env MODULE:FACTORY"),
    (("--env-timeout", "5"), "--env-timeout applies to multi-turn episodes only"),
    (("--env", "no_such_module_e2e7:make"),
     "--env no_such_module_e2e7:make: cannot import module 'no_such_module_e2e7'"),
    (("--env", "dschat.envs_examples"), "--env 'dschat.envs_examples' is not of the form module.path:function"),
    (("--env", "dschat.envs_examples:no_such_factory"), "has no attribute 'no_such_factory'"),
], ids=["max-turns-0", "timeout-negative", "timeout-nan", "timeout-above-1e9", "max-turns-without-env", "timeout-without-env",
        "env-unimportable", "env-no-colon", "env-no-attribute"])
def test_bad_environment_options_stop_e2e_before_any_step(argv, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert E._entry(["--deployment-type", "cpu", "--actor-model", "tiny-llama", "--reward-model", "tiny-llama",
                     "--output-dir", str(out), *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("error: ") and message in captured.err
    assert "Running Step" not in captured.out and not out.exists()


def test_a_multi_node_env_spec_is_imported_on_the_nodes_only(config):
    """Each node imports --env from its own files: e2e checks only the spec's form there."""
    multi, local = config.deployment("multi_node"), config.deployment("cpu")
    args = _args(config, "--env", "only_on_the_nodes_e2e7:make")
    E.check_environment_spec(args, multi)
    with pytest.raises(UserError, match="cannot import module 'only_on_the_nodes_e2e7'"):
        E.check_environment_spec(args, local)
    with pytest.raises(UserError, match="is not of the form module.path:function"):
        E.check_environment_spec(_args(config, "--env", "no_colon"), multi)


@pytest.mark.slow
def test_e2e_grpo_rlvr_step3_and_its_report(tiny_run, tmp_path):
    """Steps 1 and 2 reused; step 3 with GRPO on the gold judge (the RLVR demo), then the report against
    the SFT actor, labelled as RLVR."""
    import shutil

    out, proc = tiny_run
    assert proc.returncode == 0
    for folder in ("actor-models", "reward-models"):
        shutil.copytree(out / folder, tmp_path / folder)
    proc = _e2e("--step", "3", "--algorithm", "grpo", "--num-generations", "2", "--reward-fn", "dschat.rewards:gold",
                "--deployment-type", "cpu", "--actor-model", "tiny-llama", "--reward-model", "tiny-llama",
                "--output-dir", str(tmp_path), env={"OMP_NUM_THREADS": "2"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "--algorithm grpo --num_generations 2 --reward_fn dschat.rewards:gold" in proc.stdout
    step3 = tmp_path / "step3-models/tiny-llama"
    assert (step3 / "actor/config.json").is_file() and not (step3 / "critic").exists()
    assert "note: RLVR demo -- step 3 was trained on the gold judge itself" in proc.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert {"sft_actor", "rlhf_actor", "rlhf_vs_sft"} <= set(report)


# ------------------------------------------------------------------------------------------------
# The memory preflight (docs/memory-plan.md)
# ------------------------------------------------------------------------------------------------
def test_preflight_on_the_cpu_is_one_line_per_step(tmp_path, capsys, monkeypatch):
    """Every step planned before step 1 runs (step 3 with the base models' configs, its inputs not
    written yet); on the CPU nothing is enforced."""
    launched = []
    monkeypatch.setattr(E, "run", lambda launch: launched.append(launch) or E.LaunchResult(1, 0.0, None, None, ""))
    monkeypatch.setattr(E, "fail_step", lambda *a: 1)
    E.main(["--deployment-type", "cpu", "--actor-model", "tiny-llama", "--reward-model", "tiny-opt",
            "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if x.startswith("memory preflight, step ")]
    assert [x.split(":")[0] for x in lines] == [f"memory preflight, step {n}" for n in (1, 2, 3)], out
    assert all("(not enforced on the CPU)" in x for x in lines)
    assert out.index("memory preflight, step 3") < out.index("---=== Running Step 1 ===---")
    assert len(launched) == 1  # step 1 ran (and "failed"), after the plans


def test_preflight_plans_a_critic_free_step3_with_the_engines_it_builds(tmp_path, capsys, monkeypatch):
    """GRPO scored by a reward function: e2e plans its step 3 (actor and reference only), no note."""
    monkeypatch.setattr(E, "run", lambda launch: E.LaunchResult(1, 0.0, None, None, ""))
    monkeypatch.setattr(E, "fail_step", lambda *a: 1)
    E.main(["--deployment-type", "cpu", "--actor-model", "tiny-llama", "--reward-model", "tiny-opt",
            "--output-dir", str(tmp_path), "--algorithm", "grpo", "--num-generations", "2",
            "--reward-fn", "dschat.rewards:gold"])
    out = capsys.readouterr().out
    assert "memory preflight, step 3: peak " in out and "note: e2e's memory preflight" not in out, out


def test_preflight_stops_e2e_before_step_1_when_a_step_cannot_fit(tmp_path, capsys, monkeypatch):
    """On a GPU too small for step 2, e2e stops in one line naming step 2, before launching anything
    (a 1 GB GPU: step 1's tiny-llama fits, step 2's SmolLM2-135M reward model does not)."""
    import dschat.plan.preflight as pf

    launched = []
    monkeypatch.setattr(E, "run", lambda launch: launched.append(launch) or E.LaunchResult(0, 0.0, None, None, ""))
    monkeypatch.setattr(pf, "device_memory", lambda: ("cuda", 10**9))
    argv = ["--deployment-type", "cpu", "--actor-model", "tiny-llama", "--reward-model", "smollm2-135m",
            "--output-dir", str(tmp_path)]
    with pytest.raises(UserError) as refused:
        E.main(argv)
    out = capsys.readouterr().out
    assert "memory preflight, step 1: peak " in out and "fits the 1.00 GB GPU" in out  # step 1 was planned and fits
    line = str(refused.value)
    assert line.startswith("step 2 does not fit: training needs ") and "\n" not in line
    assert "python -m dschat.plan with --step 2 and the same flags" in line
    assert "e2e's --preflight off skips this check" in line
    assert not launched
    monkeypatch.setattr(E, "fail_step", lambda *a: 1)
    monkeypatch.setattr(E, "check_output_of", lambda run_: None)
    E.main([*argv, "--preflight", "off", "--step", "1"])  # off: no plan, the step runs
    assert len(launched) == 1


# ------------------------------------------------------------------------------------------------
# Checks before step 1: what a later step would refuse stops e2e before anything trains
# ------------------------------------------------------------------------------------------------
_CPU_TINY = ("--deployment-type", "cpu", "--actor-model", "tiny-llama", "--reward-model", "tiny-llama")


def _fake_model(folder: Path, reward: bool = False) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x")
    if reward:
        (folder / "v_head.safetensors").write_bytes(b"x")


def _fake_checkpoint(run_folder: Path) -> Path:
    from dschat.training.rotation import MARKER, checkpoint_name

    folder = run_folder / "checkpoints" / checkpoint_name(1)
    folder.mkdir(parents=True)
    (folder / MARKER).write_text("{}")
    return run_folder / "checkpoints"


def test_resume_reruns_step_3_after_step_1_but_keeps_a_finished_step_2(tmp_path, capsys):
    """Step 2 does not train on step 1's model: a rerun of step 1 makes only step 3 stale."""
    _fake_model(tmp_path / "reward-models/tiny-llama", reward=True)
    _fake_model(tmp_path / "step3-models/tiny-llama/actor")
    _fake_model(tmp_path / "step3-models/tiny-llama/critic", reward=True)
    assert E._entry(["--dry-run", "--resume", *_CPU_TINY, "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    commands = [line for line in out.splitlines() if "main.py" in line]
    assert "Step 2 is complete" in out and "Running Step 2" not in out, out
    assert len(commands) == 2 and "step1_supervised" in commands[0] and commands[0].endswith("--resume")
    assert "step3_rlhf" in commands[1] and not commands[1].endswith("--resume")  # afresh, on the new actor
    # Step 2 rerun, step 1 complete: step 3 is stale too.
    (tmp_path / "reward-models/tiny-llama/v_head.safetensors").unlink()
    _fake_model(tmp_path / "actor-models/tiny-llama")
    assert E._entry(["--dry-run", "--resume", *_CPU_TINY, "--output-dir", str(tmp_path)]) == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if "main.py" in line]
    assert len(commands) == 2 and "step2_reward" in commands[0] and not commands[1].endswith("--resume")


def test_checkpoints_of_an_earlier_run_stop_e2e_before_step_1(tmp_path, capsys):
    """A step run afresh refuses an output folder holding an earlier run's checkpoints: e2e names all
    of them before step 1, and --resume's advice for a step trained with other flags names them too."""
    models = [*_CPU_TINY, "--output-dir", str(tmp_path)]
    args = E.parse_args(models, E.load_e2e_config())
    runs = E.build_steps(args, E.pick_deployment(args, E.load_e2e_config()))
    for run_ in runs:
        _fake_model(run_.output_dir / ("actor" if run_.number == 3 else ""), reward=run_.number == 2)
        E.save_step_record(tmp_path, run_, finished=True)
    _fake_model(runs[2].output_dir / "critic", reward=True)
    roots = [_fake_checkpoint(runs[1].output_dir), _fake_checkpoint(runs[2].output_dir)]
    assert E._entry(["--dry-run", *models]) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"error: found checkpoints of an earlier run in {roots[0]} and {roots[1]}, which steps 2 "
                            "and 3 refuse to train afresh beside; pass --resume to continue that run, or delete them "
                            "to start over, or pass another --output-dir\n")
    assert "Running Step" not in captured.out
    assert E._entry(["--dry-run", "--resume", "--seed", "99", *models]) == 2
    err = capsys.readouterr().err
    assert (f"to train it again with these, delete {roots[0]} and {roots[1]} and run without --resume and with "
            "--step 1 2 3 (it replaces that model)") in err, err
    # Step 1 rerun with --resume: step 3 is stale and runs afresh, which its checkpoints would stop.
    (runs[0].output_dir / "model.safetensors").unlink()
    assert E._entry(["--dry-run", "--resume", *models]) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"error: found checkpoints of an earlier run in {roots[1]}, which step 3 refuses to train "
                            "afresh beside; step 3 trains afresh on the models of the step 1 or 2 that runs again; "
                            "delete it to start over, or pass another --output-dir\n")
    assert "Running Step" not in captured.out


def test_a_checkpoint_set_aside_while_it_was_replaced_stops_e2e_before_step_1(tmp_path, capsys):
    """A kill while a save replaced step_<N> leaves the complete copy as step_<N>.replaced-*, which the
    step restores at start-up and then refuses to train afresh beside: e2e sees it before step 1."""
    from dschat.training.rotation import MARKER, REPLACED_TAG, checkpoint_name

    models = [*_CPU_TINY, "--output-dir", str(tmp_path), "--step", "2"]
    args = E.parse_args(models, E.load_e2e_config())
    step2 = E.build_steps(args, E.pick_deployment(args, E.load_e2e_config()))[1]
    aside = step2.output_dir / "checkpoints" / f"{checkpoint_name(2)}{REPLACED_TAG}1a2b3c4d"
    aside.mkdir(parents=True)
    (aside / MARKER).write_text("{}")
    assert E._entry(["--dry-run", *models]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"error: found checkpoints of an earlier run in {aside.parent}, which step 2 "
                                   "refuses"), captured.err
    assert "Running Step" not in captured.out and aside.is_dir()


def test_a_folder_where_e2e_keeps_its_records_is_refused_before_any_step(tmp_path, capsys):
    (tmp_path / E.STEPS_FILE).mkdir()
    assert E._entry([*_CPU_TINY, "--step", "1", "--output-dir", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"error: --output-dir: {tmp_path / E.STEPS_FILE} is not a file, and e2e keeps its records "
                            "there; move it away or pass another --output-dir\n")
    assert "Running Step" not in captured.out and [p.name for p in tmp_path.iterdir()] == [E.STEPS_FILE]


def test_only_upstreams_opt_sizes_lose_their_facebook_prefix():
    assert E.strip_opt(" facebook/opt-1.3b ") == "1.3b" and E.strip_opt("facebook/opt-350m") == "350m"
    assert E.strip_opt("facebook/opt-iml-max-1.3b") == "facebook/opt-iml-max-1.3b"
    assert E.strip_opt("/x/models/facebook/opt-tiny") == "/x/models/facebook/opt-tiny"
    assert E.strip_opt("/x/facebook/opt-1.3b") == "/x/facebook/opt-1.3b"


def test_a_substituted_reward_model_gets_its_leading_pads_and_half_its_blocks_frozen(config, tmp_path):
    """cpu/smollm2-135m freezes 15 of SmolLM2's 30 blocks in step 2; a 2-block model in its place gets
    --freeze_layers 1, its lower half (not every block: the reward model would train its head only).
    Step 3 passes the critic's leading pads (OPT: 1) as step 2 does."""
    from dschat.models.registry import resolve_model_path

    llama, opt = resolve_model_path("tiny-llama"), resolve_model_path("tiny-opt")
    args = _args(config, "--deployment-type", "cpu", "--actor-model", llama, "--reward-model", opt,
                 "--output-dir", str(tmp_path))
    step1, step2, step3 = E.build_steps(args, config.deployment("cpu"))
    assert step2.recipe.id == "cpu/smollm2-135m" and step2.recipe.flag("freeze_layers") == "15"
    flags = step2.recipe.render(step2.params, step2.extra)
    assert flags[len(flags) - 1 - flags[::-1].index("--freeze_layers") + 1] == "1"
    assert flags[len(flags) - 1 - flags[::-1].index("--num_padding_at_beginning") + 1] == "1"
    flags = step3.recipe.render(step3.params, step3.extra)
    assert flags[len(flags) - 1 - flags[::-1].index("--num_padding_at_beginning") + 1] == "1"
    assert "--freeze_layers" not in step1.extra + step3.extra


def test_flags_a_later_step_refuses_on_its_model_stop_e2e_before_step_1(tmp_path, capsys, monkeypatch):
    """The preflight reads step 2's model: --freeze_layers above its blocks is the step's refusal (one
    line, before step 1), not a note about the planner (here e2e cannot read the model, so it does
    not lower the recipe's 15)."""
    from dschat.models.registry import resolve_model_path

    launched = []
    monkeypatch.setattr(E, "run", lambda launch: launched.append(launch) or E.LaunchResult(0, 0.0, None, None, ""))
    monkeypatch.setattr(E, "_family", lambda model: (None, None))
    with pytest.raises(UserError) as refused:
        E.main(["--deployment-type", "cpu", "--actor-model", "tiny-llama", "--reward-model",
                resolve_model_path("tiny-llama"), "--output-dir", str(tmp_path / "out")])
    assert str(refused.value) == ("step 2 refuses its flags: --freeze_layers 15 is more than this model's 2 "
                                  "transformer blocks; pass at most 2")
    assert not launched and "cannot plan" not in capsys.readouterr().out
