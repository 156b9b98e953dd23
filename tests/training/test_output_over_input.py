"""No step saves its model over a model it trains from (dschat.training.run_setup.refuse_saving_over_inputs):
``--output_dir`` equal to step 1's ``--model_name_or_path``, or step 3's ``--output_dir`` holding the
``actor/`` it starts from, is one line (exit 2) before anything loads, and the input is untouched."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dschat.errors import EXIT_USAGE, UserError, cli_main
from dschat.models.registry import resolve_model_path
from dschat.models.save import is_model_artifact
from dschat.training.run_setup import refuse_saving_over_inputs

from helpers.step3 import base_argv as step3_argv, refused_in_process
from helpers.steps import base_argv, load_script


def model_copy(folder: Path) -> Path:
    shutil.copytree(resolve_model_path("tiny-opt"), folder)
    return folder


def listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_rule(tmp_path):
    out = tmp_path / "out"
    (out / "lora_adapter").mkdir(parents=True)
    (out / "mine" / "base").mkdir(parents=True)
    (out / "best" / "actor").mkdir(parents=True)
    saves = {"the model": (out, is_model_artifact)}
    with pytest.raises(UserError, match=r"^--m .*out is the folder this run saves the model into \(.*out\), so the "
                                        r"save would replace the model it trains from; give another --output_dir$"):
        refuse_saving_over_inputs({"--m": str(out)}, saves)
    with pytest.raises(UserError, match=r"lora_adapter is inside the folder this run saves the model into"):
        refuse_saving_over_inputs({"--m": str(out / "lora_adapter")}, saves)  # an entry the save replaces
    with pytest.raises(UserError, match=r"is inside the folder this run saves the best models into"):
        refuse_saving_over_inputs({"--m": str(out / "best" / "actor")}, {"the best models": (out / "best", None)})
    # Not replaced: the user's own subfolder, a hub id, a flag not given; a relative spelling is the same folder.
    refuse_saving_over_inputs({"--m": str(out / "mine" / "base"), "--h": "org/model", "--n": None}, saves)
    with pytest.raises(UserError):
        refuse_saving_over_inputs({"--m": str(out / "mine" / ".." / "lora_adapter")}, saves)


def test_a_lora_adapters_base_model_is_an_input_too(tmp_path):
    """--model_name_or_path an adapter elsewhere whose base is --output_dir: the save replaced the base,
    the adapter then sat on other weights and the earlier model was gone. Down the chain too."""
    import json

    out = tmp_path / "out"
    out.mkdir()
    saves = {"the model": (out, is_model_artifact)}
    adapter, outer = tmp_path / "adapter", tmp_path / "outer"
    for folder, base in ((adapter, f" {out} "), (outer, str(adapter))):  # the loaders strip the name
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": base}))
    for given in (adapter, outer):
        with pytest.raises(UserError) as err:
            refuse_saving_over_inputs({"--m": str(given)}, saves)
        assert str(err.value).startswith(f"--m {given} is a LoRA adapter whose base model {out} is the folder this run "
                                         f"saves the model into ({out}), so the save would replace")
    # A base elsewhere, a hub id, and a chain that leads back to itself are no output folder.
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "org/m"}))
    refuse_saving_over_inputs({"--m": str(outer)}, saves)
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": str(outer)}))
    refuse_saving_over_inputs({"--m": str(outer)}, saves)


def test_adapter_base_reads_the_base_an_adapter_folder_names(tmp_path):
    """dschat.paths.adapter_base, which the input check and the weights' fingerprint both follow: the
    stripped name; None for a model folder (config.json beside) and for a config naming no base."""
    import json

    from dschat.paths import adapter_base

    folder = tmp_path / "adapter"
    folder.mkdir()
    assert adapter_base(folder) is None  # no adapter_config.json
    for base, expected in ((" org/m \n", "org/m"), (None, None), (3, None), ("", "")):
        (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base}))
        assert adapter_base(folder) == expected, base
    (folder / "adapter_config.json").write_text("{not json")
    assert adapter_base(folder) is None
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/m"}))
    (folder / "config.json").write_text("{}")  # a model folder that also holds an adapter config
    assert adapter_base(folder) is None


def test_a_short_name_is_not_the_same_named_folder(tmp_path, monkeypatch):
    """A short name (tiny-opt) wins over a same-named folder in the working directory, so saving into
    that folder replaces no input."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-opt").mkdir()
    refuse_saving_over_inputs({"--m": "tiny-opt"}, {"the model": (Path("tiny-opt"), is_model_artifact)})


def test_step1_refuses_its_input_model_folder_as_output_dir(tmp_path, capsys):
    model = model_copy(tmp_path / "model")
    before = listing(model)
    code = cli_main(load_script("step1").main, base_argv(str(model), tmp_path / "data", "--output_dir", str(model)))
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error: ")] == [
        f"error: --model_name_or_path {model} is the folder this run saves the model into ({model}), so the save "
        "would replace the model it trains from; give another --output_dir"]
    assert listing(model) == before


def test_step3_refuses_an_output_dir_whose_actor_folder_it_starts_from(tmp_path, critic_dirs, data_cache, capsys):
    out = tmp_path / "out"
    actor = model_copy(out / "actor")
    argv = step3_argv("tiny-opt", critic_dirs["tiny-opt"], data_cache, "--output_dir", str(out))
    argv[argv.index("--actor_model_name_or_path") + 1] = str(actor)
    line = refused_in_process(argv, capsys)
    assert line == (f"error: --actor_model_name_or_path {actor} is the folder this run saves the actor into "
                    f"({out / 'actor'}), so the save would replace the model it trains from; give another --output_dir")
    # best.earlier/ goes when a fresh run sets an earlier best/ aside: not an input either.
    earlier = model_copy(tmp_path / "out2" / "best.earlier" / "actor")
    argv[argv.index("--actor_model_name_or_path") + 1] = str(earlier)
    argv[argv.index("--output_dir") + 1] = str(tmp_path / "out2")
    line = refused_in_process(argv + ["--eval_interval", "1", "--eval_judge", "gold"], capsys)
    assert "is inside the folder this run saves the earlier best models into" in line


def test_a_fresh_step3_that_would_lose_an_older_best_earlier_stops_before_anything_loads(tmp_path, critic_dirs,
                                                                                        data_cache, capsys):
    """A fresh run sets an earlier run's best/ aside as best.earlier/; with best.earlier/ there already
    (the run before that one's), that would lose it: one line, before any model loads."""
    out = tmp_path / "out"
    for folder, run in (("best", "second"), ("best.earlier", "first")):
        (out / folder).mkdir(parents=True)
        (out / folder / "best.json").write_text(f'{{"step": 6, "by": "gold", "score": 0.1, "run": "{run}"}}')
    before = listing(out)
    argv = step3_argv("tiny-opt", critic_dirs["tiny-opt"], data_cache, "--output_dir", str(out), "--eval_interval",
                      "1", "--eval_judge", "gold")
    line = refused_in_process(argv, capsys)
    assert line.startswith(f"error: {out / 'best'} holds an earlier run's best models and {out / 'best.earlier'}")
    assert "move" in line and "--save_best_by none" in line
    assert listing(out) == before


def test_a_step_says_it_started_only_once_its_flags_passed(tmp_path, monkeypatch, capsys):
    """The launcher keeps the log of a step that exits 2 after start-up (dschat.launch): setup_run
    creates $DSCHAT_STARTED_FILE; a step refusing its flags never gets there."""
    from types import SimpleNamespace

    from dschat.paths import STARTED_FILE_VAR
    from dschat.training.run_setup import setup_run

    started = tmp_path / "started"
    monkeypatch.setenv(STARTED_FILE_VAR, str(started))
    model = model_copy(tmp_path / "model")
    assert cli_main(load_script("step1").main, base_argv(str(model), tmp_path / "data", "--output_dir",
                                                         str(model))) == EXIT_USAGE
    assert not started.exists()
    setup_run(SimpleNamespace(output_dir=None, dtype="fp32", seed=1))
    assert started.is_file()


def test_an_earlier_runs_critic_and_ema_are_set_aside_never_deleted(tmp_path):
    from dschat.training.run_setup import set_unsaved_models_aside

    out = tmp_path / "out"
    for name in ("critic", "actor_ema", "notes"):
        (out / name).mkdir(parents=True)
    (out / "critic" / "config.json").write_text("critic")
    (out / "actor_ema" / "model.safetensors").write_text("ema")
    (out / "notes" / "todo.txt").write_text("mine")
    # The critic is this run's reward model: it stays. The EMA goes to actor_ema.earlier.
    notices = set_unsaved_models_aside(out, ["critic", "actor_ema", "notes"], [str(out / "critic"), "tiny-opt", None])
    assert notices == [f"{out / 'critic'} holds an earlier run's model (this run saved none there); it is an input of "
                       "this run, so it stays",
                       f"{out / 'actor_ema'} holds an earlier run's model (this run saved none there): now in "
                       f"{out / 'actor_ema.earlier'}"]
    assert (out / "critic" / "config.json").read_text() == "critic"
    assert (out / "actor_ema.earlier" / "model.safetensors").read_text() == "ema"
    assert (out / "notes" / "todo.txt").read_text() == "mine"  # no model files: not a model folder
    (out / "actor_ema").mkdir()
    (out / "actor_ema" / "config.json").write_text("older")
    assert set_unsaved_models_aside(out, ["actor_ema"], []) == [
        f"{out / 'actor_ema'} holds an earlier run's model (this run saved none there); {out / 'actor_ema.earlier'} "
        "exists already, so it stays: move one of them yourself"]
    assert (out / "actor_ema" / "config.json").read_text() == "older"


def test_a_config_json_that_is_no_models_is_never_replaced(tmp_path, capsys):
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.json").write_text('{"learning_rate": 3}')  # the user's own settings, --output_dir .
    main = load_script("step1").main
    argv = base_argv("tiny-opt", tmp_path / "data", "--output_dir", str(project))
    assert cli_main(main, argv) == EXIT_USAGE
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")] == [
        f"error: {project / 'config.json'} is not a model's config (no JSON object with model_type or "
        f"architectures), and this run saves the model into {project}, replacing its config.json; give another "
        "--output_dir, or move that file"]
    assert listing(project) == {"config.json": b'{"learning_rate": 3}'}
    (project / "config.json").write_text('{"model_type": "opt"}')  # an earlier model's: replaced as before
    from dschat.training.run_setup import refuse_replacing_foreign_config
    refuse_replacing_foreign_config({"the model": (project, is_model_artifact)})


FOREIGN_CONFIG_RANKS = r'''
import json, sys
import torch.distributed as dist

rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
from dschat.errors import UserError
from dschat.models.save import is_model_artifact
from dschat.training.run_setup import refuse_replacing_foreign_config

# Each rank its own folder, as on two nodes without a shared disk: rank 0's holds the user's settings.
try:
    refuse_replacing_foreign_config({"the model": (f"{out}/node{rank}", is_model_artifact)})
    result = "no error"
except UserError as err:
    result = str(err)
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(result, f)
dist.barrier()
from dschat.runtime.dist import destroy_gloo_group
destroy_gloo_group()  # the steps' teardown: gc first (a bare destroy aborted now and then)
'''


def test_every_rank_stops_with_rank_zeros_line_on_a_foreign_config(tmp_path):
    """Rank 0 saves, so its folder decides; every rank raises its line (none waits for a rank 0
    that stopped), and another node's folder of that name does not count."""
    from helpers.two_ranks import run_gloo_ranks

    def ranks_say(folder: Path, rank0_config: str, rank1_config: str) -> list:
        for rank, config in ((0, rank0_config), (1, rank1_config)):
            (folder / f"node{rank}").mkdir(parents=True)
            (folder / f"node{rank}" / "config.json").write_text(config)
        return run_gloo_ranks(FOREIGN_CONFIG_RANKS, folder)

    refused = tmp_path / "refused"
    line = (f"{refused / 'node0' / 'config.json'} is not a model's config (no JSON object with model_type or "
            f"architectures), and this run saves the model into {refused / 'node0'}, replacing its config.json; "
            "give another --output_dir, or move that file")
    assert ranks_say(refused, '{"learning_rate": 3}', '{"model_type": "opt"}') == [line, line]
    # Rank 1's folder is not the saving rank's: its config.json does not count.
    assert ranks_say(tmp_path / "fine", '{"architectures": ["OPTForCausalLM"]}', "not json") == ["no error", "no error"]


def test_a_linked_critic_folder_stays_with_a_notice(tmp_path):
    from dschat.training.run_setup import set_unsaved_models_aside

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "config.json").write_text("{}")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "critic").symlink_to(tmp_path / "elsewhere")
    assert set_unsaved_models_aside(tmp_path / "out", ["critic"], []) == [
        f"{tmp_path / 'out' / 'critic'} is a link, left as it is: the model it leads to is not this run's"]
    assert (tmp_path / "out" / "critic").is_symlink() and (tmp_path / "elsewhere" / "config.json").is_file()


@pytest.mark.parametrize("step", ["step1", "dpo", "step3"])
def test_a_reward_model_as_the_causal_lm_is_refused_before_anything_loads(step, tmp_path, critic_dirs, data_cache,
                                                                          capsys):
    """A step-2 output has no language-model head: as step 1's or DPO's model or step 3's actor, one was
    drawn at random (separately for DPO's policy and reference) and the run trained on it."""
    reward = critic_dirs["tiny-llama"]
    out = tmp_path / "out"
    if step == "step3":
        argv = step3_argv("tiny-llama", reward, data_cache, "--output_dir", str(out))
        argv[argv.index("--actor_model_name_or_path") + 1] = str(reward)
        line, flag = refused_in_process(argv, capsys), "--actor_model_name_or_path"
    else:
        code = cli_main(load_script(step).main, base_argv(str(reward), tmp_path / "data", "--output_dir", str(out)))
        err = capsys.readouterr().err
        assert code == EXIT_USAGE and "Traceback" not in err
        [line] = [line for line in err.splitlines() if line.startswith("error: ")]
        flag = "--model_name_or_path"
    assert line == (f"error: {flag} {reward} is a reward model (a step-2 output or a sequence classifier), which has "
                    "no language-model head; pass a causal LM: a base model or a step-1 output")
    assert not out.exists()


@pytest.mark.parametrize("step", ["step1", "dpo", "step2"])
def test_a_finished_model_of_another_step_in_output_dir_is_never_replaced(step, tmp_path, critic_dirs, capsys):
    """Step 2 into step 1's --output_dir replaced the fine-tuned model with the reward model (exit 0, no
    word), and step 1 or DPO into step 2's replaced the reward model: one line before anything loads,
    the model untouched. A model of the step's own kind there is its own earlier output, replaced."""
    out = tmp_path / "out"
    if step == "step2":
        model_copy(out)  # a language model, as step 1 leaves it
        held = "a language model (a step-1 or DPO output, or a base model)"
    else:
        shutil.copytree(critic_dirs["tiny-opt"], out)
        held = "a reward model (a step-2 output)"
    before = listing(out)
    code = cli_main(load_script(step).main, base_argv("tiny-opt", tmp_path / "data", "--output_dir", str(out)))
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error: ")] == [
        f"error: --output_dir {out} holds {held}, and this run would save its "
        f"{'reward' if step == 'step2' else 'language'} model over it, losing it; pass another --output_dir, or move "
        "that model out first"]
    assert listing(out) == before


def test_a_model_of_the_same_kind_or_no_model_in_output_dir_is_not_refused(tmp_path, critic_dirs):
    from dschat.training.run_setup import refuse_replacing_another_kind

    lm, reward, notes = model_copy(tmp_path / "lm"), critic_dirs["tiny-opt"], tmp_path / "notes"
    notes.mkdir()
    (notes / "config.json").write_text('{"model_type": "opt"}')  # a config without weights: no model
    for folder, saves_reward in ((lm, False), (reward, True), (notes, True), (notes, False), (tmp_path / "none", True)):
        refuse_replacing_another_kind({"the model": (folder, is_model_artifact)}, reward=saves_reward)
    refuse_replacing_another_kind({"the best models": (lm, None)}, reward=True)  # replaced whole: dschat's own
