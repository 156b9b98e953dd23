"""Launch recipes (configs/*.yaml -> dschat.recipes): loading, validation, rendering, generated scripts.

The literal argv lists below are upstream's scripts (microsoft/DeepSpeedExamples,
applications/DeepSpeed-Chat/training/*/training_scripts) with their positionals filled in; upstream's
`--disable_dropout` / `--disable_actor_dropout` are written `--dropout 0.0` / `--actor_dropout 0.0`
as upstream itself later did.
"""
from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from dschat.errors import UserError, cli_main
from dschat.recipes import cli as recipe_cli
from dschat.recipes import loading as recipe_loading
from dschat.recipes import recipe as recipe_mod
from dschat.recipes import scripts as recipe_scripts
from dschat.recipes import steps as recipe_steps
from dschat.runtime import fs, trust

from helpers import REPO

OPT_DATA = ["Dahoas/rm-static", "Dahoas/full-hh-rlhf", "Dahoas/synthetic-instruct-gptj-pairwise",
            "yitingxie/rlhf-reward-datasets"]

EXPECTED_IDS = {
    "step1": {"opt/single_gpu/1.3b", "opt/single_gpu/6.7b_lora", "opt/single_node/1.3b", "opt/single_node/1.3b_lora",
              "opt/single_node/6.7b", "opt/single_node/13b", "opt/single_node/30b_lora", "opt/multi_node/66b",
              "llama2/7b", "llama2/7b_lora", "other_language/chinese", "other_language/japanese",
              "cpu/smollm2-135m", "cpu/tiny"},
    "step2": {"opt/single_gpu/350m", "opt/single_node/350m", "opt/multi_node/350m", "llama2/7b", "llama2/7b_lora",
              "cpu/smollm2-135m", "cpu/tiny"},
    "dpo": {"opt/single_gpu/350m", "opt/single_node/350m", "opt/multi_node/350m", "llama2/7b", "llama2/7b_lora",
            "cpu/smollm2-135m", "cpu/tiny"},
    "step3": {"opt/single_gpu/1.3b", "opt/single_gpu/6.7b_lora", "opt/single_node/1.3b", "opt/single_node/1.3b_lora",
              "opt/single_node/sweep",
              "opt/single_node/6.7b", "opt/single_node/13b", "opt/single_node/30b_lora", "opt/multi_node/66b",
              "llama2/7b", "llama2/7b_lora", "llama2/7b_mixz", "cpu/smollm2-135m", "cpu/tiny"},
}


def test_every_recipe_loads_and_validates():
    everything = recipe_loading.load_all(REPO)
    assert {k: set(v) for k, v in everything.items()} == EXPECTED_IDS
    for key, recipes in everything.items():
        for recipe in recipes.values():
            assert recipe.flag("output_dir") == "{output_dir}"
            assert recipe.step.key == key
            # Every recipe renders with its defaults or names what it needs.
            try:
                argv = recipe.render()
            except UserError as err:
                assert "actor_model" in str(err) and recipe.defaults["actor_model"] is None
                continue
            assert "--deepspeed" in argv


def test_step1_single_node_1_3b_upstream_argv():
    recipe = recipe_loading.get_recipe("step1", "opt/single_node/1.3b", REPO)
    assert recipe.launcher.argv() == []
    assert recipe.render({"output_dir": "/o", "zero_stage": ""}) == [
        "--data_path", *OPT_DATA, "--data_split", "2,4,4", "--model_name_or_path", "facebook/opt-1.3b",
        "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "8", "--max_seq_len", "512",
        "--learning_rate", "9.65e-6", "--weight_decay", "0.", "--num_train_epochs", "16",
        "--gradient_accumulation_steps", "1", "--lr_scheduler_type", "cosine", "--num_warmup_steps", "0",
        "--seed", "1234", "--zero_stage", "2", "--deepspeed", "--enable_tensorboard", "--tensorboard_path", "/o",
        "--output_dir", "/o",
    ]


def test_step1_single_gpu_upstream_argv_and_positionals():
    recipe = recipe_loading.get_recipe("step1", "opt/single_gpu/1.3b", REPO)
    assert recipe.launcher.argv() == ["--num_gpus", "1"]
    params = recipe.params_from_positionals(["out1", "3"])
    assert recipe.render(params) == [
        "--model_name_or_path", "facebook/opt-1.3b", "--gradient_accumulation_steps", "8", "--lora_dim", "128",
        "--zero_stage", "3", "--enable_tensorboard", "--tensorboard_path", "out1", "--deepspeed",
        "--output_dir", "out1",
    ]
    # Empty positionals take upstream's defaults (./output, ZeRO 0).
    assert recipe.render(recipe.params_from_positionals(["", ""]))[6:9] == ["--zero_stage", "0", "--enable_tensorboard"]
    assert recipe.render()[-2:] == ["--output_dir", "./output"]


@pytest.mark.parametrize("given", [["--output_dir", "/elsewhere"], ["--output_dir=/elsewhere"],
                                   ["--output_dir", "/first", "--output_dir", "/elsewhere"]])
def test_an_output_dir_given_as_a_flag_is_the_one_tensorboard_writes_in(given):
    """A flag after the positionals replaces the recipe's: the recipe's TensorBoard folder, made from
    the same {output_dir}, follows it (it stayed ./output, written in the working directory)."""
    recipe = recipe_loading.get_recipe("step1", "opt/single_gpu/1.3b", REPO)
    argv = recipe.render(recipe.params_from_positionals(["out1", ""]), given)
    assert argv[argv.index("--tensorboard_path") + 1] == "/elsewhere" and argv[-len(given):] == given
    assert "out1" not in argv


def test_a_tensorboard_path_given_as_a_flag_moves_only_tensorboard():
    recipe = recipe_loading.get_recipe("step1", "opt/single_gpu/1.3b", REPO)
    argv = recipe.render(recipe.params_from_positionals(["out1", ""]), ["--tensorboard_path", "/tb"])
    assert argv[argv.index("--tensorboard_path") + 1] == "/tb" and argv[argv.index("--output_dir") + 1] == "out1"
    step3 = recipe_loading.get_recipe("step3", "cpu/tiny", REPO)  # step 3's model flags stand for its positionals
    argv = step3.render({"actor_model": "a", "critic_model": "c"}, ["--actor_model_name_or_path", "b"])
    assert argv.count("--actor_model_name_or_path") == 1 and argv[argv.index("--actor_model_name_or_path") + 1] == "b"


def test_step2_single_gpu_upstream_argv():
    recipe = recipe_loading.get_recipe("step2", "opt/single_gpu/350m", REPO)
    assert recipe.launcher.argv() == ["--num_gpus", "1"]
    assert recipe.render({"output_dir": "rm"}) == [
        "--model_name_or_path", "facebook/opt-350m", "--num_padding_at_beginning", "1", "--weight_decay", "0.1",
        "--dropout", "0.0", "--gradient_accumulation_steps", "4", "--zero_stage", "0", "--enable_tensorboard",
        "--tensorboard_path", "rm", "--deepspeed", "--output_dir", "rm",
    ]


def test_dpo_single_node_upstream_argv():
    recipe = recipe_loading.get_recipe("dpo", "opt/single_node/350m", REPO)
    assert recipe.render() == [
        "--data_path", *OPT_DATA, "--data_split", "2,4,4", "--model_name_or_path", "facebook/opt-350m",
        "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--max_seq_len", "512",
        "--learning_rate", "5e-5", "--weight_decay", "0.1", "--num_train_epochs", "1", "--dropout", "0.0",
        "--gradient_accumulation_steps", "1", "--lr_scheduler_type", "cosine", "--num_warmup_steps", "0",
        "--seed", "1234", "--zero_stage", "0", "--deepspeed", "--output_dir", "./output",
    ]


def test_step3_single_node_1_3b_upstream_argv():
    recipe = recipe_loading.get_recipe("step3", "opt/single_node/1.3b", REPO)
    assert recipe.launcher.argv() == ["--master_port", "12346"]
    # Upstream's AdamG012/* defaults are upstream-format checkpoints dschat's step 3 refuses: required here.
    with pytest.raises(UserError, match="needs actor_model"):
        recipe.render()
    assert recipe.render({"actor_model": "/sft", "critic_model": "/rm"}) == [
        "--data_path", "Dahoas/rm-static", "--data_split", "2,4,4",
        "--actor_model_name_or_path", "/sft",
        "--critic_model_name_or_path", "/rm",
        "--num_padding_at_beginning", "1", "--per_device_generation_batch_size", "4",
        "--per_device_training_batch_size", "4", "--generation_batches", "1", "--ppo_epochs", "1",
        "--max_answer_seq_len", "256", "--max_prompt_seq_len", "256", "--actor_learning_rate", "9.65e-6",
        "--critic_learning_rate", "5e-6", "--num_train_epochs", "1", "--lr_scheduler_type", "cosine",
        "--gradient_accumulation_steps", "1", "--actor_dropout", "0.0", "--num_warmup_steps", "100",
        "--deepspeed", "--seed", "1234", "--enable_hybrid_engine", "--actor_zero_stage", "2",
        "--critic_zero_stage", "2", "--enable_ema", "--output_dir", "./output", "--enable_tensorboard",
        "--tensorboard_path", "./output",
    ]


def test_step3_positionals_in_upstream_order():
    recipe = recipe_loading.get_recipe("step3", "opt/single_gpu/1.3b", REPO)
    params = recipe.params_from_positionals(["/a", "/c", "3", "", "/out"])
    assert recipe.render(params) == [
        "--actor_model_name_or_path", "/a", "--critic_model_name_or_path", "/c", "--actor_zero_stage", "3",
        "--critic_zero_stage", "0", "--num_padding_at_beginning", "1", "--gradient_accumulation_steps", "2",
        "--deepspeed", "--actor_lora_dim", "128", "--enable_hybrid_engine", "--actor_gradient_checkpointing",
        "--actor_dropout", "0.0", "--output_dir", "/out",
    ]


def test_step3_llama2_mixz_upstream_argv():
    recipe = recipe_loading.get_recipe("step3", "llama2/7b_mixz", REPO)
    assert recipe.script == "llama2/run_llama2_7b_mixz.sh"
    argv = recipe.render({"actor_model": "A", "critic_model": "C"})
    assert argv[argv.index("--actor_zero_stage"):] == [
        "--actor_zero_stage", "3", "--critic_zero_stage", "3", "--enable_mixed_precision_lora",
        "--actor_lora_dim", "64", "--critic_lora_dim", "64", "--critic_lora_module_name", "layers.",
        "--actor_lora_module_name", "layers.", "--output_dir", "./output_step3_llama2",
    ]
    assert "--enable_hybrid_engine" not in argv
    assert argv[argv.index("--per_device_generation_batch_size") + 1] == "1"
    assert "--offload_reference_model" in argv


def test_empty_hard_coded_paths_give_a_clear_error():
    # Upstream's 6.7b / 30b / LoRA step-3 scripts hard-coded `ACTOR_MODEL_PATH=` (empty).
    for rid in ("opt/single_node/6.7b", "opt/single_node/30b_lora", "opt/single_gpu/6.7b_lora"):
        recipe = recipe_loading.get_recipe("step3", rid, REPO)
        with pytest.raises(UserError, match=r"needs actor_model \(positional \$1, ACTOR_MODEL_PATH\)"):
            recipe.render()
        with pytest.raises(UserError, match=r"needs critic_model \(positional \$2"):
            recipe.render({"actor_model": "/a", "critic_model": ""})


def test_bad_parameters_are_rejected():
    recipe = recipe_loading.get_recipe("step1", "opt/single_node/1.3b", REPO)
    with pytest.raises(UserError, match="zero_stage must be 0, 1, 2 or 3"):
        recipe.render({"zero_stage": "4"})
    with pytest.raises(UserError, match="at most 2 positional values"):
        recipe.params_from_positionals(["a", "2", "x"])
    with pytest.raises(UserError, match="no parameter actor_model"):
        recipe.render({"actor_model": "x"})


def test_extra_flags_replace_the_recipes_and_unset_drops():
    recipe = recipe_loading.get_recipe("step1", "opt/single_node/1.3b", REPO)
    argv = recipe.render({}, ["--learning_rate", "1e-4", "--data_path", "local/jsonfile", "x", "--print_loss"],
                         unset=["enable_tensorboard"])
    assert argv.count("--learning_rate") == 1 and argv.count("--data_path") == 1
    assert argv[-6:] == ["--learning_rate", "1e-4", "--data_path", "local/jsonfile", "x", "--print_loss"]
    assert "--enable_tensorboard" not in argv and "Dahoas/rm-static" not in argv
    with pytest.raises(UserError, match="must be flags"):
        recipe.render({}, ["stray"])
    with pytest.raises(UserError, match="no flag --nope to unset"):
        recipe.render({}, unset=["nope"])
    # --name=value form and negative numbers as values.
    assert recipe_mod.split_flag_groups(["--a=1", "--b", "-1", "--c"]) == [("a", ["--a=1"]), ("b", ["--b", "-1"]), ("c", ["--c"])]


def test_unknown_recipe_suggests_close_ids():
    with pytest.raises(UserError, match="did you mean opt/single_node/1.3b"):
        recipe_loading.get_recipe("step1", "opt/single_node/1.3", REPO)
    # The upstream script path is accepted too.
    assert recipe_loading.get_recipe("3", "opt/single_gpu/run_6.7b_lora.sh", REPO).id == "opt/single_gpu/6.7b_lora"
    with pytest.raises(UserError, match="unknown step"):
        recipe_steps.step_spec("step4")


def _write_config(tmp_path: Path, text: str) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(REPO / "configs", root / "configs")
    (root / "training").mkdir()
    (root / "configs" / "step2.yaml").write_text(text, encoding="utf-8")
    recipe_loading._CACHE.clear()
    return root


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("    flags: {seed: 1, output_dir: \"{output_dir}\"}\n", "never used"),
        ("    flags: {zero_stage: \"{zero}\", output_dir: \"{output_dir}\"}\n", "unknown parameter"),
        ("    flags: {zero_stage: \"{zero_stage}\", output_dir: x}\n", "output_dir"),
        ("    flags: {zero_stage: \"{zero_stage}\", offload: false, output_dir: \"{output_dir}\"}\n", "not a value"),
        ("    flags: {Zero-Stage: \"{zero_stage}\", output_dir: \"{output_dir}\"}\n", "lower_snake_case"),
    ],
)
def test_validation_catches_broken_recipes(tmp_path, body, message):
    text = ("step: step2\nrecipes:\n  x/y:\n    description: d\n    launcher: {}\n"
            "    defaults: {output_dir: ./o, zero_stage: 0}\n" + body)
    root = _write_config(tmp_path, text)
    with pytest.raises(UserError, match=message):
        recipe_loading.load_step_recipes("step2", root)


def test_validation_catches_bad_launcher_and_defaults(tmp_path):
    base = "step: step2\nrecipes:\n  x/y:\n    description: d\n    flags: {zero_stage: \"{zero_stage}\", output_dir: \"{output_dir}\"}\n"
    root = _write_config(tmp_path, base + "    launcher: {gpus: 1}\n    defaults: {output_dir: ./o, zero_stage: 0}\n")
    with pytest.raises(UserError, match="unknown launcher options gpus"):
        recipe_loading.load_step_recipes("step2", root)
    root = _write_config(tmp_path / "b", base + "    launcher: {}\n    defaults: {output_dir: ./o}\n")
    with pytest.raises(UserError, match="defaults must give exactly"):
        recipe_loading.load_step_recipes("step2", root)


_HEAD = "step: step2\nrecipes:\n  x/y:\n    description: d\n"
_FLAGS = "    flags: {zero_stage: \"{zero_stage}\", output_dir: \"{output_dir}\"}\n"
_DEFAULTS = "    defaults: {output_dir: ./o, zero_stage: 0}\n"


@pytest.mark.parametrize(("body", "message"), [
    # YAML keeps the last of a repeated key: the first value was dropped without a word.
    (_FLAGS.replace("{zero", "{learning_rate: 1e-3, learning_rate: 5e-5, zero") + "    launcher: {}\n" + _DEFAULTS,
     r"step2.yaml, line 5: the key 'learning_rate' is given twice in one mapping \(YAML would keep only the last\); "
     "keep one$"),
    (_FLAGS + "    launcher: {}\n" + _DEFAULTS + "  x/y:\n    description: e\n", "the key 'x/y' is given twice"),
    (_FLAGS + "    launcher: {}\n" + _DEFAULTS + "    upstream: [a, b]\n",
     r"recipe x/y: upstream: expected one line of text, got \['a', 'b'\]"),
    (_FLAGS + "    launcher: {}\n" + _DEFAULTS + "    upstream: \"x.sh\\necho INJECTED\"\n",
     "upstream: expected one line of text"),  # it was written into the generated script as a command
    (_FLAGS + "    launcher: {}\n    defaults: {output_dir: [a, b], zero_stage: 0}\n",
     "default output_dir: expected one line of text"),
    (_FLAGS + "    launcher: {hostfile: [a, b]}\n" + _DEFAULTS, "launcher hostfile: expected one line of text"),
    (_FLAGS + "    launcher: {num_gpus: -3}\n" + _DEFAULTS,
     "launcher num_gpus: expected a whole number from 1, got '-3'"),
    (_FLAGS + "    launcher: {master_port: 99999}\n" + _DEFAULTS, "master_port: expected a whole number from 1 to 65535"),
    (_FLAGS + "    launcher: {}\n" + _DEFAULTS + "    eta_seconds: -5\n", "eta_seconds: expected a whole number from 0"),
    (_FLAGS + "    launcher: {}\n" + _DEFAULTS + "    env: {\"A B\": x}\n", "env name 'A B' is not a variable name"),
    (_FLAGS.replace("{zero", "{gradient_checkpointing: True, zero") + "    launcher: {}\n" + _DEFAULTS,
     "flag gradient_checkpointing: write 'True' as true"),
])
def test_a_recipe_of_the_wrong_shape_is_one_line(tmp_path, body, message):
    root = _write_config(tmp_path, _HEAD + body)
    with pytest.raises(UserError, match=message):
        recipe_loading.load_step_recipes("step2", root)


def test_recipe_values_are_kept_as_written():
    # YAML would read 9.65e-6 as a float and print it back as 9.65e-06; recipes keep the text.
    recipe = recipe_loading.get_recipe("step1", "opt/single_node/6.7b", REPO)
    assert recipe.flag("learning_rate") == "9.65e-6" and recipe.flag("weight_decay") == "0."


def test_upstream_guidance_is_in_the_recipes():
    single_node = recipe_loading.get_recipe("step1", "opt/single_node/1.3b", REPO)
    assert single_node.flag("weight_decay") == "0." and single_node.flag("num_train_epochs") == "16"
    assert single_node.flag("dropout") is None  # SFT keeps the model's dropout
    rm = recipe_loading.get_recipe("step2", "opt/single_node/350m", REPO)
    assert (rm.flag("weight_decay"), rm.flag("dropout"), rm.flag("num_train_epochs")) == ("0.1", "0.0", "1")
    for rid in ("opt/single_node/1.3b", "cpu/smollm2-135m"):
        ppo = recipe_loading.get_recipe("step3", rid, REPO)
        assert ppo.flag("actor_dropout") == "0.0" and ppo.flag("enable_ema") is True
        assert ppo.flag("num_train_epochs") == "1"
        assert ppo.flag("per_device_generation_batch_size") == ppo.flag("per_device_training_batch_size")
    upstream = recipe_loading.get_recipe("step3", "opt/single_node/1.3b", REPO)
    assert (upstream.flag("actor_learning_rate"), upstream.flag("critic_learning_rate")) == ("9.65e-6", "5e-6")


def test_cpu_recipes_use_the_embedded_model_and_data():
    for key in ("step1", "step2", "dpo", "step3"):
        recipe = recipe_loading.get_recipe(key, "cpu/smollm2-135m", REPO)
        # Step 2 also reads the pairs of an SFT actor's own answers (dschat/builtin-samples).
        expected = ("dschat/builtin", "dschat/builtin-samples") if key == "step2" else "dschat/builtin"
        assert recipe.flag("data_path") == expected
        assert recipe.flag("dtype") == "fp32"
        assert recipe.env["DS_ACCELERATOR"] == "cpu"
        assert recipe.eta_seconds and recipe.eta_seconds > 0
        if key != "step3":
            assert recipe.flag("model_name_or_path") == "smollm2-135m"


def test_cpu_demo_watches_step3_with_the_gold_judge():
    """The demo's step 3 evaluates held-out prompts before the first step, midway and at the last
    PPO step (issue 27), with the gold judge of the embedded data, and keeps no best/ copy."""
    ppo = recipe_loading.get_recipe("step3", "cpu/smollm2-135m", REPO)
    interval, steps = int(ppo.flag("eval_interval")), int(ppo.flag("test_stop_step"))
    assert 0 < interval < steps and steps % interval == 0
    assert ppo.flag("eval_judge") == "gold" and ppo.flag("save_best_by") == "none"
    # One generation batch per evaluation: the cost measured in docs/demo_experiments.md.
    assert int(ppo.flag("eval_prompts")) == int(ppo.flag("per_device_generation_batch_size"))


# ------------------------------------------------------------------------------------------------
# Against the real step scripts: every recipe parses with its main.py's own parser.
# ------------------------------------------------------------------------------------------------
def _load_main(spec: recipe_steps.StepSpec):
    path = REPO / spec.main_py
    if not path.is_file():
        pytest.skip(f"{spec.main_py} does not exist yet")
    module_spec = importlib.util.spec_from_file_location(f"_dschat_main_{spec.key}", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # dataclasses in main.py look their module up
    sys.path.insert(0, str(path.parent))
    try:
        module_spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


@pytest.mark.parametrize("step", ["step1", "step2", "dpo", "step3"])
def test_every_recipe_parses_with_its_main_py(step):
    spec = recipe_steps.step_spec(step)
    module = _load_main(spec)
    fill = {"actor_model": "/actor", "critic_model": "/critic"}
    for recipe in recipe_loading.load_step_recipes(spec, REPO).values():
        params = {k: v for k, v in fill.items() if k in spec.params}
        argv = recipe.render(params)
        try:
            args = module.parse_args(argv)
        except SystemExit as exc:  # argparse: unknown flag or bad value
            pytest.fail(f"{step} {recipe.id}: main.py rejects {argv} (exit {exc.code})")
        assert args.output_dir == recipe.defaults["output_dir"]
        assert getattr(args, "deepspeed", True) is True


# ------------------------------------------------------------------------------------------------
# Generated shell scripts and READMEs
# ------------------------------------------------------------------------------------------------
def test_committed_scripts_match_the_recipes():
    problems = recipe_scripts.check_generated(REPO)
    assert problems == [], "run `python -m dschat.recipes write-scripts`:\n" + "\n".join(problems)


def test_check_detects_drift_and_write_repairs_it(tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(REPO / "configs", root / "configs")
    for spec in recipe_steps.STEPS.values():
        shutil.copytree(REPO / spec.folder / "training_scripts", root / spec.folder / "training_scripts")
    recipe_loading._CACHE.clear()
    assert recipe_scripts.check_generated(root) == []
    script = root / "training/step1_supervised_finetuning/training_scripts/opt/single_gpu/run_1.3b.sh"
    script.write_text(script.read_text() + "echo edited\n")
    stale = root / "training/step3_rlhf_finetuning/training_scripts/opt/run_old.sh"
    stale.write_text("#!/bin/bash\n# Generated from configs/step3.yaml (old)\n")
    problems = recipe_scripts.check_generated(root)
    assert any("out of date" in p and "run_1.3b.sh" in p for p in problems)
    assert any("not generated" in p and "run_old.sh" in p for p in problems)
    recipe_scripts.write_generated(root)
    assert recipe_scripts.check_generated(root) == [] and not stale.exists()


def test_script_text_is_a_thin_wrapper():
    recipe = recipe_loading.get_recipe("step3", "opt/single_node/1.3b", REPO)
    text = recipe_scripts.render_script(recipe)
    assert "shell=True" not in text
    assert text.splitlines()[-1] == (
        'exec "${PYTHON:-python3}" -m dschat.launch --repo-root "$ROOT" step3 opt/single_node/1.3b --script-args "$@"')
    # Five levels up from training/step3_rlhf_finetuning/training_scripts/opt/single_node/.
    assert 'dirname "${BASH_SOURCE[0]}")/../../../../.."' in text
    assert "ACTOR_MODEL_PATH=(required)" in text and "ACTOR_ZERO_STAGE=2" in text


# ------------------------------------------------------------------------------------------------
# Which checkout runs: only places the user chose, owned by the user, writable by nobody else
# ------------------------------------------------------------------------------------------------
def _fake_checkout(path: Path) -> Path:
    (path / "configs").mkdir(parents=True)
    shutil.copy2(REPO / "configs" / "step1.yaml", path / "configs" / "step1.yaml")
    (path / "training").mkdir()
    return path


def test_the_working_directorys_parents_are_not_searched(tmp_path, monkeypatch):
    # A checkout planted in a parent (such as /tmp) of where the user works is not used, when dschat
    # is installed without -e (its package is not in a checkout).
    planted = _fake_checkout(tmp_path / "shared")
    (planted / "project").mkdir()
    monkeypatch.chdir(planted / "project")
    monkeypatch.delenv("DSCHAT_REPO_ROOT", raising=False)
    monkeypatch.setattr(recipe_loading, "__file__", str(tmp_path / "site-packages" / "dschat" / "recipes" / "loading.py"))
    with pytest.raises(UserError, match="looks in the checkout it was imported from and in the working directory only"):
        recipe_loading.find_repo_root()
    monkeypatch.chdir(planted)  # the working directory itself is a place the user chose
    assert recipe_loading.find_repo_root() == planted.resolve()
    monkeypatch.setattr(recipe_loading, "__file__", str(REPO / "dschat" / "recipes" / "loading.py"))
    assert recipe_loading.find_repo_root() == REPO  # the checkout the package comes from goes first


def test_a_checkout_others_can_write_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    checkout = _fake_checkout(tmp_path / "repo")
    monkeypatch.delenv("DSCHAT_REPO_ROOT", raising=False)
    checkout.chmod(0o757)
    with pytest.raises(UserError, match=r"--repo-root .* is not safe to run: other users can write to it \(mode 0757\).*chmod go-w"):
        recipe_loading.find_repo_root(checkout)
    monkeypatch.setenv("DSCHAT_REPO_ROOT", str(checkout))
    assert cli_main(recipe_cli.main, ["list"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "DSCHAT_REPO_ROOT" in err and "other users can write to it" in err
    checkout.chmod(0o775)  # group-writable: refused unless the group is the user's private one
    monkeypatch.setattr(trust, "_private_group", lambda gid, uid: False)
    with pytest.raises(UserError, match="its group can write to it"):
        recipe_loading.find_repo_root(checkout)
    monkeypatch.setattr(trust, "_private_group", lambda gid, uid: True)
    assert recipe_loading.find_repo_root(checkout) == checkout.resolve()
    checkout.chmod(0o755)
    assert recipe_loading.find_repo_root(checkout) == checkout.resolve()


def test_a_checkout_whose_step_scripts_or_recipes_others_can_change_is_refused(tmp_path):
    """The checkout's own folder is not enough: what runs is training/<step>/main.py, configs/ and the
    dschat package put on PYTHONPATH; another account that can change any of them runs its code."""
    import os

    checkout = _fake_checkout(tmp_path / "repo").resolve()
    assert recipe_loading.find_repo_root(checkout) == checkout
    step = checkout / "training" / "step1_supervised_finetuning"
    step.mkdir()
    (step / "main.py").write_text("print('the step')\n")
    assert recipe_loading.find_repo_root(checkout) == checkout
    step.chmod(0o777)
    with pytest.raises(UserError, match=rf"--repo-root {checkout} is not safe to run: {step}: its group and others "
                                        rf"can write to it \(mode 0777\).*chmod go-w -R {checkout / 'training'}$"):
        recipe_loading.find_repo_root(checkout)
    step.chmod(0o755)
    # A step folder that is a link: what it leads to is checked too.
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(step, elsewhere / "step2_reward_model_finetuning")
    (elsewhere / "step2_reward_model_finetuning" / "main.py").chmod(0o666)
    (checkout / "training" / "step2_reward_model_finetuning").symlink_to(elsewhere / "step2_reward_model_finetuning")
    with pytest.raises(UserError, match=r"step2_reward_model_finetuning/main.py: its group and others can write"):
        recipe_loading.find_repo_root(checkout)
    (elsewhere / "step2_reward_model_finetuning" / "main.py").chmod(0o644)
    assert recipe_loading.find_repo_root(checkout) == checkout
    recipe = checkout / "configs" / "step1.yaml"
    recipe.chmod(0o646)
    with pytest.raises(UserError, match=rf"{recipe}: other users can write to it"):
        recipe_loading.find_repo_root(checkout)
    recipe.chmod(0o644)
    if os.geteuid() == 0:  # a file another account owns, as it would have planted it
        os.chown(recipe, 65533, 65533)
        with pytest.raises(UserError, match=rf"{recipe}: it belongs to uid 65533, not to you.*: use your own clone$"):
            recipe_loading.find_repo_root(checkout)
        os.chown(recipe, 0, 0)
    assert recipe_loading.find_repo_root(checkout) == checkout


def test_a_checkout_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    import os

    checkout = _fake_checkout(tmp_path / "repo").resolve()
    real_stat = os.stat

    def stat(path, *args, **kwargs):
        info = real_stat(path, *args, **kwargs)
        if Path(path) == checkout:  # as if another account had made it
            info = os.stat_result((info.st_mode, info.st_ino, info.st_dev, info.st_nlink, 4242, info.st_gid,
                                   info.st_size, info.st_atime, info.st_mtime, info.st_ctime))
        return info

    monkeypatch.setattr(os, "stat", stat)
    with pytest.raises(UserError, match=f"--repo-root {checkout} is not safe to run: it belongs to uid 4242, not to you"):
        recipe_loading.find_repo_root(checkout)


def test_a_real_second_user_is_refused_a_checkout_it_does_not_own(tmp_path):
    """Run as uid 65534 (setpriv) against a checkout owned by uid 65533: refused, one line, exit 2."""
    import os
    import subprocess

    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to act as two users (running as uid "
                    f"{os.geteuid()}, setpriv {'found' if setpriv else 'missing'})")
    base = Path(tempfile.mkdtemp(prefix="dschat-owner-"))  # readable by the other uid, unlike tmp_path
    try:
        base.chmod(0o755)
        checkout = _fake_checkout(base / "repo")
        for path in (checkout, *checkout.rglob("*")):
            os.chown(path, 65533, 65533)
        # The code under test, where uid 65534 can read it: this checkout may sit in a private folder
        # (a clone under `mktemp -d` is 0700), which the other user cannot enter.
        package = base / "code"
        shutil.copytree(REPO / "dschat", package / "dschat", ignore=shutil.ignore_patterns("__pycache__"))
        code = ("import sys; sys.path.insert(0, %r); from dschat.recipes.cli import main; from dschat.errors import cli_main; "
                "raise SystemExit(cli_main(main, ['--repo-root', %r, 'validate']))" % (str(package), str(checkout)))
        proc = subprocess.run([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code],
                              capture_output=True, text=True, timeout=60, cwd="/")
        if "Permission denied" in proc.stderr and "dschat" not in proc.stderr:
            pytest.skip(f"uid 65534 cannot read this Python or its packages: {proc.stderr.strip()[:200]}")
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1
        assert f"--repo-root {checkout} is not safe to run: it belongs to uid 65533, not to you (uid 65534)" in proc.stderr
    finally:
        shutil.rmtree(base)


# ------------------------------------------------------------------------------------------------
# Upstream's step-3 test matrix: its sweep/run_single.sh with 11 positionals
# ------------------------------------------------------------------------------------------------
SWEEP = REPO / "training/step3_rlhf_finetuning/training_scripts/opt/single_node/sweep/run_single.sh"


def _sweep_command(tmp_path: Path, *positionals: str) -> list[str]:
    """The main.py command line run_single.sh launches (dschat.launch --dry-run prints it)."""
    import os
    import subprocess

    dry = tmp_path / "python-dry-run"  # the scripts' $PYTHON: dschat.launch, with --dry-run added
    dry.write_text(f'#!/bin/bash\nexec {sys.executable} "$1" "$2" --dry-run "${{@:3}}"\n')
    dry.chmod(0o755)
    env = {**os.environ, "PYTHON": str(dry), "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(["bash", str(SWEEP), *positionals], cwd=SWEEP.parents[4], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if "main.py" in ln)
    return line.split()


def test_upstream_sweep_script_takes_its_eleven_positionals(tmp_path):
    # As upstream's tests/test_training.py calls it (zero3, he, offload, lora), from the step-3 folder.
    cmd = _sweep_command(tmp_path, "/m/actor", "/m/critic", "3", "3", "true", "true", "true", "false",
                         "z3_he_true_offload_true_lora_true", "true", "5")
    flags = " ".join(cmd[cmd.index(next(c for c in cmd if c.endswith("main.py"))) + 1:])
    for expected in ("--actor_model_name_or_path /m/actor", "--critic_model_name_or_path /m/critic",
                     "--actor_zero_stage 3", "--critic_zero_stage 3", "--output_dir z3_he_true_offload_true_lora_true",
                     "--save_format both", "--enable_hybrid_engine", "--offload", "--actor_lora_dim 128",
                     "--actor_lora_module_name decoder.layers.", "--enable_test_mode", "--test_stop_step 5",
                     "--data_path Dahoas/rm-static", "--per_device_training_batch_size 4", "--seed 1234"):
        assert expected in flags, (expected, flags)
    assert "--enable_mixed_precision_lora" not in flags
    # Every switch off; an empty zero stage is 2; flags after the positionals reach main.py.
    cmd = _sweep_command(tmp_path, "/m/actor", "/m/critic", "", "", "false", "false", "false", "true", "out",
                         "false", "5", "--max_answer_seq_len", "8")
    flags = " ".join(cmd)
    assert "--actor_zero_stage 2" in flags and "--actor_lora_dim 0" in flags and "--enable_mixed_precision_lora" in flags
    assert "--max_answer_seq_len 8" in flags and "--max_answer_seq_len 256" not in flags
    for absent in ("--enable_hybrid_engine", "--offload ", "--enable_test_mode", "decoder.layers."):
        assert absent not in flags + " ", absent
