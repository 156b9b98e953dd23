"""Plain-text data for PPO-ptx (InstructGPT's pretraining mix), as upstream's ``get_unsupervised_data``.

Texts are tokenised, concatenated and cut into blocks of ``max_prompt_seq_len + max_answer_seq_len``
tokens with ``labels = input_ids`` (``group_texts``, the Hugging Face ``run_clm`` recipe), and fed to
the actor with ``default_data_collator``.

Sources: a hub dataset name (+ optional config), as upstream; beyond upstream, a local
``save_to_disk`` folder, local ``.json`` / ``.jsonl`` / ``.parquet`` / ``.txt`` files or a folder of
them (``.txt``: one text per non-empty line; a folder with ``train.*`` files uses those), or
``dschat/builtin`` (texts = prompt + chosen of its train split). The text column is ``"text"`` if
present, else the first column (upstream).

PPO-ptx is on when ``--unsupervised_dataset_name`` is set (:func:`unsupervised_training_enabled`); the
config name is optional (upstream required both: docs/upstream.md#ppo-ptx-text).
"""
from __future__ import annotations

import os
from itertools import chain
from pathlib import Path
from typing import Any

from dschat.data import local_files as lf
from dschat.data.adapters.local import builtin_files, builtin_folders
from dschat.data.cache import cache_key, private_folder, tokenizer_fingerprint
from dschat.errors import UserError, first_line

TEXT_SUFFIXES: tuple[str, ...] = lf.DATA_SUFFIXES + (".txt",)

__all__ = ["get_unsupervised_data", "load_unsupervised_raw", "unsupervised_training_enabled"]


def unsupervised_training_enabled(args: Any) -> bool:
    """PPO-ptx is on when ``--unsupervised_dataset_name`` is set (a config name is optional)."""
    return bool(getattr(args, "unsupervised_dataset_name", None))


def _read_text_file(path: Path) -> list[tuple[str, dict]]:
    """``(file:line, {"text": line})`` for every non-empty line.

    Lines end at "\\n" (``read_text`` turns "\\r\\n" into it), not at the other separators
    ``str.splitlines`` knows (U+2028, U+0085, ...), as for JSON Lines.
    """
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8") from None
    return [(f"{path}:{i}", {"text": line}) for i, line in enumerate(lines, start=1) if line.strip()]


def _text_column(names: list[str]) -> str:
    """Upstream's rule: ``"text"`` if there is such a column, else the first column."""
    return "text" if "text" in names or not names else names[0]


def _check_texts(rows: list[tuple[str, dict]], files: list[Path]) -> list[dict]:
    """Every row's text field (the column :func:`_text_column` picks, as the ``Dataset`` built from
    these rows will have it) must be a string: a null or missing one would be a ``TypeError``
    inside the tokenizer, deep in ``datasets.map``."""
    if not rows:
        return []
    column = _text_column(list(rows[0][1]))
    for where, row in rows:
        value = row.get(column)
        if not isinstance(value, str):
            if column not in row:
                got = "is missing"
            else:
                got = "is null" if value is None else f"has type {type(value).__name__}"
            raise UserError(
                f"{where}: the text field {column!r} {got}; every row of "
                f"{', '.join(f.name for f in files)} needs a string there (fix or remove the row)"
            )
    return [row for _, row in rows]


def _train_only(train: Any) -> Any:
    """``DatasetDict({"train": train})``."""
    # lazy: datasets costs 1.0 s at import (python -X importtime); step 3 imports this module for
    # unsupervised_training_enabled, and a run without PPO-ptx on a cached prompt set never needs it.
    from datasets import DatasetDict

    return DatasetDict({"train": train})


def _read_files(files: list[Path]) -> Any:
    rows: list[tuple[str, dict]] = []
    for f in files:
        if f.suffix.lower() == ".txt":
            rows.extend(_read_text_file(f))
        else:
            rows.extend(lf.read_records(f))
    if not rows:
        raise UserError(f"no text rows in {', '.join(str(f) for f in files)}; add some text")
    records = _check_texts(rows, files)
    source = files[0] if len(files) == 1 else files[0].parent
    return _train_only(lf.records_to_dataset(records, source=source))


def load_unsupervised_raw(name: str, config: str | None = None) -> Any:
    """The raw ``DatasetDict`` (with a ``train`` split) for ``--unsupervised_dataset_name``."""
    if name in builtin_folders():
        train_file = builtin_files(name)[0]
        rows = lf.check_columns(lf.read_records(train_file), train_file, ("prompt", "chosen"))
        texts = [r["prompt"] + r["chosen"] for r in rows if r["prompt"] is not None and r["chosen"] is not None]
        return _train_only(lf.records_to_dataset([{"text": t} for t in texts], ["text"]))
    path = lf.expand(name)
    if path.exists():
        if lf.is_save_to_disk_dir(path):
            splits = lf.load_save_to_disk(path)
            if "train" not in splits:
                raise UserError(f"save_to_disk folder {path} has no 'train' split (has {sorted(splits)})")
            return _train_only(splits["train"])
        files = [path] if path.is_file() else lf.data_files_in(path, TEXT_SUFFIXES)
        if path.is_dir():
            train_files = [f for f in files if lf.split_name(f) == "train"]
            files = train_files or files
        if not files or any(f.suffix.lower() not in TEXT_SUFFIXES for f in files):
            raise UserError(
                f"{path} is not a save_to_disk folder or .json/.jsonl/.parquet/.txt file(s); "
                "pass one for --unsupervised_dataset_name"
            )
        return _read_files(files)
    if lf.looks_like_path(name):
        raise UserError(f"--unsupervised_dataset_name {name!r} does not exist; check the path")
    # lazy: datasets costs 1.0 s at import (see _train_only)
    from datasets import load_dataset
    from datasets.exceptions import DatasetsError

    try:
        return load_dataset(name, config)
    except (OSError, ValueError, DatasetsError) as err:
        first = first_line(err)
        raise UserError(
            f"cannot load unsupervised dataset {name!r} (config {config!r}) ({type(err).__name__}: {first}); "
            "check the name and network, or pass a local text/JSON file or save_to_disk folder"
        ) from None


def _group_texts(examples: dict, block_size: int, keep_short: bool) -> dict:
    """Concatenate a map batch's token lists and cut them into ``block_size`` chunks (HF ``run_clm``).

    The remainder is dropped. A batch shorter than one block gives no block, unless ``keep_short``:
    then it is one shorter block (upstream, which does so for every such batch).
    """
    concatenated = {k: list(chain(*examples[k])) for k in examples.keys()}
    total_length = len(concatenated["input_ids"])
    if total_length >= block_size or not keep_short:
        total_length = (total_length // block_size) * block_size
    result = {
        k: [t[i:i + block_size] for i in range(0, total_length, block_size)]
        for k, t in concatenated.items()
    }
    result["labels"] = result["input_ids"].copy()
    return result


def _check_no_null_texts(train: Any, column: str, name: str) -> None:
    """A null in the text column (hub / save_to_disk data) would be a TypeError in the tokenizer."""
    # lazy: pyarrow.compute costs 0.2 s at import (python -X importtime); only hub / save_to_disk data reach here
    import pyarrow.compute as pc

    values = train.data.column(column)
    if values.null_count:
        row = pc.index(pc.is_null(values), True).as_py() + 1
        raise UserError(
            f"unsupervised dataset {name!r}: row {row} of the train split has no text (null in column "
            f"{column!r}; {values.null_count} such rows); drop or fill them"
        )


def _ptx_cache_folder(args: Any, dataset: Any, source: Path, tokenizer: Any, block_size: int) -> Path | None:
    """The folder of ``--data_output_path`` (0700, trusted) where the maps of a ``save_to_disk`` corpus
    (``dataset``, read from ``source``) keep their results, memory-mapped as datasets keeps a hub
    dataset's: ``ptx_<key>``, keyed by the folder's file contents, the tokenizer's behaviour and the
    block size. None for data held in memory (no Arrow files of its own) or without the flag."""
    output = getattr(args, "data_output_path", None)
    if not dataset.cache_files or not output:
        return None
    private_folder(output)
    key = cache_key({"ptx_text": lf.fingerprint_files(lf.files_under(source), source),
                     "tokenizer": tokenizer_fingerprint(tokenizer), "block_size": block_size})
    folder = lf.expand(output) / f"ptx_{key[:32]}"
    private_folder(folder)
    return folder


def get_unsupervised_data(args: Any, tokenizer: Any) -> Any:
    """Tokenised, grouped PPO-ptx blocks (upstream); a ``datasets.Dataset`` of
    ``input_ids`` / ``attention_mask`` / ``labels`` lists, all exactly ``block_size`` tokens long.

    Texts are grouped per map batch of 1000 texts, as upstream, and each batch drops its remainder,
    so every block is full and ``default_data_collator`` stacks them (upstream's short blocks:
    docs/upstream.md#ppo-ptx-text). Only when no batch holds a full block is the whole split grouped
    at once: a split shorter than one block then gives that one shorter block (a single block always
    stacks), a longer one gives full blocks.

    Reads ``args.unsupervised_dataset_name``, ``args.unsupervised_dataset_config_name`` (optional),
    ``args.preprocessing_num_workers``, ``args.max_prompt_seq_len``, ``args.max_answer_seq_len``,
    ``args.data_output_path`` (optional: where a ``save_to_disk`` corpus's blocks are cached,
    :func:`_ptx_cache_folder`).
    """
    name = args.unsupervised_dataset_name
    raw = load_unsupervised_raw(name, getattr(args, "unsupervised_dataset_config_name", None))
    if "train" not in raw:
        raise UserError(f"unsupervised dataset {name!r} has no 'train' split (has {list(raw)})")
    if len(raw["train"]) == 0:  # e.g. a save_to_disk copy saved with 0 rows
        raise UserError(
            f"unsupervised dataset {name!r}: its train split is empty (0 rows); add some text or drop "
            "--unsupervised_dataset_name"
        )
    raw = _train_only(raw["train"])  # the only split used (upstream tokenised them all)
    column_names = raw["train"].column_names
    text_column_name = _text_column(column_names)
    feature = raw["train"].features[text_column_name]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise UserError(
            f"unsupervised dataset {name!r}: the text column {text_column_name!r} "
            f"holds {feature}, not strings; name the column 'text'"
        )
    _check_no_null_texts(raw["train"], text_column_name, name)
    num_proc = _worker_processes(getattr(args, "preprocessing_num_workers", None))

    def tokenize_function(examples: dict) -> Any:
        return tokenizer(examples[text_column_name])

    block_size = args.max_prompt_seq_len + args.max_answer_seq_len
    # Where the maps keep their results: datasets' own cache for hub data (as upstream); for a local
    # save_to_disk folder a folder of dschat's cache (datasets would write into the user's data folder,
    # a traceback where they may not write); in memory for text already read into memory.
    source = lf.expand(name)
    local = source.exists()
    folder = _ptx_cache_folder(args, raw["train"], source, tokenizer, block_size) if local else None
    in_memory = local and folder is None

    def where(file: str) -> dict[str, Any]:
        return {"cache_file_names": {"train": str(folder / file)}} if folder is not None else {}

    tokenized_datasets = raw.map(
        tokenize_function,
        batched=True,
        num_proc=num_proc,
        remove_columns=column_names,
        load_from_cache_file=not in_memory,
        keep_in_memory=in_memory,
        desc="Running tokenizer on dataset",
        **where("tokens.arrow"),
    )

    def group(keep_short: bool, desc: str, **map_kwargs: Any) -> Any:
        return tokenized_datasets.map(_group_texts, batched=True, load_from_cache_file=not in_memory,
                                      keep_in_memory=in_memory, desc=desc,
                                      fn_kwargs={"block_size": block_size, "keep_short": keep_short},
                                      **where("blocks_whole.arrow" if keep_short else "blocks.arrow"), **map_kwargs)

    lm_datasets = group(False, f"Grouping texts in chunks of {block_size}", num_proc=num_proc)
    if len(lm_datasets["train"]) == 0:
        # No batch of 1000 texts filled a block: group the whole split as one batch (one process,
        # so one remainder at most), keeping it as one shorter block if that is all there is.
        lm_datasets = group(True, f"Grouping all texts in chunks of {block_size}", batch_size=None)
    if len(lm_datasets["train"]) == 0:
        raise UserError(f"unsupervised dataset {name!r} gives no tokens; give it some text")
    return lm_datasets["train"]


def _worker_processes(asked: int | None) -> int | None:
    """``--preprocessing_num_workers``, at most the CPUs this process may use (one notice when lowered): datasets
    starts one process per worker up to a process per row, so ``100000`` forked a process per row."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if asked is None or asked <= cpus:
        return asked
    print(f"--preprocessing_num_workers {asked}: tokenising the PPO-ptx data with {cpus} processes, the CPUs "
          "this process may use", flush=True)
    return cpus
