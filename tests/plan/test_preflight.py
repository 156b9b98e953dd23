"""Step 3's memory preflight in-process: on a GPU a run that cannot fit stops in one line before the
data or any model is loaded (after the tokenizers); ``--preflight off`` skips it; a critic-free run
is planned with the engines it builds (also one scored by ``main``'s own reward function); a model
the planner cannot read is a note and the run goes on. (On the CPU the printed plan
is checked in rlhf/test_step3_smoke.py's off-policy run.)

The accelerator is the one thing set by hand: :func:`dschat.plan.preflight.device_memory` reports a
CUDA device of 1 MB, so the tiny models cannot fit; the rest is step 3's own ``main``."""
from __future__ import annotations

import pytest

from dschat.errors import UserError
from dschat.models.registry import resolve_model_path
from dschat.plan import preflight as preflight_module
from dschat.plan.cli import build_parser, plan
from dschat.training import step_data

from helpers.step3 import base_argv, refused_in_process, step3_main
from helpers.two_ranks import run_gloo_ranks

pytestmark = pytest.mark.usefixtures("one_thread")

ONE_MB = 10**6


class ReachedTheData(Exception):
    """Raised where step 3 would read its prompt data (after the preflight, before the models)."""


@pytest.fixture
def small_cuda(monkeypatch) -> list[str]:
    """A 1 MB "CUDA" device for the preflight; reading the prompt data is recorded (the actor it
    tokenises for) and stops the run."""
    loads: list[str] = []

    def prompt_datasets(args, *rest, **kwargs):
        loads.append(str(args.actor_model_name_or_path))
        raise ReachedTheData(args.actor_model_name_or_path)

    monkeypatch.setattr(preflight_module, "device_memory", lambda: ("cuda", ONE_MB))
    monkeypatch.setattr(step_data, "prompt_datasets", prompt_datasets)
    return loads


def test_a_run_that_cannot_fit_stops_in_one_line_before_any_model(small_cuda, critic_dirs, data_cache, capsys):
    line = refused_in_process(base_argv("tiny-opt", critic_dirs["tiny-opt"], data_cache), capsys)
    assert line.startswith("error: step 3 does not fit: ") and " per GPU, " in line
    assert any(f": {phase} needs " in line for phase in ("generation", "scoring", "actor training",
                                                         "critic training", "optimizer step")), line
    assert "0.00 GB GPU allows" in line and "--preflight off" in line
    assert small_cuda == []  # stopped before the data, so before every model


def test_preflight_off_skips_it(small_cuda, critic_dirs, data_cache, capsys):
    with pytest.raises(ReachedTheData):
        step3_main().main(base_argv("tiny-opt", critic_dirs["tiny-opt"], data_cache, "--preflight", "off"))
    out = capsys.readouterr().out
    assert "preflight" not in out and "peak/GPU" not in out
    assert small_cuda == ["tiny-opt"]


def test_a_model_the_planner_cannot_read_is_a_note_and_the_run_goes_on(small_cuda, lora_inputs, data_cache, capsys):
    # The actor as a PEFT LoRA adapter folder (step 3 merges it into its base): no config.json to plan from.
    adapter = lora_inputs["actor"] / "lora_adapter"
    argv = base_argv("tiny-opt-quirk", lora_inputs["critic"], data_cache, actor=adapter)
    with pytest.raises(ReachedTheData):
        step3_main().main(argv)
    notes = [x for x in capsys.readouterr().out.splitlines() if "memory preflight" in x]
    assert len(notes) == 1 and notes[0].startswith("note: the memory preflight cannot plan this run (")
    assert "has no config.json" in notes[0] and "step 3 goes on without it" in notes[0]


def test_the_preflight_plans_the_critic_step3_builds_after_saying_where_it_comes_from(small_cuda, monkeypatch,
                                                                                       critic_dirs, data_cache, capsys):
    # A critic folder of another tokenizer than the actor's (tiny-llama's beside a tiny-opt actor): step 3
    # starts the critic from the actor with a fresh value head, says so, and plans that critic, not the folder's.
    argv = base_argv("tiny-opt", critic_dirs["tiny-llama"], data_cache)
    monkeypatch.setattr(preflight_module, "device_memory", lambda: ("cuda", 10**12))
    with pytest.raises(ReachedTheData):  # a device that holds everything: the run goes on to the data
        step3_main().main(argv)
    out = capsys.readouterr().out.splitlines()
    note = next(i for i, x in enumerate(out) if x.startswith("critic: the tokenizer of ")
                and x.endswith("the critic starts from the actor tiny-opt with a fresh value head"))
    assert note < next(i for i, x in enumerate(out) if x.startswith("memory preflight: "))  # the note first
    # A device between the two plans: the folder's (smaller) critic would fit, the one the run builds does not.
    args = build_parser().parse_args([*argv, "--gpus_per_node", "1", "--num_nodes", "1"])
    gpu = int(plan(args, critic_from_actor=False)["peak_bytes_per_gpu"] / 0.9) + 1
    assert plan(args, gpu_bytes=gpu, critic_from_actor=False)["fits"]
    assert not plan(args, gpu_bytes=gpu, critic_from_actor=True)["fits"]
    monkeypatch.setattr(preflight_module, "device_memory", lambda: ("cuda", gpu))
    line = refused_in_process(argv, capsys)
    assert line.startswith("error: step 3 does not fit: ") and small_cuda == ["tiny-opt"]  # the first run's data


def _without_critic(argv: list[str]) -> list[str]:
    at = argv.index("--critic_model_name_or_path")
    return argv[:at] + argv[at + 2:]


def test_a_critic_free_run_scored_by_functions_is_planned_without_critic_and_reward_model(small_cuda, data_cache,
                                                                                           capsys):
    argv = _without_critic(base_argv("tiny-opt", "unused", data_cache, "--algorithm", "grpo", "--num_generations", "2",
                                     "--reward_fn", "dschat.rewards:gold"))
    line = refused_in_process(argv, capsys)  # planned (the actor and the reference): it cannot fit 1 MB
    assert line.startswith("error: step 3 does not fit: ") and "critic training" not in line
    assert small_cuda == []


def test_a_critic_free_run_scored_by_mains_reward_fn_is_planned_without_the_reward_model(small_cuda, data_cache,
                                                                                        capsys):
    # main's Python reward_fn replaces the reward model: the flags alone cannot show it, step 3 tells
    # the preflight (a reward model planned without a critic folder would be a different line).
    argv = _without_critic(base_argv("tiny-opt", "unused", data_cache, "--algorithm", "grpo", "--num_generations", "2"))
    with pytest.raises(UserError) as raised:
        step3_main().main(argv, reward_fn=lambda prompts, answers: [0.0] * len(answers))
    assert str(raised.value).startswith("step 3 does not fit: ") and "critic training" not in str(raised.value)
    assert small_cuda == []


RANKS = r'''
import json, sys
import torch.distributed as dist
from types import SimpleNamespace

from dschat.errors import UserError
from dschat.plan import preflight as pf

rank, store, out, actor, critic = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
# Rank 0's "GPU" holds everything, rank 1's only 1 MB: the run cannot fit on rank 1.
pf.device_memory = lambda: ("cuda", 10**15 if rank == 0 else 10**6)
argv = ["--actor_model_name_or_path", actor, "--critic_model_name_or_path", critic]
try:
    pf.step3_preflight(SimpleNamespace(preflight="on"), argv, SimpleNamespace(rank=rank, world_size=2, dtype="fp32"),
                       four_models=True)
    outcome = "went on"
except UserError as err:
    outcome = f"error: {err}"
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(outcome, f)
from dschat.runtime.dist import destroy_gloo_group
destroy_gloo_group()  # the steps' teardown: gc first (a bare destroy aborted now and then)
'''


def test_every_rank_refuses_when_one_rank_cannot_fit(tmp_path, critic_dirs):
    # The ranks plan for the run's smallest device and agree: none goes on to wait for the others.
    outcomes = run_gloo_ranks(RANKS, tmp_path, str(resolve_model_path("tiny-opt")), str(critic_dirs["tiny-opt"]))
    assert all(o.startswith("error: step 3 does not fit: ") and "0.00 GB GPU allows" in o for o in outcomes), outcomes
