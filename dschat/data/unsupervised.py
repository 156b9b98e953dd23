"""Plain-text data for PPO-ptx (InstructGPT's pretraining mix), as upstream's ``get_unsupervised_data``.

Texts are tokenised, concatenated and cut into blocks of ``max_prompt_seq_len + max_answer_seq_len``
tokens with ``labels = input_ids`` (``group_texts``, the Hugging Face ``run_clm`` recipe), and fed to
the actor with ``default_data_collator``.

Sources: a hub dataset name (+ optional config), as upstream; beyond upstream, a local
``save_to_disk`` folder, local ``.json`` / ``.jsonl`` / ``.parquet`` / ``.txt`` files or a folder of
them (``.txt``: one text per non-empty line; a folder with ``train.*`` files uses those), or
``dschat/builtin`` (texts = prompt + chosen of its train split). The text column is ``"text"`` if
present, else the first column (upstream).

Upstream enabled ptx only when both ``--unsupervised_dataset_name`` and
``--unsupervised_dataset_config_name`` were set, so config-less datasets could not be used (bug list
§10.22); :func:`unsupervised_training_enabled` needs the name only.
"""
from __future__ import annotations

from itertools import chain
from pathlib import Path
from typing import Any

from dschat.data import local_files as lf
from dschat.errors import UserError

TEXT_SUFFIXES: tuple[str, ...] = lf.DATA_SUFFIXES + (".txt",)

__all__ = ["get_unsupervised_data", "load_unsupervised_raw", "unsupervised_training_enabled"]


def unsupervised_training_enabled(args: Any) -> bool:
    """PPO-ptx is on when ``--unsupervised_dataset_name`` is set (a config name is optional)."""
    return bool(getattr(args, "unsupervised_dataset_name", None))


def _read_text_file(path: Path) -> list[dict]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8") from None
    return [{"text": line} for line in lines if line.strip()]


def _read_files(files: list[Path]) -> Any:
    from datasets import DatasetDict

    records: list[dict] = []
    for f in files:
        if f.suffix.lower() == ".txt":
            records.extend(_read_text_file(f))
        else:
            records.extend(row for _, row in lf.read_records(f))
    if not records:
        raise UserError(f"no text rows in {', '.join(str(f) for f in files)}; add some text")
    try:
        return DatasetDict({"train": lf.records_to_dataset(records)})
    except (TypeError, ValueError) as err:  # pyarrow: rows whose fields change type
        raise UserError(f"cannot combine the rows of {files[0].parent}: {err}; give every row the same fields") from None


def load_unsupervised_raw(name: str, config: str | None = None) -> Any:
    """The raw ``DatasetDict`` (with a ``train`` split) for ``--unsupervised_dataset_name``."""
    from dschat.data.raw_datasets import BUILTIN_NAME, builtin_files

    if name == BUILTIN_NAME:
        from datasets import DatasetDict

        train_file = builtin_files()[0]
        rows = lf.check_columns(lf.read_records(train_file), train_file, ("prompt", "chosen"))
        texts = [r["prompt"] + r["chosen"] for r in rows if r["prompt"] is not None and r["chosen"] is not None]
        return DatasetDict({"train": lf.records_to_dataset([{"text": t} for t in texts], ["text"])})
    path = lf.expand(name)
    if path.exists():
        if lf.is_save_to_disk_dir(path):
            from datasets import load_from_disk

            try:
                loaded = load_from_disk(str(path))
            except (OSError, ValueError) as err:
                raise UserError(f"cannot read the save_to_disk folder {path} ({err}); re-save it") from None
            splits = dict(loaded.items()) if hasattr(loaded, "items") else {"train": loaded}
            if "train" not in splits:
                raise UserError(f"save_to_disk folder {path} has no 'train' split (has {sorted(splits)})")
            from datasets import DatasetDict

            return DatasetDict({"train": splits["train"]})
        files = [path] if path.is_file() else lf.data_files_in(path, TEXT_SUFFIXES)
        if path.is_dir():
            train_files = [f for f in files if f.stem.lower() in lf.TRAIN_STEMS]
            files = train_files or files
        if not files or any(f.suffix.lower() not in TEXT_SUFFIXES for f in files):
            raise UserError(
                f"{path} is not a save_to_disk folder or .json/.jsonl/.parquet/.txt file(s); "
                "pass one for --unsupervised_dataset_name"
            )
        return _read_files(files)
    if lf.looks_like_path(name):
        raise UserError(f"--unsupervised_dataset_name {name!r} does not exist; check the path")
    from datasets import load_dataset
    from datasets.exceptions import DatasetsError

    try:
        return load_dataset(name, config)
    except (OSError, ValueError, DatasetsError) as err:
        first = str(err).splitlines()[0] if str(err) else ""
        raise UserError(
            f"cannot load unsupervised dataset {name!r} (config {config!r}) ({type(err).__name__}: {first}); "
            "check the name and network, or pass a local text/JSON file or save_to_disk folder"
        ) from None


def get_unsupervised_data(args: Any, tokenizer: Any) -> Any:
    """Tokenised, grouped PPO-ptx blocks (upstream); a ``datasets.Dataset`` of
    ``input_ids`` / ``attention_mask`` / ``labels`` lists, ``block_size`` tokens each (the last
    block of a map batch of 1000 texts drops its remainder, as upstream).

    Reads ``args.unsupervised_dataset_name``, ``args.unsupervised_dataset_config_name`` (optional),
    ``args.preprocessing_num_workers``, ``args.max_prompt_seq_len``, ``args.max_answer_seq_len``.
    """
    raw = load_unsupervised_raw(args.unsupervised_dataset_name, getattr(args, "unsupervised_dataset_config_name", None))
    if "train" not in raw:
        raise UserError(f"unsupervised dataset {args.unsupervised_dataset_name!r} has no 'train' split (has {list(raw)})")
    column_names = raw["train"].column_names
    text_column_name = "text" if "text" in column_names else column_names[0]
    feature = raw["train"].features[text_column_name]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise UserError(
            f"unsupervised dataset {args.unsupervised_dataset_name!r}: the text column {text_column_name!r} "
            f"holds {feature}, not strings; name the column 'text'"
        )
    num_proc = getattr(args, "preprocessing_num_workers", None)

    def tokenize_function(examples: dict) -> Any:
        return tokenizer(examples[text_column_name])

    tokenized_datasets = raw.map(
        tokenize_function,
        batched=True,
        num_proc=num_proc,
        remove_columns=column_names,
        load_from_cache_file=True,
        desc="Running tokenizer on dataset",
    )
    block_size = args.max_prompt_seq_len + args.max_answer_seq_len

    def group_texts(examples: dict) -> dict:
        # Concatenate all texts of the batch, then cut into block_size chunks; the remainder is
        # dropped when there is at least one full block (upstream / HF run_clm).
        concatenated = {k: list(chain(*examples[k])) for k in examples.keys()}
        total_length = len(concatenated[list(examples.keys())[0]])
        if total_length >= block_size:
            total_length = (total_length // block_size) * block_size
        result = {
            k: [t[i:i + block_size] for i in range(0, total_length, block_size)]
            for k, t in concatenated.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    lm_datasets = tokenized_datasets.map(
        group_texts,
        batched=True,
        num_proc=num_proc,
        load_from_cache_file=True,
        desc=f"Grouping texts in chunks of {block_size}",
    )
    return lm_datasets["train"]
