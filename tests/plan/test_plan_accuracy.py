"""benchmarks/plan_accuracy.py on the CPU: its prediction is the planner's own for the flags its engines
were built from, its model states counted from those engines equal the planned ones to the byte, it
measures no phase peak without CUDA (and says so), and its table's arithmetic is right."""
from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys

import pytest

from dschat.plan.cli import build_parser, run
from dschat.plan.roles import plan_roles

from helpers import REPO

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--actor", "tiny-opt", "--critic", "tiny-opt", "--lora_dim", "4", "--batch", "2", "--prompt_len", "16",
        "--answer_len", "8"]


def _bench():
    spec = importlib.util.spec_from_file_location("dschat_bench_plan_accuracy", REPO / "benchmarks" / "plan_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def zero3_lora_he(tmp_path_factory):
    """One CPU run of the richest configuration: ZeRO-3, actor LoRA, the Hybrid Engine."""
    results = tmp_path_factory.mktemp("plan_accuracy") / "results.md"
    out = _bench().main(["--configs", "llama-z3-lora-he", *TINY, "--json", "--results", str(results)])
    return out, results


def test_the_prediction_is_the_planners_own_for_the_flags_the_engines_were_built_from(zero3_lora_he, capsys):
    out, _ = zero3_lora_he
    (r,) = out["configs"]
    argv = r["step3_argv"]
    # The engines' flags are the configuration's (step3.py's builder, on the tiny models).
    flags = dict(zip(argv[::2], argv[1::2]))
    assert (flags["--actor_zero_stage"], flags["--critic_zero_stage"], flags["--actor_lora_dim"]) == ("3", "3", "4")
    assert (flags["--max_prompt_seq_len"], flags["--max_answer_seq_len"], flags["--dtype"]) == ("16", "8", "fp32")
    assert "--enable_hybrid_engine" in argv and r["accelerator"] == "cpu"
    # `python -m dschat.plan --json` with the same flags on one GPU of the same size.
    planner = run([*argv, "--gpus_per_node", "1", "--num_nodes", "1", "--gpu_memory", f"{r['device_bytes']}B", "--json"])
    capsys.readouterr()
    assert [(p["name"], p["predicted_bytes"], p["consumers"]) for p in r["phases"]] == [
        (p["name"], p["peak_bytes"], p["consumers"]) for p in planner["phases"]]
    assert r["plan"]["peak_bytes_per_gpu"] == planner["peak_bytes_per_gpu"]
    # The plan decodes with dschat's Hybrid Engine, and so did the run.
    assert r["hybrid_engine_planned"] and r["generation_loop"] == "dschat-he"


def test_its_model_states_counted_from_the_live_engines_equal_the_plan(zero3_lora_he):
    out, _ = zero3_lora_he
    (r,) = out["configs"]
    args = build_parser(3).parse_args(r["step3_argv"])
    planned = {role: {**p.state.counted(), "buckets": p.state.device["buckets"]}
               for role, p in plan_roles(args, 1, dtype="fp32", cpu_accelerator=True).items()}
    assert sorted(r["model_states"]) == ["actor", "critic", "ref", "reward"]
    for role, states in r["model_states"].items():
        assert states["predicted"] == planned[role], role
        assert states["counted"] == planned[role], role
        assert states["equal"]
    # LoRA: the actor trains only part of its parameters; ZeRO-3's resident bucket is counted.
    actor = r["model_states"]["actor"]["counted"]
    assert 0 < actor["grads"] < actor["params"] and actor["buckets"] > 0


def test_without_cuda_it_measures_no_phase_and_says_so(zero3_lora_he):
    out, results = zero3_lora_he
    (r,) = out["configs"]
    assert [p["name"] for p in r["phases"]] == ["generation", "scoring", "actor training", "critic training",
                                               "optimizer step"]
    assert all(p["measured_bytes"] is None and p["error"] is None and p["within"] is None for p in r["phases"])
    assert r["resident"]["measured_bytes"] is None
    text = results.read_text()
    assert "the phases' peaks (activations, logits, caches, gathers) need CUDA's allocator" in text
    rows = [line for line in text.splitlines() if line.startswith("| llama-z3-lora-he | ")]
    assert len(rows) == 6 + 4  # five phases and the resident row; four engines
    assert all("| needs CUDA |" in line for line in rows[:6])
    assert all(line.endswith("| yes |") for line in rows[6:])


class ScriptedAllocator:
    """``torch.cuda``'s four calls the meter makes, on a CPU: the n-th peak read returns n, so each
    phase's figure says which read it came from."""

    def __init__(self):
        self.reads = 0

    def synchronize(self, device):
        pass

    def reset_peak_memory_stats(self, device):
        pass

    def max_memory_allocated(self, device):
        self.reads += 1
        return self.reads

    def memory_allocated(self, device):
        return 7


def test_each_phase_is_bracketed_where_the_planner_draws_it(tmp_path):
    """On a real tiny trainer, with an allocator that only counts its reads: the measured step starts and
    stops the phases in the step's order (the warm-up step reads nothing), the optimizer step's figure is
    the larger of the actor's and the critic's."""
    bench = _bench()
    args = bench.parse_args(["--configs", "opt-z0", *TINY, "--results", ""])
    allocator = ScriptedAllocator()
    r = bench.run_config("opt-z0", args, "fp32", tmp_path, allocator=allocator)
    phases = ["generation", "scoring", "actor training", "optimizer step", "critic training", "optimizer step"]
    assert r["phase_log"] == [x for phase in phases for x in ("start", phase)]
    assert allocator.reads == 6  # one measured step
    measured = {p["name"]: p["measured_bytes"] for p in r["phases"]}
    assert measured == {"generation": 1, "scoring": 2, "actor training": 3, "critic training": 5, "optimizer step": 6}
    for p in r["phases"]:
        assert p["error"] == (p["predicted_bytes"] - p["measured_bytes"]) / p["measured_bytes"]
    assert r["resident"]["measured_bytes"] == 7


def test_the_table_compares_predicted_with_measured_by_hand():
    bench = _bench()
    phase = {"name": "generation", "predicted_bytes": 11_000_000_000, "measured_bytes": 10_000_000_000,
             "error": 0.1, "within": True}
    low = {"name": "scoring", "predicted_bytes": 8_000_000_000, "measured_bytes": 10_000_000_000,
           "error": -0.2, "within": False}
    result = {"config": "c", "phases": [phase, low],
              "resident": {"predicted_bytes": 5_000_000_000, "measured_bytes": 4_000_000_000}}
    lines = bench.phase_table([result, {"config": "d", "error": "its process exited with 1"}])
    assert lines[0] == "| configuration | phase | predicted GB | measured GB | error % | within 10 % |"
    assert lines[2] == "| c | generation | 11.000 | 10.000 | +10.0 | yes |"
    assert lines[3] == "| c | scoring | 8.000 | 10.000 | -20.0 | no |"
    # resident: (5 - 4) / 4 = +25 %
    assert lines[4] == "| c | resident after the step | 5.000 | 4.000 | +25.0 | no |"
    assert lines[5] == "| d | (failed: its process exited with 1) | | | | |"


def test_the_gpu_session_runs_configurations_it_knows(tmp_path):
    """`.ci/gpu`'s commands for this script, printed by a dry run, are ones the script accepts, at the
    session's protocol: two configurations in `session`, the other four in `plan-accuracy`."""
    bench = _bench()
    env = {**os.environ, "DRY_RUN": "1", "LOG_DIR": str(tmp_path), "SESSION_S": "100000"}
    commands = []
    for what in ("session", "plan-accuracy"):
        out = subprocess.run(["bash", str(REPO / ".ci" / "gpu"), what], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=120, check=True).stdout
        commands += [line.split("): ", 1)[1] for line in out.splitlines()
                     if "benchmarks/plan_accuracy.py" in line and "): " in line]
    assert len(commands) == 2, commands
    chosen = []
    for command in commands:
        words = shlex.split(command)
        args = bench.parse_args(words[words.index("benchmarks/plan_accuracy.py") + 1:])
        assert (args.prompt_len, args.answer_len, args.batch, args.dtype) == (256, 256, 16, "bf16")
        assert args.results == str(tmp_path / "results-gpu.md") and args.actor is None
        chosen.append(args.configs)
    session, rest = chosen
    assert len(session) == 2 and sorted(session + rest) == sorted(bench.DEFAULT_CONFIGS)
