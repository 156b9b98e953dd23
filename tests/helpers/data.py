"""Helpers of the data tests (``tests/data/``): a small real tokenizer, rows, file writers.

The tokenizer is a byte-level BPE trained in memory on a fixed corpus, wrapped in
``PreTrainedTokenizerFast`` with BOS prepended (like LLaMA/OPT), so truncation, padding and special
tokens behave as with a real model's tokenizer.
"""
from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from helpers import REPO

WORDS = (
    "the a cat dog bird fish tree river mountain city house garden book story song music water fire "
    "sun moon star sky rain snow wind human assistant hello thanks please sorry yes no maybe why how "
    "what when where who which good bad happy sad big small fast slow red blue green puffin seabird "
    "question answer help explain tell about know learn think"
).split()


def corpus(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))
        a = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        out.append(f" Human: {q}? Assistant: {a}.")
    return out


@functools.lru_cache(maxsize=None)
def _train(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|endoftext|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))],
    )
    return tok.to_str()


def make_tokenizer(vocab_size: int = 400, pad_is_eos: bool = False) -> Any:
    """A fresh right-padded tokenizer (BOS ``<s>`` prepended, EOS ``</s>``, pad ``<pad>`` or EOS)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(_train(vocab_size))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
        pad_token="</s>" if pad_is_eos else "<pad>",
    )
    tok.padding_side = "right"
    return tok


def save_tokenizer(folder: Path, **kwargs: Any) -> Path:
    tok = make_tokenizer(**kwargs)
    tok.save_pretrained(str(folder))
    return folder


def pref_rows(n: int, tag: str = "q", rejected: bool = True) -> list[dict]:
    """Preference rows in upstream's convention (prompt ends with 'Assistant:', answers start with ' ')."""
    rows = []
    for i in range(n):
        row = {"prompt": f" Human: {tag} {i} what is the cat? Assistant:", "chosen": f" the cat {i} is happy."}
        if rejected:
            row["rejected"] = f" no {i}."
        rows.append(row)
    return rows


def write_jsonl(path: Path, rows: Sequence[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_json(path: Path, rows: Sequence[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(list(rows), indent=1), encoding="utf-8")
    return path


def subprocess_env() -> dict:
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run_prepare(args: Sequence[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dschat.data.prepare", *args],
        capture_output=True, text=True, cwd=str(cwd or REPO), env=subprocess_env(), timeout=300,
    )


def files_in(folder: Path) -> list[str]:
    """Every file name under ``folder`` (recursive), [] if it does not exist."""
    if not folder.exists():
        return []
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
