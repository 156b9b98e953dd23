"""Helpers of the step-3 tests (``tests/rlhf/test_step3_*.py`` and others): critic folders, the
step-3 ``main`` module, argument lists and weight comparisons. The fixtures built on them
(``critic_dirs``, ``lora_inputs``, ``data_cache``, ``one_thread``) are in ``tests/conftest.py``."""
from __future__ import annotations

import importlib.util
import os
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
import torch

from dschat.errors import EXIT_USAGE, cli_main

from helpers import REPO

STEP3_DIR = REPO / "training" / "step3_rlhf_finetuning"
STEP3_MAIN = STEP3_DIR / "main.py"


@lru_cache(maxsize=None)
def step3_main() -> Any:
    """``training/step3_rlhf_finetuning/main.py`` imported as a module (it is not a package)."""
    spec = importlib.util.spec_from_file_location("dschat_step3_main", STEP3_MAIN)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def make_critic_folder(model_name: str, folder: Path, seed: int = 0) -> Path:
    """A step-2-style output (body + ``v_head.safetensors``) without running step 2."""
    from dschat.models.build import create_critic_model
    from dschat.models.save import save_hf_model
    from dschat.models.tokenizer import load_hf_tokenizer

    if (folder / "v_head.safetensors").exists():
        return folder
    torch.manual_seed(seed)
    tokenizer = load_hf_tokenizer(model_name)
    critic = create_critic_model(model_name, tokenizer, None)
    save_hf_model(critic, tokenizer, folder)
    return folder


def make_classifier(model_name: str, folder: Path, num_labels: int = 1, seed: int = 0) -> Path:
    """A random-weight ``*ForSequenceClassification`` of the tiny ``model_name``'s shape (``num_labels``
    labels, its pad id the tokenizer's), saved by transformers with its tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from dschat.models.registry import resolve_model_path
    from dschat.models.tokenizer import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(model_name)
    config = AutoConfig.from_pretrained(resolve_model_path(model_name), num_labels=num_labels)
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_lora_inputs(model_name: str, root: Path, seed: int = 0) -> dict[str, Path]:
    """A LoRA actor and a LoRA critic saved by dschat (merged folder + ``lora_adapter/``), their
    factors moved off zero as after training, without running steps 1 and 2."""
    from transformers import AutoModelForCausalLM

    from dschat.models.build import create_critic_model, create_hf_model
    from dschat.models.lora import convert_linear_layer_to_lora
    from dschat.models.save import save_hf_model
    from dschat.models.tokenizer import load_hf_tokenizer

    torch.manual_seed(seed)
    tokenizer = load_hf_tokenizer(model_name)
    folders = {}
    for role, model in (("actor", create_hf_model(AutoModelForCausalLM, model_name, tokenizer)),
                        ("critic", create_critic_model(model_name, tokenizer, None))):
        model = convert_linear_layer_to_lora(model, LORA_MODULES[model_name], 4)
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "lora_left_weight"):
                    module.lora_left_weight.normal_(std=0.05)
        folders[role] = save_hf_model(model, tokenizer, root / role)
    return folders


LORA_MODULES = {"tiny-opt": "decoder.layers.", "tiny-opt-quirk": "decoder.layers.", "tiny-llama": "layers."}


def base_argv(model: str, critic: Path, data: Path, *extra: str, steps: int = 2, lr: float = 1e-3,
              actor: str | Path | None = None) -> list[str]:
    """A short test-mode run: 4 prompts x 16 tokens, 16-token answers, fp32, constant LR. The actor is
    ``model`` unless ``actor`` names another path of that family (a LoRA adapter folder)."""
    return [
        "--actor_model_name_or_path", str(actor or model), "--critic_model_name_or_path", str(critic),
        "--data_path", "dschat/builtin", "--data_output_path", str(data),
        "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "4",
        "--max_prompt_seq_len", "16", "--max_answer_seq_len", "16", "--dtype", "fp32",
        "--enable_test_mode", "--test_stop_step", str(steps),
        "--num_warmup_steps", "0", "--lr_scheduler_type", "constant",
        "--actor_learning_rate", str(lr), "--critic_learning_rate", str(lr),
        "--actor_lora_learning_rate", str(lr * 5), "--critic_lora_learning_rate", str(lr * 5),
        "--actor_lora_module_name", LORA_MODULES[model], "--critic_lora_module_name", LORA_MODULES[model],
        *extra,
    ]


def load_state(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``folder`` (weights as saved), or of its
    ``pytorch_model.bin`` when it has none (a reward model's body keys without their prefix)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(file)))
    if not state and (folder / "pytorch_model.bin").is_file():  # --save_format bin (upstream's layout)
        saved = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        state = {k.removeprefix("rwtransformer."): v for k, v in saved.items()}  # a reward model's body keys
    return state


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest element difference over the tensors both dicts share (upstream's ``pytorch_model.bin``
    layout holds a tied ``lm_head.weight`` that a safetensors folder leaves out)."""
    shared = set(a) & set(b)
    assert len(shared) >= 0.9 * max(len(a), len(b)), sorted(set(a) ^ set(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in shared)


def refused_in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Step 3's ``main`` run in-process on a command line it must refuse: exit 2, one ``error:``
    line and no traceback. Returns that line."""
    capsys.readouterr()
    code = cli_main(step3_main().main, argv)
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error: ")]
    assert code == EXIT_USAGE and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


def subprocess_env() -> dict[str, str]:
    """This environment without the rendezvous variables an in-process run set (a child reusing
    them would try to bind the parent's MASTER_PORT)."""
    rendezvous = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "CROSS_RANK", "CROSS_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in rendezvous}
    env.update({"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"})
    return env


class Interrupted(Exception):
    """Stands in for a crash right after a checkpoint."""


def crash_after_checkpoint(monkeypatch: pytest.MonkeyPatch, optimizer_steps: int = 2) -> None:
    """Make step 3 raise :class:`Interrupted` right after it saves the checkpoint of ``optimizer_steps``
    (``monkeypatch.undo()`` lets the resumed run save as usual)."""
    from dschat.training import checkpoint as ckpt

    original = ckpt.Checkpointer.save  # every checkpoint, due or postponed (step 3's CheckpointTiming)

    def crash(self: Any, position: Any) -> Any:
        saved = original(self, position)
        if position.optimizer_steps == optimizer_steps:
            raise Interrupted
        return saved

    monkeypatch.setattr(ckpt.Checkpointer, "save", crash)
