"""Bad input across the CLIs: one table of (CLI, argv, expected one-line message), each case checked
for exit code 2, exactly one ``error:`` line, no traceback, and nothing written where it ran.

Every case runs in a fresh workspace ``ws`` holding ``file.txt`` (a regular file, for paths that
cannot be folders) and, for ``good_output`` cases, ``out/sentinel.txt`` (a previous good output).
After the run the workspace must be byte for byte what it was: no output folder, no data cache, no
half-written sibling. Most cases run in-process (``cli_main(main, argv)``, the exit code the CLI
would return); one or more per CLI run as a real subprocess (the interpreter's exit code and
stderr), all at once in a module fixture to keep the file fast. Each case must fail before any
model loads: a case that needs a model to be detected is a bug in the CLI's start-up checks.

Placeholders in argv: ``{ws}`` the workspace, ``{out}`` = ``{ws}/out``, ``{file}`` = ``{ws}/file.txt``,
``{shared}`` = ``{ws}/shared``, a folder anyone can write to (mode 0777, as a planted one),
``{inputs}`` the malformed data files below, ``{critic}`` a step-2 style reward-model folder,
``{tiny}`` the tiny-opt model folder. Unit tests of the
same checks live next to their modules (``test_data_adapters``, ``test_step3_guards``, ...); this
file proves each reaches the user cleanly.
"""
from __future__ import annotations

import errno
import importlib.util
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from dschat.errors import EXIT_USAGE, cli_main

from helpers import PYTHON, REPO
from helpers.step3 import make_critic_folder
from helpers.steps import cli_env


STEP1 = REPO / "training" / "step1_supervised_finetuning"
STEP2 = REPO / "training" / "step2_reward_model_finetuning"
DPO = REPO / "training" / "step2_dpo_finetuning"
STEP3 = REPO / "training" / "step3_rlhf_finetuning"

#: cli -> (script file, or None for a module run with -m), python -m module, subprocess cwd, base argv
_STEP_BASE = ("--model_name_or_path", "tiny-llama", "--data_path", "dschat/builtin", "--data_output_path",
              "{ws}/data", "--output_dir", "{out}", "--dtype", "fp32", "--max_seq_len", "32")
CLIS: dict[str, tuple[Path | None, str | None, Path | None, tuple[str, ...]]] = {
    "step1": (STEP1 / "main.py", None, STEP1, _STEP_BASE),
    "step2": (STEP2 / "main.py", None, STEP2, _STEP_BASE),
    "dpo": (DPO / "main.py", None, DPO, _STEP_BASE),
    "step3": (STEP3 / "main.py", None, STEP3, (
        "--actor_model_name_or_path", "tiny-opt", "--critic_model_name_or_path", "{critic}",
        "--data_path", "dschat/builtin", "--data_output_path", "{ws}/data", "--output_dir", "{out}",
        "--dtype", "fp32", "--max_prompt_seq_len", "16", "--max_answer_seq_len", "16",
        "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "4")),
    "e2e": (REPO / "e2e_rlhf.py", None, None, (
        "--deployment-type", "cpu", "--actor-model", "tiny-llama", "--reward-model", "tiny-llama",
        "--output-dir", "{out}")),
    "chatbot": (REPO / "inference" / "chatbot.py", None, None, ("--path", "tiny-opt")),
    "prompt_eval": (STEP1 / "prompt_eval.py", None, STEP1, (
        "--model_name_or_path_baseline", "tiny-opt", "--model_name_or_path_finetune", "tiny-opt")),
    "rw_eval": (STEP2 / "rw_eval.py", None, STEP2, ("--model_name_or_path", "{critic}")),
    "report": (None, "dschat.eval.report", None, ("--sft", "{tiny}", "--rlhf", "{tiny}", "--reward", "{critic}",
                                                  "--out", "{out}")),
    "prepare": (None, "dschat.data.prepare", None, (
        "--model_name_or_path", "tiny-llama", "--train_phase", "1", "--data_path", "dschat/builtin",
        "--data_output_path", "{out}")),
}


@dataclass(frozen=True)
class Case:
    id: str
    cli: str
    extra: tuple[str, ...]  # appended to the CLI's base argv (argparse: the last value of a flag wins)
    message: str  # a substring of the one error line
    subprocess: bool = False
    good_output: bool = False  # a previous good output in {out} that must survive


CASES = [
    # ---- step 1 (SFT)
    Case("step1/output-under-a-file", "step1", ("--output_dir", "{file}/out"), "cannot be created", subprocess=True),
    Case("step1/model-path-is-a-file", "step1", ("--model_name_or_path", "{file}"), "is a file, not a folder"),
    Case("step1/model-folder-without-config", "step1", ("--model_name_or_path", "{inputs}"),
         "not a Hugging Face model folder"),
    Case("step1/adapter-not-lora", "step1", ("--model_name_or_path", "{inputs}/ia3_adapter"),
         "is a PEFT IA3 adapter; dschat loads LoRA adapters only"),
    Case("step1/data-path-missing", "step1", ("--data_path", "{ws}/missing.jsonl"), "does not exist",
         good_output=True),
    Case("step1/data-not-json", "step1", ("--data_path", "{inputs}/not_json.jsonl"), "not_json.jsonl:1: malformed JSON"),
    Case("step1/data-row-missing-field", "step1", ("--data_path", "{inputs}/missing_chosen.jsonl"),
         "missing field 'chosen'", good_output=True),
    Case("step1/data-field-wrong-type", "step1", ("--data_path", "{inputs}/wrong_type.json"),
         "field 'chosen' must be a string or null, got int"),
    Case("step1/data-rows-not-objects", "step1", ("--data_path", "{inputs}/numbers.json"),
         "expected a JSON object with named fields"),
    Case("step1/phase-share-zero", "step1", ("--data_split", "0,5,5"), "gives phase 1 0 of its"),
    Case("step1/too-few-rows", "step1", ("--data_path", "{inputs}/one_row.jsonl"), "phase 1 eval split is empty"),
    # A save_to_disk copy saved with 0 rows answers as an empty JSON Lines file does (datasets' own
    # load_from_disk fails on it with an IndexError); any other failure reading a copy is one line.
    Case("step1/empty-save-to-disk", "step1", ("--data_path", "{inputs}/empty_saved"), "train split is empty"),
    Case("step1/damaged-save-to-disk", "step1", ("--data_path", "{inputs}/damaged_saved"),
         "cannot read the save_to_disk folder {inputs}/damaged_saved"),
    Case("step1/offload-without-zero", "step1", ("--offload",), "--offload needs ZeRO"),
    Case("step1/tensorboard-under-a-file", "step1", ("--enable_tensorboard", "--tensorboard_path", "{file}/tb"),
         "--tensorboard_path {file}/tb cannot be created"),
    Case("step1/data-cache-under-a-file", "step1", ("--data_output_path", "{file}/cache"),
         "--data_output_path {file}/cache cannot be created"),
    Case("step1/tensorboard-others-can-write", "step1", ("--enable_tensorboard", "--tensorboard_path", "{shared}"),
         "--tensorboard_path {shared} is not safe to read on a shared machine: its group and others can write"),
    Case("step1/data-cache-others-can-write", "step1", ("--data_output_path", "{shared}"),
         "--data_output_path {shared} is not safe to read on a shared machine: its group and others can write"),
    # With TensorBoard on: refused before its folder (and an events file) is made.
    Case("step1/negative-learning-rate", "step1",
         ("--learning_rate", "-1", "--enable_tensorboard", "--tensorboard_path", "{ws}/tb"),
         "--learning_rate must be a finite number >= 0, got -1.0"),
    Case("step1/negative-lora-learning-rate", "step1", ("--lora_dim", "4", "--lora_learning_rate", "-1"),
         "--lora_learning_rate must be a finite number >= 0, got -1.0"),
    Case("step1/dropout-out-of-range", "step1", ("--dropout", "2"), "--dropout must be in [0, 1)"),
    Case("step1/negative-seed", "step1", ("--seed", "-1"), "--seed must be from 0 to 4294967295 (2**32 - 1), got -1"),
    Case("step1/empty-eot-token", "step1", ("--add_eot_token", "--eot_token", ""), "--add_eot_token adds --eot_token"),
    Case("step1/one-token-rows", "step1", ("--max_seq_len", "1"), "--max_seq_len must be at least 2 for step 1"),
    Case("step1/nan-dist-timeout", "step1", ("--dist_timeout", "nan"), "--dist_timeout must be > 0 and at most"),
    # ---- step 2 (reward model)
    Case("step2/offload-without-zero", "step2", ("--offload", "--zero_stage", "0"), "--offload needs ZeRO",
         subprocess=True, good_output=True),
    Case("step2/data-without-rejected", "step2", ("--data_path", "{inputs}/no_rejected.jsonl"),
         "has no rejected responses"),
    Case("step2/data-rejected-wrong-type", "step2", ("--data_path", "{inputs}/rejected_list.jsonl"),
         "field 'rejected' must be a string or null, got list"),
    Case("step2/data-split-two-parts", "step2", ("--data_split", "1,2"), "has 2 proportion(s), expected 3"),
    Case("step2/output-is-a-file", "step2", ("--output_dir", "{file}"), "exists and is not a folder"),
    Case("step2/empty-save-to-disk-under-a-hub-name", "step2", ("--data_path", "{inputs}/Dahoas/rm-static"),
         "'Dahoas/rm-static', phase 2, train split is empty"),
    Case("step2/negative-learning-rate", "step2", ("--learning_rate", "-1"), "--learning_rate must be a finite number"),
    # ---- DPO
    Case("dpo/reference-offload-without-zero3", "dpo", ("--offload_reference_model", "--zero_stage", "2"),
         "--offload_reference_model needs --zero_stage 3", subprocess=True),
    Case("dpo/resume-and-resume-from", "dpo", ("--resume", "--resume_from", "{ws}"), "either --resume",
         good_output=True),
    Case("dpo/lora-only-without-lora", "dpo", ("--only_optimize_lora",), "also pass --lora_dim"),
    Case("dpo/negative-learning-rate", "dpo", ("--learning_rate", "-1"), "--learning_rate must be a finite number"),
    Case("dpo/seed-past-numpy", "dpo", ("--seed", "4294967296"), "--seed must be from 0 to 4294967295"),
    # ---- step 3 (PPO)
    Case("step3/reference-offload-without-actor-zero3", "step3", ("--offload_reference_model",),
         "--offload_reference_model needs --actor_zero_stage 3", subprocess=True, good_output=True),
    Case("step3/reward-offload-without-critic-zero3", "step3", ("--offload_reward_model", "--critic_zero_stage", "2"),
         "--offload_reward_model needs --critic_zero_stage 3"),
    Case("step3/offload-with-critic-zero0", "step3", ("--offload", "--actor_zero_stage", "2"),
         "pass --critic_zero_stage 2"),
    Case("step3/mixed-precision-lora-without-lora", "step3", ("--enable_mixed_precision_lora", "--actor_zero_stage", "3"),
         "needs actor LoRA and ZeRO-3"),
    Case("step3/negative-lora-dim", "step3", ("--actor_lora_dim", "-1"), "--actor_lora_dim must be >= 0"),
    Case("step3/negative-seed", "step3", ("--seed", "-5"), "--seed must be from 0 to 4294967295"),
    Case("step3/infinite-dist-timeout", "step3", ("--dist_timeout", "inf"), "--dist_timeout must be > 0 and at most"),
    Case("step3/rollout-past-the-positions", "step3", ("--max_prompt_seq_len", "400", "--max_answer_seq_len", "200"),
         "--max_prompt_seq_len + --max_answer_seq_len 600 is longer than tiny-opt can read: its opt position "
         "embeddings have 512 positions"),
    Case("step3/clip-reward-value-negative", "step3", ("--clip_reward_value", "-5"),
         "--clip_reward_value must be a number > 0"),
    Case("step3/actor-path-missing", "step3", ("--actor_model_name_or_path", "{ws}/no-actor"), "does not exist"),
    Case("step3/critic-is-a-plain-model", "step3", ("--critic_model_name_or_path", "{tiny}"),
         "is not a step-2 reward model output"),
    Case("step3/reward-model-is-a-plain-model", "step3", ("--reward_model_name_or_path", "{tiny}"),
         "--reward_model_name_or_path '{tiny}' is not a step-2 reward model output"),
    Case("step3/output-under-a-file", "step3", ("--output_dir", "{file}/out"), "cannot be created"),
    Case("step3/adapter-base-not-cached", "step3", ("--actor_model_name_or_path", "{inputs}/offline_adapter"),
         "LoRA adapter of base model 'nobody-dschat/no-such-model', which cannot be loaded here"),
    Case("step3/phase-share-zero", "step3", ("--data_split", "5,5,0"), "gives phase 3 0 of its", good_output=True),
    Case("step3/data-not-json", "step3", ("--data_path", "{inputs}/not_json.jsonl"), "malformed JSON"),
    Case("step3/ptx-data-missing", "step3", ("--unsupervised_dataset_name", "{ws}/missing.txt"), "does not exist"),
    Case("step3/empty-save-to-disk", "step3", ("--data_path", "{inputs}/empty_saved"), "phase 3, train split is empty"),
    Case("step3/ptx-empty-save-to-disk", "step3", ("--unsupervised_dataset_name", "{inputs}/empty_saved"),
         "its train split is empty"),
    Case("step3/ptx-damaged-save-to-disk", "step3", ("--unsupervised_dataset_name", "{inputs}/damaged_saved"),
         "cannot read the save_to_disk folder {inputs}/damaged_saved"),
    Case("step3/reward-fn-unimportable", "step3", ("--reward_fn", "no_such_module_i23:score"),
         "--reward_fn no_such_module_i23:score: cannot import module 'no_such_module_i23'"),
    Case("step3/reward-fn-weights-mismatch", "step3", ("--reward_fn", "dschat.rewards:gold", "--reward_fn_weight", "1",
                                                       "--reward_fn_weight", "2"),
         "2 --reward_fn_weight for 1 --reward_fn"),
    Case("step3/groups-do-not-divide-the-batch", "step3", ("--algorithm", "grpo", "--num_generations", "3"),
         "--num_generations 3 does not divide --per_device_generation_batch_size 4"),
    Case("step3/grpo-with-one-answer-per-prompt", "step3", ("--algorithm", "rloo",),
         "--algorithm rloo compares answers to the same prompt"),
    Case("step3/dr-grpo-with-ppo", "step3", ("--dr_grpo",), "--dr_grpo is a GRPO variant"),
    Case("step3/negative-actor-learning-rate", "step3", ("--actor_learning_rate", "-1"),
         "--actor_learning_rate must be a finite number >= 0, got -1.0"),
    Case("step3/negative-critic-learning-rate", "step3", ("--critic_learning_rate", "-1"),
         "--critic_learning_rate must be a finite number >= 0, got -1.0"),
    Case("step3/actor-dropout-out-of-range", "step3", ("--actor_dropout", "2"), "--actor_dropout must be in [0, 1)"),
    Case("step3/critic-dropout-out-of-range", "step3", ("--critic_dropout", "2"), "--critic_dropout must be in [0, 1)"),
    # ---- e2e_rlhf.py
    Case("e2e/actor-model-missing", "e2e", ("--step", "1", "--actor-model", "./no/such/model"),
         "--actor-model: model path './no/such/model' does not exist", subprocess=True),
    Case("e2e/reward-model-is-a-file", "e2e", ("--step", "2", "--reward-model", "{file}"), "is a file, not a folder",
         good_output=True),
    # Found before step 1 trains (it was found by step 2, after step 1's hours).
    Case("e2e/reward-model-without-tokenizer", "e2e", ("--reward-model", "{inputs}/config_only"),
         "--reward-model: {inputs}/config_only has no tokenizer files"),
    Case("e2e/output-under-a-file", "e2e", ("--output-dir", "{file}/out", "--dry-run"), "cannot be created"),
    Case("e2e/zero-gpus", "e2e", ("--step", "1", "--num-gpus", "0"), "--num-gpus must be >= 1, got 0"),
    Case("e2e/zero-nodes", "e2e", ("--step", "1", "--num-nodes", "0"), "--num-nodes must be >= 1, got 0"),
    Case("e2e/zero-generations", "e2e", ("--algorithm", "grpo", "--num-generations", "0"),
         "--num-generations must be >= 1, got 0"),
    # A step-3 flag the step refuses stops e2e before step 1 (not a preflight note, then steps 1 and 2), in
    # e2e's words: the recipe's batch is not e2e's to change, --num-generations is.
    Case("e2e/groups-do-not-divide-step-3s-batch", "e2e", ("--algorithm", "grpo", "--num-generations", "3"),
         "--num-generations 3 does not divide step 3's --per_device_generation_batch_size 2 (recipe cpu/tiny); pass "
         "--num-generations 2"),
    Case("e2e/default-groups-do-not-divide-step-3s-batch", "e2e", ("--algorithm", "grpo"),
         "--algorithm grpo answers 4 times per prompt by default (--num-generations), and 4 does not divide step 3's "
         "--per_device_generation_batch_size 2 (recipe cpu/tiny); pass --num-generations 2"),
    Case("e2e/dry-run-checks-step-flags-too", "e2e", ("--dry-run", "--algorithm", "grpo", "--num-generations", "3"),
         "--num-generations 3 does not divide step 3's"),
    Case("e2e/reward-fn-unimportable", "e2e", ("--reward-fn", "no_such_module_e2e9:fn"),
         "--reward-fn no_such_module_e2e9:fn: cannot import module 'no_such_module_e2e9'"),
    Case("e2e/reward-fn-not-callable", "e2e", ("--reward-fn", "dschat.rewards:GOLD_NO_SUCH"),
         "--reward-fn dschat.rewards:GOLD_NO_SUCH: module 'dschat.rewards' has no attribute"),
    Case("e2e/hostfile-is-a-folder", "e2e", ("--step", "1", "--hostfile", "{ws}"), "is not a file; write one line"),
    # ---- inference/chatbot.py
    Case("chatbot/path-is-a-file", "chatbot", ("--path", "{file}"), "is a file, not a folder", subprocess=True),
    Case("chatbot/zero-temperature", "chatbot", ("--sample", "--temperature", "0"), "--temperature must be > 0"),
    Case("chatbot/chat-template-missing", "chatbot", ("--format", "chat_template"), "has no chat template"),
    Case("chatbot/max-new-tokens-past-positions", "chatbot", ("--max_new_tokens", "600"),
         "--max_new_tokens 600 leaves no room for the question in the model's 512 positions"),
    # ---- eval scripts
    Case("prompt_eval/finetuned-path-missing", "prompt_eval", ("--model_name_or_path_finetune", "{ws}/no-model"),
         "does not exist", subprocess=True),
    Case("rw_eval/model-path-missing", "rw_eval", ("--model_name_or_path", "{ws}/no-model"), "does not exist",
         subprocess=True),
    Case("rw_eval/not-a-reward-model", "rw_eval", ("--model_name_or_path", "{tiny}"),
         "not a step-2 reward model output"),
    Case("rw_eval/max-seq-len-zero", "rw_eval", ("--max_seq_len", "0"), "--max_seq_len must be at least 2"),
    Case("rw_eval/max-seq-len-negative", "rw_eval", ("--max_seq_len", "-4"), "--max_seq_len must be at least 2"),
    Case("rw_eval/max-seq-len-past-the-positions", "rw_eval", ("--max_seq_len", "100000"),
         "--max_seq_len 100000 is longer than {critic} can read"),
    Case("report/rlhf-folder-missing", "report", ("--rlhf", "{ws}/no-actor"), "no config.json", subprocess=True),
    Case("report/reward-is-not-a-reward-model", "report", ("--reward", "{tiny}"), "not a step-2 reward model output",
         good_output=True),
    Case("report/out-under-a-file", "report", ("--out", "{file}/report"), "--out {file}/report cannot be created"),
    Case("prepare/cache-under-a-file", "prepare", ("--data_output_path", "{file}/cache"), "cannot be created"),
    Case("prepare/cache-others-can-write", "prepare", ("--data_output_path", "{shared}"),
         "--data_output_path {shared} is not safe to read"),
]


# ------------------------------------------------------------------------------------------------ inputs


def _rows(n: int, **fields: Any) -> str:
    row = {"prompt": " Human: How do volcanoes work? Assistant:", "chosen": " Lava cools into rock.",
           "rejected": " Whatever.", **fields}
    return "".join(json.dumps({k: v for k, v in row.items() if v is not None}) + "\n" for _ in range(n))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Malformed and too-small datasets (the local-file format of dschat.data.local_files)."""
    folder = tmp_path_factory.mktemp("bad_inputs")
    (folder / "not_json.jsonl").write_text("this is not JSON\n")
    (folder / "missing_chosen.jsonl").write_text(_rows(20, chosen=None))
    (folder / "wrong_type.json").write_text(json.dumps([{"prompt": " Human: hi Assistant:", "chosen": 3}]))
    (folder / "numbers.json").write_text("[1, 2, 3]")
    (folder / "no_rejected.jsonl").write_text(_rows(20, rejected=None))
    (folder / "rejected_list.jsonl").write_text(_rows(20, rejected=["a", "b"]))
    (folder / "one_row.jsonl").write_text(_rows(1))
    _save_to_disk_copies(folder)
    (folder / "config_only").mkdir()  # a model folder whose tokenizer files were not copied
    (folder / "config_only" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    # PEFT adapter folders: one not LoRA, one whose base is not in the (offline) hub cache.
    for name, kind, base in (("ia3_adapter", "IA3", "tiny-llama"),
                             ("offline_adapter", "LORA", "nobody-dschat/no-such-model")):
        (folder / name).mkdir()
        config = {"peft_type": kind, "base_model_name_or_path": base}
        (folder / name / "adapter_config.json").write_text(json.dumps(config))
        (folder / name / "adapter_model.safetensors").write_bytes(b"")
    return folder


def _save_to_disk_copies(folder: Path) -> None:
    """``DatasetDict.save_to_disk`` copies: with 0 rows (as a folder, and under a hub name), and one
    whose Arrow file is damaged."""
    from datasets import Dataset, DatasetDict, Features, Value

    features = Features({c: Value("string") for c in ("prompt", "chosen", "rejected")})
    empty = Dataset.from_dict({c: [] for c in features}, features=features)
    for name in ("empty_saved", "Dahoas/rm-static"):
        DatasetDict({"train": empty, "test": empty}).save_to_disk(str(folder / name))
    rows = Dataset.from_dict({c: ["text"] * 20 for c in features}, features=features)
    DatasetDict({"train": rows}).save_to_disk(str(folder / "damaged_saved"))
    for arrow in (folder / "damaged_saved" / "train").glob("*.arrow"):
        arrow.write_bytes(arrow.read_bytes()[:40])


@pytest.fixture(scope="module")
def fixed(inputs: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The placeholders that do not change per case."""
    from dschat.models.registry import resolve_model_path

    critic = str(make_critic_folder("tiny-opt", tmp_path_factory.mktemp("critic") / "tiny-opt"))
    resolve_model_path("tiny-llama")  # built once here: the cases themselves must build no model
    return {"inputs": str(inputs), "critic": critic, "tiny": resolve_model_path("tiny-opt")}


@pytest.fixture
def no_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad input must be refused before any model is built or loaded (in-process cases)."""
    from transformers import PreTrainedModel

    def refuse(self: Any, *args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"{type(self).__name__} was built before the bad input was refused")

    monkeypatch.setattr(PreTrainedModel, "__init__", refuse)


def _workspace(root: Path, case: Case) -> dict[str, str]:
    root.mkdir(parents=True, exist_ok=True)
    (root / "file.txt").write_text("a regular file\n")
    (root / "shared").mkdir()
    (root / "shared").chmod(0o777)  # what a folder another user planted in /tmp looks like
    if case.good_output:
        (root / "out").mkdir()
        (root / "out" / "sentinel.txt").write_text("a previous good output\n")
    return {"ws": str(root), "out": str(root / "out"), "file": str(root / "file.txt"), "shared": str(root / "shared")}


def _argv(case: Case, values: dict[str, str]) -> list[str]:
    return [a.format(**values) for a in (*CLIS[case.cli][3], *case.extra)]


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (hidden ones too) with its content (None for folders)."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@lru_cache(maxsize=None)
def _module(cli: str) -> ModuleType:
    script, module_name, _, _ = CLIS[cli]
    if module_name is not None:
        return importlib.import_module(module_name)
    spec = importlib.util.spec_from_file_location(f"dschat_bad_input_{cli}", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses in the script look their module up there
    spec.loader.exec_module(module)
    return module


def _run_in_process(case: Case, argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    module = _module(case.cli)
    capsys.readouterr()
    code = module._entry(argv) if case.cli == "e2e" else cli_main(module.main, argv)
    return code, capsys.readouterr().err


def _command(case: Case, argv: list[str], ws: Path) -> tuple[list[str], Path]:
    script, module_name, cwd, _ = CLIS[case.cli]
    if module_name is not None:
        return [PYTHON, "-m", module_name, *argv], ws
    return [PYTHON, str(script.relative_to(cwd)) if cwd else str(script), *argv], cwd or ws


@pytest.fixture(scope="module")
def subprocess_runs(fixed: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run every subprocess case at once: (exit code, stderr, workspace, snapshot before) by id."""
    prepared = {}
    for case in (c for c in CASES if c.subprocess):
        ws = tmp_path_factory.mktemp("ws")
        values = {**fixed, **_workspace(ws, case)}
        prepared[case.id] = (case, _command(case, _argv(case, values), ws), ws, _snapshot(ws))

    def run(item: tuple) -> tuple[int, str]:
        _, (cmd, cwd), _, _ = item
        proc = subprocess.run(cmd, cwd=cwd, env=cli_env(), capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              timeout=300)
        return proc.returncode, proc.stderr

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = dict(zip(prepared, pool.map(run, prepared.values())))
    return {cid: (*results[cid], ws, before) for cid, (_, _, ws, before) in prepared.items()}


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.subprocess else [])
                                  for c in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, fixed, request, tmp_path, capsys, no_model_loads):
    if case.subprocess:  # the fixture runs them all at once, only when a subprocess case is selected
        code, stderr, ws, before = request.getfixturevalue("subprocess_runs")[case.id]
        values = {**fixed, "ws": str(ws), "out": str(ws / "out"), "file": str(ws / "file.txt"),
                  "shared": str(ws / "shared")}
    else:
        ws = tmp_path / "ws"
        values = {**fixed, **_workspace(ws, case)}
        before = _snapshot(ws)
        code, stderr = _run_in_process(case, _argv(case, values), capsys)
    assert code == EXIT_USAGE, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr[-3000:]
    assert case.message.format(**values) in errors[0]
    assert _snapshot(ws) == before  # no output folder, no data cache, the previous output intact


def test_every_cli_has_a_subprocess_case():
    assert {c.cli for c in CASES if c.subprocess} >= set(CLIS) - {"prepare"}  # prepare: test_data_prepare_cli


# ------------------------------------------------------------------------------------------------ disk full


def _disk_full(*_: Any, **__: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_while_writing_the_data_cache(tmp_path, capsys, monkeypatch):
    """safetensors reports a full disk in its own exception type; the cache build turns it into one line."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*_: Any, **__: Any) -> None:
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    case = Case("disk-full/data-cache", "step1", (), "the disk is full")
    ws = tmp_path / "ws"
    values = _workspace(ws, case)
    (ws / "data").mkdir()
    (ws / "data" / "previous-cache.json").write_text("{}")
    code, stderr = _run_in_process(case, _argv(case, values), capsys)
    assert code == EXIT_USAGE and "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "the disk is full" in errors[0] and "free some space" in errors[0]
    cache = sorted(p.name for p in (ws / "data").iterdir() if not p.name.startswith(".lock_"))
    assert cache == ["previous-cache.json"]  # no partial traindata/evaldata/meta file
    assert not (ws / "out").exists()


@pytest.mark.slow
def test_disk_full_while_saving_keeps_the_previous_model(tmp_path, capsys, monkeypatch):
    """A full disk at the final save: one line, exit 2, and the previous output folder untouched."""
    import dschat.models.save

    monkeypatch.setattr(dschat.models.save, "_write", _disk_full)
    case = Case("disk-full/final-save", "step1", ("--max_train_steps", "1", "--per_device_train_batch_size", "2",
                                                  "--per_device_eval_batch_size", "64"), "", good_output=True)
    ws = tmp_path / "ws"
    values = _workspace(ws, case)
    (ws / "out" / "config.json").write_text('{"model_type": "opt", "previous": true}')  # an earlier model's
    before = {k: v for k, v in _snapshot(ws).items() if not k.startswith("data")}
    code, stderr = _run_in_process(case, _argv(case, values), capsys)
    assert code == EXIT_USAGE, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"while writing {ws / 'out'}" in errors[0], stderr[-3000:]
    after = {k: v for k, v in _snapshot(ws).items() if not k.startswith("data")}
    assert after == before  # no .out.partial-* sibling, the old config.json and sentinel as they were


def test_output_in_a_folder_without_write_permission(tmp_path, capsys, monkeypatch, no_model_loads):
    """chmod does not stop root, so as root the check is fed what os.access reports to other users."""
    import os

    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    if os.geteuid() == 0:
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == read_only
                            else real_access(p, mode, **kw))
    case = Case("read-only/step1", "step1", ("--output_dir", "{ws}/read-only/out"), "")
    code, stderr = _run_in_process(case, _argv(case, {"ws": str(tmp_path), "out": "", "file": ""}), capsys)
    assert code == EXIT_USAGE
    assert f"--output_dir {read_only / 'out'} cannot be written: no write permission in {read_only}" in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["read-only"] and not any(read_only.iterdir())
