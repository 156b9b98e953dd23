"""Safe loading: no pickles, ``torch.load`` only with ``weights_only=True``, and never code shipped
with a model (``trust_remote_code`` is off everywhere; transformers' default, ``None``, asks on stdin).

A source scan (AST, so multi-line calls count) over the code dschat runs, plus the loaders on a model
folder whose ``auto_map`` points at Python code that would leave a marker file if it ever ran.
"""
from __future__ import annotations

import ast
import builtins
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dschat.errors import UserError

from helpers import REPO

SOURCES = [REPO / "e2e_rlhf.py", REPO / "chat.py",
           *sorted((REPO / "dschat").rglob("*.py")), *sorted((REPO / "training").rglob("*.py")),
           *sorted((REPO / "inference").rglob("*.py"))]
PICKLE_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
PICKLE_ERRORS = {"PickleError", "UnpicklingError"}


def _keyword(call: ast.Call, name: str) -> object:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value.value if isinstance(kw.value, ast.Constant) else "<expression>"
    return "<missing>"


def unsafe_loads(source: str, filename: str = "<source>") -> list[str]:
    """Every unsafe load in ``source``: ``file:line what``."""
    problems = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            problems += [f"{where} imports {a.name}" for a in node.names if a.name.split(".")[0] in PICKLE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLE_MODULES:
            if not {a.name for a in node.names} <= PICKLE_ERRORS:  # catching pickle's errors loads nothing
                problems.append(f"{where} imports from {node.module}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            if node.func.attr == "load" and owner == "torch" and _keyword(node, "weights_only") is not True:
                problems.append(f"{where} torch.load without weights_only=True")
            if node.func.attr == "load" and owner in ("np", "numpy") and _keyword(node, "allow_pickle") is True:
                problems.append(f"{where} numpy.load with allow_pickle=True")
            if node.func.attr == "from_pretrained" and _keyword(node, "trust_remote_code") is not False:
                problems.append(f"{where} {ast.unparse(node.func)} without trust_remote_code=False")
    return problems


def test_the_scan_finds_each_kind_of_unsafe_load():
    bad = (
        "import pickle\nfrom dill import loads\nfrom pickle import UnpicklingError, loads\nimport torch, numpy as np\n"
        "torch.load(f)\ntorch.load(f, weights_only=False)\nnp.load(f, allow_pickle=True)\n"
        "AutoModel.from_pretrained(p)\nAutoConfig.from_pretrained(\n  p, trust_remote_code=True)\n"
    )
    found = unsafe_loads(bad)
    assert [p.split(" ", 1)[1] for p in found] == [
        "imports pickle", "imports from dill", "imports from pickle", "torch.load without weights_only=True",
        "torch.load without weights_only=True", "numpy.load with allow_pickle=True",
        "AutoModel.from_pretrained without trust_remote_code=False",
        "AutoConfig.from_pretrained without trust_remote_code=False",
    ]
    good = ("torch.load(f, weights_only=True)\nnp.load(f)\nfrom pickle import UnpicklingError\n"
            "AutoTokenizer.from_pretrained(\n  p,\n  use_fast=True, trust_remote_code=False)\n")
    assert unsafe_loads(good) == []


def test_no_unsafe_load_in_the_code_dschat_runs():
    assert len(SOURCES) > 40
    problems = [p for path in SOURCES for p in unsafe_loads(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))]
    assert problems == []


@pytest.fixture
def custom_code_model(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny-llama folder whose config and tokenizer ask for code that writes ``marker`` when run."""
    from dschat.models.registry import resolve_model_path

    folder = tmp_path / "custom"
    shutil.copytree(resolve_model_path("tiny-llama"), folder)
    marker = tmp_path / "CODE_RAN"
    (folder / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast\n"
        "class EvilConfig(LlamaConfig):\n    model_type = 'evil'\n"
        "class EvilModel(LlamaForCausalLM):\n    config_class = EvilConfig\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel",
                                               "AutoModelForCausalLM": "evil.EvilModel"})
    (folder / "config.json").write_text(json.dumps(config))
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    tok_config["auto_map"] = {"AutoTokenizer": [None, "evil.EvilTokenizer"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return folder, marker


def _loaders():
    import torch

    from dschat.eval import scoring
    from dschat.models.build import create_critic_model, create_hf_model
    from dschat.models.registry import load_config
    from dschat.models.tokenizer import load_hf_tokenizer

    sys.path.insert(0, str(REPO / "inference"))
    import chatbot

    sys.path.remove(str(REPO / "inference"))

    def causal_lm(path):
        from transformers import AutoModelForCausalLM

        return create_hf_model(AutoModelForCausalLM, path, load_hf_tokenizer("tiny-llama"))

    return {
        "load_config": load_config,
        "load_hf_tokenizer": load_hf_tokenizer,
        "create_hf_model": causal_lm,
        "create_critic_model": lambda path: create_critic_model(path, load_hf_tokenizer("tiny-llama"), None),
        "chatbot.load": lambda path: chatbot.load(path, "cpu"),
        "scoring.load_actor": lambda path: scoring.load_actor(path, torch.device("cpu")),
    }


@pytest.mark.parametrize("loader", list(_loaders()))
def test_loaders_never_run_model_code_even_when_stdin_says_yes(loader, custom_code_model, monkeypatch):
    folder, marker = custom_code_model
    # transformers' default (trust_remote_code=None) prompts "Do you wish to run the custom code? [y/N]".
    monkeypatch.setattr(builtins, "input", lambda *_: "y")
    if loader == "load_hf_tokenizer":
        # With the code refused, transformers falls back to the folder's tokenizer.json: safe.
        assert len(_loaders()[loader](str(folder))) > 0
    else:
        with pytest.raises(UserError, match="needs Python code shipped with the model.*trust_remote_code=False"):
            _loaders()[loader](str(folder))
    assert not marker.exists()


def test_the_custom_code_model_would_run_with_transformers_default(custom_code_model, tmp_path):
    """The fixture is a real threat: without dschat's explicit False, a "y" on stdin runs its code
    (in a child process, so the loaded class stays out of this one's registries)."""
    folder, marker = custom_code_model
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    code = f"from transformers import AutoConfig; AutoConfig.from_pretrained({str(folder)!r})"
    subprocess.run([sys.executable, "-c", code], input="y\n", env=env, capture_output=True, text=True,
                   timeout=120, check=True)
    assert marker.exists()


# ------------------------------------------------------------------------------------------------ checkpoints


class _MakesFolder:
    """Unpickling this creates a folder (``os.makedirs``: a module torch blocks by name)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.makedirs, (self.path,))


class _Prints:
    """Unpickling this calls ``print`` (a global torch refuses as "not allowed")."""

    def __reduce__(self):
        return (print, ("code ran",))


def _checkpoint_file(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """A file as DeepSpeed would read it, spoiled in one of several ways, and the expected message."""
    import torch

    path = tmp_path / "mp_rank_00_model_states.pt"
    good = {"module": {"w": torch.zeros(2)}, "global_steps": 1}
    if kind == "blocked-module":
        torch.save({**good, "payload": _MakesFolder(str(tmp_path / "code-ran"))}, path)
        return path, r"holds objects dschat does not unpickle \(.*GLOBAL os.makedirs"
    if kind == "not-allowed-global":
        torch.save({**good, "payload": _Prints()}, path)
        return path, r"holds objects dschat does not unpickle \(.*GLOBAL print"
    if kind == "legacy-format":
        torch.save({**good, "payload": _MakesFolder(str(tmp_path / "code-ran"))}, path,
                   _use_new_zipfile_serialization=False)
        return path, r"holds objects dschat does not unpickle \(.*GLOBAL os.makedirs"
    torch.save(good, path)
    data = path.read_bytes()
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
        return path, r"cannot read .*mp_rank_00_model_states.pt \(RuntimeError: .*damaged"
    if kind == "empty":
        path.write_bytes(b"")
        return path, r"cannot read .*mp_rank_00_model_states.pt \(EOFError: .*damaged"
    path.write_bytes(b"not a checkpoint at all")  # "garbage"
    return path, r"cannot read .*mp_rank_00_model_states.pt \(UnpicklingError: .*Unsupported operand.*damaged"


@pytest.mark.parametrize("kind", ["blocked-module", "not-allowed-global", "legacy-format", "truncated", "empty",
                                  "garbage"])
def test_a_checkpoint_file_that_does_not_load_is_one_line(kind, tmp_path):
    """Matched by exception type, whatever torch's wording: torch 2.13 words a blocked module
    ("unsupported GLOBAL os.makedirs whose module os is blocked") unlike a refused global."""
    from dschat.training.checkpoint import WeightsOnlyCheckpointEngine

    path, message = _checkpoint_file(tmp_path, kind)
    with pytest.raises(UserError, match=message) as info:
        WeightsOnlyCheckpointEngine(None).load(str(path), map_location="cpu")
    assert str(path) in str(info.value) and "\n" not in str(info.value) and "\x1b" not in str(info.value)
    assert not (tmp_path / "code-ran").exists()


def test_a_good_checkpoint_file_still_loads(tmp_path):
    import torch

    from dschat.training.checkpoint import WeightsOnlyCheckpointEngine

    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(2)}, "global_steps": 3}, path)
    state = WeightsOnlyCheckpointEngine(None).load(str(path), map_location="cpu")
    assert state["global_steps"] == 3 and torch.equal(state["module"]["w"], torch.ones(2))
