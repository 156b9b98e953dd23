"""The multi-turn demo's prompt data, ``--data_path dschat/wordgame``, and the script that makes it.

Each row is a game of :func:`dschat.envs_examples.word_game`: ``prompt`` asks the actor to guess a
secret word, ``word`` holds that word (read by the environment, never shown in the prompt). The
prompt is a ChatML conversation (SmolLM2's and Qwen's chat template, with SmolLM2's default system
message) ending with the assistant's header, so the actor answers as its template expects and the
environment's observations continue the same conversation.

Train and held-out rows have disjoint prompts (each game has its own number) and disjoint secret
words: a gain on the held-out games is a gain in using the environment's reply, not in recalling
words seen in training.

Regenerate (deterministic)::

    python -m dschat.data.wordgame --out dschat/data/wordgame
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from dschat.data import local_files as lf
from dschat.data.adapters.base import PromptRawDataset, Sample
from dschat.data.builtin import check_row_counts as builtin_row_counts
from dschat.errors import UserError, cli_main
from dschat.paths import WORDGAME_DATA_DIR
from dschat.runtime.fs import atomic_files, check_writable_dir

NAME = "dschat/wordgame"
SPLITS = ("train", "eval")
COLUMNS = ("prompt", "word")
DEFAULT_SEED = 1234
DEFAULT_TRAIN_ROWS = 480
DEFAULT_EVAL_ROWS = 64
GAME_NUMBERS = range(1000, 10000)  # each row's game number, distinct across both splits

TRAIN_WORDS = (
    "apple", "river", "candle", "tiger", "pencil", "garden", "rocket", "window", "silver", "muffin",
    "dragon", "pillow", "forest", "bottle", "rabbit", "castle", "orange", "planet", "guitar", "ladder",
    "mirror", "basket", "cookie", "jacket", "island", "button", "spider", "turtle", "hammer", "violin",
    "carrot", "monkey", "bridge", "pepper", "wallet", "camera", "tomato", "anchor", "helmet", "blanket",
)
EVAL_WORDS = (
    "banana", "kitten", "rainbow", "teapot", "lemon", "feather", "pocket", "dolphin", "tunnel", "cactus",
    "marble", "wizard", "pirate", "lantern", "puzzle", "saddle",
)
TEMPLATES = (
    "Game {n}. I am thinking of a secret word. Guess it: reply with one word.",
    "Round {n}: guess the secret word I picked. Answer with a single word.",
    "Word game #{n}. Try to guess my secret word, in one word.",
    "Let's play game {n}. Guess the hidden word, one word only.",
)
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(user: str) -> str:
    """``user`` as one ChatML user turn after the system message, ending with the assistant's header."""
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n")


def make_rows(seed: int = DEFAULT_SEED, train_rows: int = DEFAULT_TRAIN_ROWS,
              eval_rows: int = DEFAULT_EVAL_ROWS) -> dict[str, list[dict[str, str]]]:
    """``{"train": rows, "eval": rows}``, each row ``{"prompt", "word"}``; the same for the same arguments.
    Every prompt is distinct (its game number), and the splits share no prompt and no word."""
    rng = random.Random(seed)
    numbers = rng.sample(GAME_NUMBERS, train_rows + eval_rows)
    out = {}
    for split, words, picked in (("train", TRAIN_WORDS, numbers[:train_rows]),
                                 ("eval", EVAL_WORDS, numbers[train_rows:])):
        out[split] = [{"prompt": chatml(rng.choice(TEMPLATES).format(n=n)), "word": rng.choice(words)}
                      for n in picked]
    return out


def data_dir() -> Path:
    """Folder holding ``train.jsonl`` and ``eval.jsonl`` (shipped inside the package)."""
    return WORDGAME_DATA_DIR


def data_files() -> list[Path]:
    """``train.jsonl`` and ``eval.jsonl``; a UserError if the package lacks them."""
    files = [data_dir() / f"{split}.jsonl" for split in SPLITS]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise UserError(f"the files of {NAME} are missing ({', '.join(missing)}); reinstall dschat "
                        "(the wheel ships dschat/data/wordgame/) or run python -m dschat.data.wordgame")
    return files


class WordGameDataset(PromptRawDataset):
    """``dschat/wordgame``: prompts only (no chosen or rejected answer, so phases 1 and 2 get no rows);
    the ``word`` column travels with each prompt to the environment."""

    eval_split = "eval"
    required_columns = COLUMNS
    has_rejected = False
    has_chosen = False

    def __init__(self, output_path: str, seed: int | None, local_rank: int, dataset_name: str = NAME,
                 raw_datasets: Any = None) -> None:
        self.dataset_name = dataset_name
        self.dataset_name_clean = "dschat_wordgame"
        if raw_datasets is None:
            raw_datasets = {split: lf.records_to_dataset(lf.check_columns(lf.read_records(f), f, COLUMNS), COLUMNS)
                            for split, f in zip(SPLITS, data_files())}
        super().__init__(output_path, seed, local_rank, dataset_name, raw_datasets=raw_datasets)

    def get_prompt(self, sample: Sample) -> str | None:
        return sample["prompt"]  # prompts only: no answers for steps 1-2 (the base class's None)


def write(folder: Path, rows: dict[str, list[dict[str, str]]]) -> None:
    """Write ``rows`` as ``folder/train.jsonl`` and ``folder/eval.jsonl``, both or neither."""
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_files([folder / f"{split}.jsonl" for split in SPLITS]) as tmps:
        for tmp, split in zip(tmps, SPLITS):
            tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows[split]), encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=f"Write {NAME}'s train.jsonl and eval.jsonl (deterministic).")
    parser.add_argument("--out", type=Path, default=data_dir())
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--train_rows", type=int, default=DEFAULT_TRAIN_ROWS)
    parser.add_argument("--eval_rows", type=int, default=DEFAULT_EVAL_ROWS)
    args = parser.parse_args(argv)
    check_row_counts(args.train_rows, args.eval_rows)
    check_writable_dir(args.out, "--out")
    rows = make_rows(args.seed, args.train_rows, args.eval_rows)
    write(args.out, rows)
    print(f"wrote {len(rows['train'])} train and {len(rows['eval'])} eval rows to {args.out}")


def check_row_counts(train_rows: int, eval_rows: int) -> None:
    """``--train_rows`` and ``--eval_rows`` are counts (>= 0) of games, each with its own number
    (:data:`GAME_NUMBERS`, so at most that many in all); else one :class:`UserError` line."""
    builtin_row_counts(train_rows, eval_rows)
    if train_rows + eval_rows > len(GAME_NUMBERS):
        raise UserError(f"--train_rows + --eval_rows must be at most {len(GAME_NUMBERS)} (each game has its own "
                        f"number), got {train_rows + eval_rows}")


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
