"""e2e_rlhf.py's rerun hint (``To rerun only this step: ...`` after a step fails, and the command
step 3's missing-input error names): parsed again, it runs the failed step exactly as it ran."""
from __future__ import annotations

import shlex
import sys
import warnings

import pytest

from helpers import REPO

sys.path.insert(0, str(REPO))
import e2e_rlhf as E  # noqa: E402

#: Every e2e option that changes a step's flags, folders or launch, away from its default.
GIVEN = ["--actor-model", "tiny-llama", "--reward-model", "tiny-opt", "--actor-zero-stage", "2",
         "--reward-zero-stage", "1", "--deployment-type", "single_node", "--num-gpus", "2", "--num-nodes", "1",
         "--master-port", "29611", "--master-addr", "10.0.0.1", "--seed", "7", "--save-format", "both",
         "--save-interval", "5", "--algorithm", "grpo", "--num-generations", "2",
         "--reward-fn", "dschat.rewards:gold", "--reward-fn", "dschat.rewards:length",
         "--env", "dschat.envs_examples:calculator", "--max-turns", "3", "--env-timeout", "12.5",
         "--preflight", "off", "--report", "never", "--resume"]


def _parse(argv: list[str]):
    config = E.load_e2e_config()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the non-default ZeRO stages' warning
        args = E.parse_args(argv, config)
    dep = config.deployment(args.deployment_type)
    args.actor_model = args.actor_model or dep.default_actor or config.default_actor  # as main() does
    args.reward_model = args.reward_model or dep.default_reward or config.default_reward
    return args, dep


def _settings(args, dep, step: int) -> dict:
    run_ = E.build_steps(args, dep)[step - 1]
    launch = E.plan(run_.recipe, run_.params, run_.extra, repo_root=REPO, require_main=False, launcher_overrides={
        "hostfile": args.hostfile, "num_gpus": args.num_gpus, "num_nodes": args.num_nodes,
        "master_addr": args.master_addr, "master_port": args.master_port})
    return {"recipe": run_.recipe.id, "params": run_.params, "extra": run_.extra, "output": run_.output_dir,
            "launch": launch.argv, "save_interval": args.save_interval, "resume": args.resume,
            "preflight": args.preflight, "report": args.report, "deployment": dep.name}


@pytest.mark.parametrize("step", [1, 2, 3])
def test_the_hint_reruns_the_step_with_every_option_that_shaped_it(step, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    args, dep = _parse(GIVEN + ["--hostfile", str(hostfile), "--output-dir", str(tmp_path / "out")])
    hint = E.reproduce_command(args, dep, step)
    argv = shlex.split(hint)
    assert argv[:4] == ["python", "e2e_rlhf.py", "--step", str(step)]
    again, dep_again = _parse(argv[2:])
    assert again.step == [step]
    assert _settings(again, dep_again, step) == _settings(args, dep, step)
    assert ("--seed", "7") == tuple(argv[argv.index("--seed"):argv.index("--seed") + 2])


def test_a_default_run_gives_a_short_hint(tmp_path):
    args, dep = _parse(["--deployment-type", "cpu", "--reward-model", "tiny-llama", "--output-dir", str(tmp_path)])
    assert E.reproduce_command(args, dep, 2) == (
        f"python e2e_rlhf.py --step 2 --reward-model tiny-llama --deployment-type cpu --output-dir {tmp_path}")
    assert E.reproduce_command(args, dep, 3).startswith(
        f"python e2e_rlhf.py --step 3 --actor-model {args.actor_model} --reward-model tiny-llama ")
