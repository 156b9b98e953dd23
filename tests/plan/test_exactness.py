"""The planner's model-state bytes equal those of step 3's live DeepSpeed engines, to the byte.

For the actor, the reference, the critic, the reward model and the ``--enable_ema`` copy, built by
``DeepSpeedRLHFEngine`` from step-3 flags (fp32 on the CPU accelerator): parameters, fp32 master
partitions, Adam's moments and gradients, ZeRO-1/2's optimizer-offload buffers
(tests/plan/engine_bytes.py says how each is counted from the engines' tensors), and the reduction
buckets still allocated after a backward (the resident ones: ZeRO-3's one buffer; ZeRO-1/2 free
theirs after the reduction), on one rank in this process and on two ranks under the ``deepspeed``
launcher (the most loaded rank).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dschat.plan.roles import plan_roles

from helpers.step3 import base_argv, make_critic_folder, step3_main
from helpers.steps import deepspeed_cmd, run_cli

HERE = Path(__file__).resolve().parent

Z = ("--actor_zero_stage", "--critic_zero_stage")
LORA = ("--actor_lora_dim", "4", "--critic_lora_dim", "4")
OFFLOAD = ("--offload", "--offload_reference_model")

ONE_RANK = {
    "opt-zero0": ("tiny-opt", (Z[0], "0", Z[1], "0")),
    "opt-zero1-ema": ("tiny-opt", (Z[0], "1", Z[1], "1", "--enable_ema")),
    "opt-zero3-lora-ema": ("tiny-opt", (Z[0], "3", Z[1], "3", *LORA, "--enable_ema")),
    "llama-zero3-zero2-offload": ("tiny-llama", (Z[0], "3", Z[1], "2", *OFFLOAD)),
    "llama-zero2-zero3-lora-only": ("tiny-llama", (Z[0], "2", Z[1], "3", *LORA, "--only_optimize_lora")),
    "llama-zero0-zero1-actor-lora": ("tiny-llama", (Z[0], "0", Z[1], "1", "--actor_lora_dim", "4")),
}
TWO_RANKS = {
    "opt-zero3": ("tiny-opt", (Z[0], "3", Z[1], "3")),
    "opt-zero2-zero1": ("tiny-opt", (Z[0], "2", Z[1], "1")),
    "llama-zero0-zero3-lora-offload": ("tiny-llama", (Z[0], "0", Z[1], "3", *LORA, "--offload")),
    "llama-zero3-zero2-offload-lora-only": ("tiny-llama", (Z[0], "3", Z[1], "2", "--offload", *LORA,
                                                            "--only_optimize_lora")),
}


@pytest.fixture(scope="module")
def critics(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plan_critics")
    return {m: make_critic_folder(m, root / m) for m in ("tiny-opt", "tiny-llama")}


def _planned(model: str, critic: Path, data: Path, extra: tuple[str, ...], world: int) -> dict[str, dict[str, int]]:
    args = step3_main().parse_args(base_argv(model, critic, data, *extra))
    return {role: {**plan.state.counted(), "buckets": plan.state.device["buckets"]} for role, plan in
            plan_roles(args, world, dtype="fp32", cpu_accelerator=True).items()}


@pytest.fixture(scope="module")
def one_rank_counts(critics, tmp_path_factory) -> dict[str, dict]:
    import engine_bytes  # noqa: PLC0415 - the counting script beside this file

    data = tmp_path_factory.mktemp("plan_data")
    return {name: (engine_bytes.count_case(model, str(critics[model]), str(data), list(extra)),
                   _planned(model, critics[model], data, extra, 1))
            for name, (model, extra) in ONE_RANK.items()}


@pytest.mark.parametrize("case", sorted(ONE_RANK))
def test_one_rank_model_state_bytes_are_exact(one_rank_counts, case):
    live, planned = one_rank_counts[case]
    assert planned == live  # every category the live engines hold is planned


@pytest.fixture(scope="module")
def two_rank_counts(critics, tmp_path_factory) -> dict[str, tuple]:
    root = tmp_path_factory.mktemp("plan_two_ranks")
    cases = [(model, str(critics[model]), list(extra)) for model, extra in TWO_RANKS.values()]
    proc = run_cli(deepspeed_cmd(str(HERE / "engine_bytes.py"), str(root / "counts"), str(root / "data"),
                                 json.dumps(cases)), cwd=HERE.parents[1])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((root / f"counts.{r}").read_text()) for r in (0, 1)]
    out = {}
    for i, (name, (model, extra)) in enumerate(TWO_RANKS.items()):
        live = {role: {k: max(r[i][role][k] for r in ranks) for k in ranks[0][i][role]} for role in ranks[0][i]}
        out[name] = (live, _planned(model, critics[model], root / "data", extra, 2))
    return out


@pytest.mark.parametrize("case", sorted(TWO_RANKS))
def test_two_rank_model_state_bytes_are_exact(two_rank_counts, case):
    live, planned = two_rank_counts[case]
    assert planned == live  # every category the live engines hold is planned
