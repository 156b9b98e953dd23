"""Where dschat keeps things it builds once (the embedded model, tiny test models), and the names of
files that one part writes and another reads."""
from __future__ import annotations

import json
import os
from pathlib import Path

# Step 3 writes it in --output_dir, one JSON line per PPO iteration (docs/metrics.md); the e2e report
# reads it.
METRICS_FILE = "metrics.jsonl"
# A step-2 output: dschat writes its reward model's value head beside the body; upstream
# DeepSpeed-Chat wrote the whole reward model (body and head) into one pickle. Step 3, e2e and the
# report read both.
VALUE_HEAD_FILE = "v_head.safetensors"
UPSTREAM_WEIGHTS_FILE = "pytorch_model.bin"
# --save_format: how a step writes its final model's weights. safetensors (dschat's default, with
# v_head.safetensors beside a reward model's body), bin (upstream's UPSTREAM_WEIGHTS_FILE, a reward
# model's body and value head in one file), or both. Every reader takes either.
SAVE_FORMATS = ("safetensors", "bin", "both")
# A PEFT adapter folder (written by save_pretrained, and by every dschat LoRA save in lora_adapter/)
# holds this file and no config.json; dschat.models.registry resolves it, dschat.models.peft_adapter
# reads and writes it.
ADAPTER_CONFIG_FILE = "adapter_config.json"
# Short model names (dschat.models.registry resolves them): the embedded SmolLM2 and the tiny models
# (the same names as dschat.models.tiny.TINY_NAMES, literal here so that nothing imports the builder).
# A short name wins over a same-named folder in the working directory (./tiny-opt is the folder).
EMBEDDED_NAMES: tuple[str, ...] = ("smollm2-135m",)
TINY_MODEL_NAMES: tuple[str, ...] = ("tiny-llama", "tiny-opt", "tiny-opt-quirk")
SHORT_NAMES: tuple[str, ...] = EMBEDDED_NAMES + TINY_MODEL_NAMES


def is_short_name(name: object) -> bool:
    """Whether ``name`` is a short model name given as text (a :class:`~pathlib.Path` is a path:
    ``Path("./tiny-opt")`` prints as ``tiny-opt``): it names the registry's model, not a folder."""
    return isinstance(name, str) and name.strip() in SHORT_NAMES
# Step 3's --save_best_by: the best models so far in <output_dir>/BEST_DIR, described by BEST_FILE
# (dschat.rlhf.heldout.evaluation writes them, the report reads them).
BEST_DIR = "best"
BEST_FILE = "best.json"
# A run with no evaluation to continue keeps an earlier run's BEST_DIR under this name.
EARLIER_BEST_DIR = "best.earlier"
# The embedded preference dataset's ``train.jsonl`` / ``eval.jsonl`` (shipped inside the package):
# written by dschat.data.builtin, read by it and, as its tokenizer corpus, by dschat.models.tiny.
BUILTIN_DATA_DIR = Path(__file__).parent / "data" / "builtin_prefs"
# ``dschat/builtin-samples``: gold-labelled pairs of an SFT actor's own answers (the CPU demo's step 2
# reads them beside dschat/builtin), written by dschat.eval.sample_pairs.
BUILTIN_SAMPLES_DIR = BUILTIN_DATA_DIR / "samples"
# Set by the launcher (dschat.launch) for a step it runs: a file beside the log that the step creates
# once it is past its start-up refusals (dschat.training.run_setup.setup_run), so that the launcher
# tells a step that refused its input (exit code 2, nothing done: no log kept) from one that failed later.
STARTED_FILE_VAR = "DSCHAT_STARTED_FILE"
# ``dschat/wordgame``: the multi-turn demo's prompts (a ``word`` column beside each), written and read
# by dschat.data.wordgame.
WORDGAME_DATA_DIR = Path(__file__).parent / "data" / "wordgame"


def cache_dir() -> Path:
    """``$DSCHAT_CACHE_DIR``, else ``$XDG_CACHE_HOME/dschat``, else ``~/.cache/dschat``."""
    explicit = os.environ.get("DSCHAT_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "dschat"


def data_cache_dir() -> Path:
    """``cache_dir()/data_files``: the default ``--data_output_path``, private to the user.

    Upstream's default, ``/tmp/data_files``, was one folder shared by every user of the machine:
    another account could plant the cache files a run then trained on.
    """
    return cache_dir() / "data_files"


def is_adapter_folder(path: str | os.PathLike) -> bool:
    """A PEFT adapter folder: ``adapter_config.json`` and no ``config.json`` (a folder with both is a
    model, loaded as one)."""
    folder = Path(path)
    return (folder / ADAPTER_CONFIG_FILE).is_file() and not (folder / "config.json").is_file()


def adapter_base(path: str | os.PathLike) -> str | None:
    """The base model an adapter folder (:func:`is_adapter_folder`) names: its config's
    ``base_model_name_or_path``, stripped. None for another folder and for a config that cannot be read
    or names no base as a string (the adapter's loader says why, when it is loaded)."""
    if not is_adapter_folder(path):
        return None
    try:
        base = json.loads((Path(path) / ADAPTER_CONFIG_FILE).read_text(encoding="utf-8"))["base_model_name_or_path"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return base.strip() if isinstance(base, str) else None


def step3_part(path: str | os.PathLike, part: str) -> Path | None:
    """``path/part`` (``actor`` or ``critic``) when ``path`` is a step-3 output root: a folder with no
    ``config.json`` of its own whose ``part/`` holds one. Else None; always for a short model name
    given as text (:func:`is_short_name`), which wins over a same-named folder in the working directory."""
    if is_short_name(path):
        return None
    folder = Path(path).expanduser()
    if folder.is_dir() and not (folder / "config.json").exists() and (folder / part / "config.json").is_file():
        return folder / part
    return None
