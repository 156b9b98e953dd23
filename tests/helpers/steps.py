"""Helpers of the step-script tests (training/test_step1/2, test_dpo, test_two_ranks, e2e/test_eval_scripts).

The step scripts live in ``training/<step>/main.py`` (upstream's layout), outside the package, so
they are imported from their files. Each ``main(argv)`` returns a
:class:`dschat.training.progress.RunResult` with the trained engine, which the checks below compare
against the folder it saved.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

import torch

from helpers import PYTHON, REPO

STEP_DIRS = {
    "step1": REPO / "training" / "step1_supervised_finetuning",
    "step2": REPO / "training" / "step2_reward_model_finetuning",
    "dpo": REPO / "training" / "step2_dpo_finetuning",
}
DEEPSPEED = shutil.which("deepspeed") or str(Path(PYTHON).with_name("deepspeed"))

# Two short conversations in the training data's format, of different lengths (so padding shows).
PROBE_TEXTS = [
    " Human: How do volcanoes work? Assistant: Lava from volcanoes cools into new rock.",
    " Human: Can you help me learn about chess? Assistant: Chess is played on a board of sixty four squares "
    "by two players.",
]
PROBE_PAIRS = [
    (" Human: Could you share a fact about violins? Assistant:",
     " The violin is the smallest and highest member of its family. Enjoy learning more!",
     " Ugh, that is a boring question. Look it up next time."),
    (" Human: I want to learn about volcanoes. Where should I start? Assistant:",
     " Lava from volcanoes cools into new rock and can build whole islands.",
     " Whatever. Don't bother asking again."),
]


def load_script(step: str, name: str = "main") -> ModuleType:
    """Import ``training/<step>/<name>.py`` under a unique module name."""
    path = STEP_DIRS[step] / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"dschat_script_{step}_{name}", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # dataclasses in the script look their module up there
    spec.loader.exec_module(module)
    return module


def base_argv(model: str, data_dir: Path, *extra: str, max_train_steps: int = 6, max_seq_len: int = 64,
              batch_size: int = 4) -> list[str]:
    """Small, fast flags shared by the in-process runs (fp32: the CPU has no fp16)."""
    return [
        "--model_name_or_path", model, "--data_path", "dschat/builtin", "--data_output_path", str(data_dir),
        "--max_seq_len", str(max_seq_len), "--per_device_train_batch_size", str(batch_size),
        "--per_device_eval_batch_size", "32", "--max_train_steps", str(max_train_steps), "--dtype", "fp32",
        *extra,
    ]


def assert_finite(losses: Sequence[float]) -> None:
    assert losses, "no training step ran"
    assert all(math.isfinite(x) for x in losses), losses


def _eval_logits(engine: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    engine.train()
    return logits.float()


def assert_causal_folder_matches(result: Any, start_model: str) -> None:
    """The saved folder loads with plain transformers, gives the trained engine's logits (LoRA
    fused), and its weights differ from the starting checkpoint's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dschat.models.registry import resolve_model_path

    saved = AutoModelForCausalLM.from_pretrained(result.output_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(result.output_dir)
    batch = tokenizer(PROBE_TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        got = saved(**batch).logits
    expected = _eval_logits(result.engine, dict(batch))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

    original = AutoModelForCausalLM.from_pretrained(resolve_model_path(start_model), dtype=torch.float32)
    before = original.state_dict()
    changed = [k for k, v in saved.state_dict().items()
               if k in before and v.shape == before[k].shape and not torch.equal(v, before[k])]
    assert changed, "training changed no weight"


def _peft_causal_lm(path: Path) -> Any:
    """The causal LM at ``path`` as PEFT builds it: a model folder, or an adapter folder merged into its
    base (``merge_and_unload``, recursively)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if (path / "config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    base = json.loads((path / "adapter_config.json").read_text(encoding="utf-8"))["base_model_name_or_path"]
    return PeftModel.from_pretrained(_peft_causal_lm(Path(base)), str(path)).merge_and_unload()


def assert_causal_adapter_matches(folder: Path, base: str | Path) -> None:
    """``folder``'s LoRA as a PEFT adapter (``folder/lora_adapter``): ``PeftModel.from_pretrained`` on
    the model it names as its base (``base``; an adapter there is merged into its own base first) gives
    the merged model's logits within 1e-5 (fp32, CPU), and given back as a model path dschat loads
    that model too."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from dschat.models.build import create_hf_model
    from dschat.models.registry import resolve_model_path
    from dschat.models.tokenizer import load_hf_tokenizer

    adapter = folder / "lora_adapter"
    config = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
    base_folder = Path(resolve_model_path(str(base))).resolve()
    assert config["base_model_name_or_path"] == str(base_folder), config
    tokenizer = load_hf_tokenizer(str(adapter))
    batch = tokenizer(PROBE_TEXTS, padding=True, return_tensors="pt")
    merged = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with_peft = PeftModel.from_pretrained(_peft_causal_lm(base_folder), str(adapter)).eval()
    back = create_hf_model(AutoModelForCausalLM, str(adapter), tokenizer).eval()
    with torch.no_grad():
        expected = merged(**batch).logits
        torch.testing.assert_close(with_peft(**batch).logits, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(back(**batch).logits, expected, rtol=0, atol=1e-5)


def assert_reward_adapter_matches(folder: Path) -> None:
    """A reward model's adapter (``folder/lora_adapter``, value head beside it), given back as a
    critic path, scores like the merged reward model in ``folder``; under PEFT, its body with the value
    head gives the same values."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModel

    from dschat.models.build import create_critic_model
    from dschat.models.tokenizer import load_hf_tokenizer

    adapter = folder / "lora_adapter"
    config = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
    tokenizer = load_hf_tokenizer(str(adapter))
    batch = pair_batch(tokenizer)
    real = batch["attention_mask"].bool()
    merged = create_critic_model(str(folder), tokenizer, None, rlhf_training=True).eval()
    back = create_critic_model(str(adapter), tokenizer, None, rlhf_training=True).eval()
    body = PeftModel.from_pretrained(AutoModel.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32),
                                     str(adapter)).eval()
    v_head = load_file(str(adapter / "v_head.safetensors"))["v_head.weight"]
    with torch.no_grad():
        expected = merged.forward_value(**batch, return_value_only=True)
        torch.testing.assert_close(back.forward_value(**batch, return_value_only=True), expected, rtol=0, atol=1e-5)
        values = (body(**batch).last_hidden_state @ v_head.T).squeeze(-1)
        torch.testing.assert_close(values[real], expected[real], rtol=0, atol=1e-5)


def pair_batch(tokenizer: Any, eot: str | None = None) -> dict[str, torch.Tensor]:
    """``[chosen_1, chosen_2; rejected_1, rejected_2]`` as DataCollatorReward lays them out."""
    eot = tokenizer.eos_token if eot is None else eot
    texts = [p + c + eot for p, c, _ in PROBE_PAIRS] + [p + r + eot for p, _, r in PROBE_PAIRS]
    enc = tokenizer(texts, padding="max_length", max_length=48, truncation=True, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def assert_reward_folder_matches(result: Any) -> None:
    """``create_critic_model(..., rlhf_training=True)`` on the saved folder scores like the engine."""
    from dschat.models.build import create_critic_model
    from dschat.models.tokenizer import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(str(result.output_dir))
    reloaded = create_critic_model(str(result.output_dir), tokenizer, None, rlhf_training=True).eval()
    batch = pair_batch(tokenizer)
    engine = result.engine
    engine.eval()
    with torch.no_grad():
        expected = engine(**batch)
        got = reloaded(**batch)
    engine.train()
    for key in ("chosen_mean_scores", "rejected_mean_scores"):
        torch.testing.assert_close(got[key].float(), expected[key].float(), rtol=1e-4, atol=1e-5)
    v_head = engine.module.v_head.weight.detach().float()
    torch.testing.assert_close(reloaded.v_head.weight.float(), v_head)


def assert_saved_in_format(folder: Path, save_format: str) -> None:
    """``folder`` holds the weight files ``--save_format`` names and no others: ``bin`` is upstream's
    ``pytorch_model.bin`` (a plain tensor state dict, read with ``weights_only=True``; a reward
    model's ``rwtransformer.*`` body and ``v_head.weight`` in it), ``both`` holds the same tensors
    in both formats."""
    from safetensors.torch import load_file

    bin_file, safetensors_files = folder / "pytorch_model.bin", sorted(folder.glob("*.safetensors"))
    assert bin_file.is_file() == (save_format != "safetensors"), sorted(p.name for p in folder.iterdir())
    assert bool(safetensors_files) == (save_format != "bin"), sorted(p.name for p in folder.iterdir())
    if save_format == "safetensors":
        return
    state = torch.load(bin_file, map_location="cpu", weights_only=True)
    assert isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values())
    assert not any("lora" in k for k in state)  # fused and dropped, as upstream
    reward_model = (folder / "v_head.safetensors").is_file() or "v_head.weight" in state
    if reward_model:
        assert "v_head.weight" in state and all(k == "v_head.weight" or k.startswith("rwtransformer.")
                                                for k in state)
    if save_format == "both":
        other: dict[str, torch.Tensor] = {}
        for file in safetensors_files:
            other.update(load_file(str(file)))
        if reward_model:
            other = {k if k == "v_head.weight" else f"rwtransformer.{k}": v for k, v in other.items()}
        assert set(other) <= set(state)  # the bin may also hold a tied lm_head.weight
        for key, value in other.items():
            assert torch.equal(state[key], value), key


def cli_env(**extra: str) -> dict[str, str]:
    """Environment for subprocess runs: CPU DeepSpeed, no hub, one thread per rank."""
    env = dict(os.environ)
    env.update({"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # a fresh process group per subprocess
    # The child imports this checkout's dschat, also where another copy is pip-installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def free_port() -> int:
    """A port nobody listens on (the OS picks it), for a launch of several ranks on this machine."""
    from dschat.multinode import free_port as pick

    return pick()


def deepspeed_cmd(*args: str, num_gpus: int = 2) -> list[str]:
    """``deepspeed --master_port <free> --num_gpus N ARGS``: never the launcher's fixed default 29500,
    which another job (or another test run) on the machine may hold."""
    return [DEEPSPEED, "--master_port", str(free_port()), "--num_gpus", str(num_gpus), *args]


#: What rank 0 says when the ``--master_port`` a test picked was taken before it could listen there
#: (:func:`free_port` frees the port it found; the ranks bind it later, after their imports, and
#: another process on the machine may bind it in between).
PORT_TAKEN = ("cannot listen on port", "another job holds that port")


def run_captured(args: Sequence[str], cwd: Path, env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    """Run a command (argument list, no shell) and capture its output as text. A launch given
    ``--master_port`` whose port was taken (:data:`PORT_TAKEN`) runs once more on another free port:
    the result's ``args`` name the port of the run returned."""
    args = list(args)
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 and "--master_port" in args and any(s in proc.stderr + proc.stdout for s in PORT_TAKEN):
        args[args.index("--master_port") + 1] = str(free_port())
        proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc


def run_cli(args: Sequence[str], cwd: Path, timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    """:func:`run_captured` with :func:`cli_env`."""
    return run_captured(args, cwd, cli_env(**env), timeout)


def require_cuda_accelerator() -> None:
    """GPU-tier tests need DeepSpeed's CUDA accelerator (tests/conftest.py defaults DS_ACCELERATOR
    to cpu: run the GPU tier with ``DS_ACCELERATOR=cuda pytest -m gpu``)."""
    import pytest
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cuda":
        pytest.skip("GPU tier: run with DS_ACCELERATOR=cuda (DeepSpeed's accelerator here is "
                    f"{get_accelerator().device_name()})")


def assert_low_precision_folder_loads(result: Any) -> None:
    """GPU tier: the fp16/bf16 run saved a folder that transformers loads and that generates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(result.output_dir).to("cuda").eval()
    tokenizer = AutoTokenizer.from_pretrained(result.output_dir)
    batch = tokenizer(PROBE_TEXTS, padding=True, return_tensors="pt").to("cuda")
    with torch.no_grad():
        logits = model(**batch).logits
    assert torch.isfinite(logits.float()).all()
    out = model.generate(**batch, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] == batch["input_ids"].shape[1] + 4
