"""Reading local data files with errors people can act on, and content fingerprints for the cache.

Every JSON / JSON Lines file is parsed with the standard library first (not by pyarrow:
docs/upstream.md#small-fixes), so a bad line is reported as ``file:line``, and missing columns name the file.

The parsed rows are turned into an in-memory :class:`datasets.Dataset` (``Dataset.from_list``)
rather than re-read through ``load_dataset("json", data_files=...)``: same rows, one parse instead
of two, and no second on-disk Arrow cache under ``~/.cache/huggingface`` keyed by file
modification time (a second source of staleness: docs/upstream.md#data-cache).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from dschat.errors import UserError, cannot_read, first_line
from dschat.runtime.trust import walk_through_links

#: Suffixes of preference-data files (prompt / chosen / rejected columns).
DATA_SUFFIXES: tuple[str, ...] = (".json", ".jsonl", ".parquet")
#: Split names that start a data folder's file names: the train split and the held-out split.
TRAIN_STEMS: tuple[str, ...] = ("train",)
EVAL_STEMS: tuple[str, ...] = ("eval", "test", "validation")
#: The hub's shard suffix of a file stem (its parquet export: ``train-00000-of-00001``, also with a
#: hash after it, as ``train-00000-of-00001-2a1df75c6bce91ab``).
_SHARD = re.compile(r"^(?P<base>.+?)-\d{5}-of-\d{5}(?:-[0-9a-f]+)?$")

__all__ = [
    "DATA_SUFFIXES",
    "EVAL_STEMS",
    "TRAIN_STEMS",
    "exists",
    "expand",
    "looks_like_path",
    "is_save_to_disk_dir",
    "load_save_to_disk",
    "data_files_in",
    "split_data_files",
    "split_name",
    "shard_base",
    "check_data_suffix",
    "read_records",
    "records_to_dataset",
    "check_columns",
    "sha256_file",
    "fingerprint_files",
    "files_under",
]


def exists(path: Path) -> bool:
    """``path.exists()``, with a folder on the way that this account may not enter as :func:`cannot_read`'s line."""
    try:
        return path.exists()
    except PermissionError as err:
        raise cannot_read(path.parent, err) from None


def expand(path: str | os.PathLike) -> Path:
    """``~`` expanded, otherwise as given (relative paths stay relative to the current directory)."""
    return Path(os.path.expanduser(os.fspath(path)))


def looks_like_path(name: str) -> bool:
    """True for names that can only be meant as local paths (not hub ids like ``org/name``)."""
    return (
        name.startswith(("/", "./", "../", "~"))
        or name in (".", "..")
        or name.lower().endswith(DATA_SUFFIXES + (".txt", ".arrow"))
    )


def is_save_to_disk_dir(path: Path) -> bool:
    """A folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``."""
    try:
        return path.is_dir() and (
            (path / "dataset_dict.json").is_file()
            or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file())
        )
    except PermissionError as err:  # a folder this account may not enter
        raise cannot_read(path, err) from None


def _load_saved_split(folder: Path) -> Any:
    """One ``Dataset.save_to_disk`` folder; a split saved with 0 rows becomes an empty ``Dataset``.

    ``save_to_disk`` writes no Arrow file for a 0-row split, and ``load_from_disk`` then fails with
    an ``IndexError`` inside ``concat_tables``; the saved features (``dataset_info.json``) give the
    empty split its columns, so the schema checks and the "split is empty" answers apply to it.
    """
    # lazy: datasets costs 1.0 s at import (python -X importtime); every step imports this module,
    # and a cached build reads no raw data
    from datasets import Dataset, DatasetInfo

    state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
    if state.get("_data_files"):
        return Dataset.load_from_disk(str(folder))
    features = DatasetInfo.from_directory(str(folder)).features
    if features is None:
        return Dataset.from_dict({})
    return Dataset.from_dict({name: [] for name in features}, features=features)


def load_save_to_disk(path: Path) -> dict[str, Any]:
    """The splits of a ``save_to_disk`` folder: ``{split: Dataset}``, ``{"train": ds}`` for a single
    saved ``Dataset``. Splits saved with 0 rows are empty datasets (see :func:`_load_saved_split`).

    Any failure while reading the folder is one :class:`UserError` naming it and the problem.
    """
    try:
        if (path / "dataset_dict.json").is_file():
            # What DatasetDict.load_from_disk does, one split at a time.
            names = json.loads((path / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
            return {str(name): _load_saved_split(path / str(name)) for name in names}
        return {"train": _load_saved_split(path)}
    except Exception as err:  # noqa: BLE001 - whatever datasets/pyarrow/json raise here is about this folder
        first = first_line(err) or "no message"
        raise UserError(
            f"cannot read the save_to_disk folder {path} ({type(err).__name__}: {first}); re-save it with "
            "Dataset.save_to_disk / DatasetDict.save_to_disk, or pass the data as .json/.jsonl/.parquet files"
        ) from None


def data_files_in(folder: Path, suffixes: Sequence[str] = DATA_SUFFIXES) -> list[Path]:
    """Data files directly inside ``folder`` (not recursive, hidden files skipped), sorted by name."""
    try:
        return sorted(
            p for p in folder.iterdir()
            if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in suffixes
        )
    except PermissionError as err:
        raise cannot_read(folder, err) from None


def shard_base(path: Path) -> str:
    """A data file's stem without the hub's shard suffix: ``train`` for ``train-00000-of-00002.parquet``,
    ``train-00000-of-00001-2a1df75c6bce91ab.parquet`` and ``train.jsonl``, ``dev`` for
    ``dev-00000-of-00001.parquet``."""
    match = _SHARD.match(path.stem)
    return match["base"] if match else path.stem


def split_name(path: Path) -> str | None:
    """The split a data file's name gives it: ``"train"``, ``"eval"``, ``"test"`` or ``"validation"``
    (lower case) when its stem is that name, alone or with the hub's shard suffix (``train.jsonl``,
    ``Test.json``, ``train-00000-of-00001.parquet``); None for any other name (``training.jsonl``,
    ``train_small.jsonl``, ``data.jsonl``)."""
    base = shard_base(path).lower()
    return base if base in TRAIN_STEMS + EVAL_STEMS else None


def split_data_files(files: Sequence[Path]) -> dict[str, list[Path]]:
    """Group a folder's files into ``{"train": [...], "eval": [...]}`` by :func:`split_name`.

    Files named ``train`` form the train split and ``eval`` / ``test`` / ``validation`` the eval split
    (:func:`split_name`; each may be several shards, as the hub's ``train-00000-of-00002.parquet``,
    ``train-00001-of-00002.parquet``). A folder with no such names is one train-only split
    (``{"train": all}``). Other files next to split-named ones would be silently dropped, so they
    are an error, and so is a held-out split without a train split.
    """
    train = [f for f in files if split_name(f) in TRAIN_STEMS]
    held_out = [f for f in files if split_name(f) in EVAL_STEMS]
    if not train and not held_out:
        return {"train": list(files)}
    folder = files[0].parent
    others = [f.name for f in files if f not in train and f not in held_out]
    if others:
        raise UserError(
            f"{folder} mixes split files (train, eval/test/validation, or their hub shards) with other data files "
            f"({', '.join(others)}); rename them to train.* / eval.* or move them out"
        )
    if not train:
        raise UserError(
            f"{folder} has {', '.join(f.name for f in held_out)} but no train file; add one "
            "(or name the files otherwise to use the folder as one train-only split)"
        )
    return {"train": train, "eval": held_out} if held_out else {"train": train}


def _check_record(obj: Any, where: str) -> dict:
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a JSON object with named fields, got {type(obj).__name__}")
    return obj


def _json_error(err: json.JSONDecodeError) -> str:
    """``"Expecting value at column 5"``; some messages already end in "at" ("Unterminated string
    starting at"), which must not become "at at"."""
    return f"{err.msg}{'' if err.msg.endswith(' at') else ' at'} column {err.colno}"


def _read_json_lines(path: Path, text: str) -> list[tuple[str, dict]]:
    # Lines end at "\n" only (JSON Lines; a "\r" before it is dropped): str.splitlines() would also
    # split at U+2028 / U+2029 / U+0085 and other separators that are legal raw characters inside
    # JSON strings (json.dumps(ensure_ascii=False) writes them raw), breaking valid rows in two.
    rows = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{where}: malformed JSON ({_json_error(err)}); fix or remove that line") from None
        rows.append((where, _check_record(obj, where)))
    return rows


def check_data_suffix(path: Path) -> None:
    """Refuse a data file of a format dschat does not read (a ``.csv`` would be parsed as JSON)."""
    if path.suffix.lower() in DATA_SUFFIXES:
        return
    kind = f"{path.suffix[1:].upper()} ({path.suffix})" if path.suffix else "a file without a suffix"
    how = ("e.g. with pandas: pd.read_csv(f).to_json('data.jsonl', orient='records', lines=True)"
           if path.suffix.lower() == ".csv" else "one JSON object per line, with prompt/chosen[/rejected]")
    raise UserError(f"{path}: {kind} is not a supported local data format; dschat reads {', '.join(DATA_SUFFIXES)} "
                    f"files: convert it ({how})")


def read_records(path: Path) -> list[tuple[str, dict]]:
    """Rows of a ``.json`` (a list of objects, or JSON Lines) / ``.jsonl`` / ``.parquet`` file.

    Each row comes with a location (``file:line`` for JSON Lines, ``file item N`` for a JSON list,
    ``file row N`` for parquet) for error messages. Raises :class:`UserError` for a missing or
    unreadable file and for malformed JSON, naming the file and line.
    """
    if not exists(path) or not path.is_file():
        raise UserError(f"data file {path} does not exist; check the path")
    check_data_suffix(path)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        # lazy: pyarrow.parquet costs 0.18 s at import (python -X importtime); only parquet files need it
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except PermissionError as err:
            raise cannot_read(path, err) from None
        except (OSError, pa.ArrowException) as err:
            raise UserError(f"{path}: not a readable parquet file ({err}); re-export it") from None
        return [(f"{path} row {i + 1}", row) for i, row in enumerate(table.to_pylist())]
    try:
        text = path.read_text(encoding="utf-8")
    except PermissionError as err:
        raise cannot_read(path, err) from None
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8") from None
    if suffix == ".jsonl":
        return _read_json_lines(path, text)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":  # several top-level values: JSON Lines saved as .json
            return _read_json_lines(path, text)
        raise UserError(
            f"{path}:{err.lineno}: malformed JSON ({_json_error(err)}); fix the file"
        ) from None
    if isinstance(obj, dict):  # one object: a one-row JSON Lines file
        return [(f"{path}:1", obj)]
    if not isinstance(obj, list):
        raise UserError(f"{path}: expected a JSON list of objects (or JSON Lines), got {type(obj).__name__}")
    return [(f"{path} item {i + 1}", _check_record(o, f"{path} item {i + 1}")) for i, o in enumerate(obj)]


def check_columns(
    rows: Iterable[tuple[str, Mapping[str, Any]]],
    path: Path,
    required: Sequence[str],
    optional: Sequence[str] = (),
    *,
    text: Sequence[str] | None = None,
    nullable: bool = True,
    keep_extra: bool = False,
) -> list[dict]:
    """Keep only the ``required`` + ``optional`` fields of each row, checking their values; with
    ``keep_extra`` every other field too, unchecked, after them (a reference answer a reward function
    or an environment reads: the rows' dataset columns).

    A row missing a required field, or a ``text`` field (default: every field) that is neither a
    string nor null, is a :class:`UserError` naming the file, the row and the column. A null value
    is kept (the adapter returns None for it and the row is skipped, as upstream skips None
    samples); with ``nullable=False`` (an adapter that cannot skip such a row) it is an error too,
    in any required or text field.
    """
    out = []
    names = list(required) + list(optional)
    text_names = names if text is None else list(text)
    for where, row in rows:
        for col in required:
            if col not in row:
                raise UserError(
                    f"{where}: missing field {col!r} (have {sorted(row)}); every row of {path.name} "
                    f"needs {', '.join(repr(c) for c in required)}"
                )
        for col in names:
            value = row.get(col)
            if value is None:
                if not nullable and (col in required or col in text_names):
                    raise UserError(
                        f"{where}: field {col!r} is null; every row of {path.name} needs a value there "
                        "(fill it in or remove the row)"
                    )
                continue
            if col in text_names and not isinstance(value, str):
                kinds = "a string or null" if nullable else "a string"
                raise UserError(f"{where}: field {col!r} must be {kinds}, got {type(value).__name__}")
        kept = {col: row.get(col) for col in names}
        if keep_extra:
            kept.update({col: value for col, value in row.items() if col not in kept})
        out.append(kept)
    if keep_extra:  # every row has every column (None where a row lacks one), in first-seen order
        extra = list(dict.fromkeys(col for row in out for col in row if col not in names))
        out = [{**row, **{col: row.get(col) for col in extra}} for row in out]
    return out


def records_to_dataset(records: list[dict], columns: Sequence[str] | None = None, source: Any = None) -> Any:
    """An in-memory :class:`datasets.Dataset` of ``records`` (``columns`` fixes their order).

    Rows whose fields change type from row to row cannot form one Arrow table; with ``source``
    (the file or folder they came from) that is a :class:`UserError` naming it.
    """
    # lazy: datasets (with pyarrow) costs 1.0 s at import; see _load_saved_split
    import pyarrow as pa
    from datasets import Dataset

    try:
        if not records and columns is not None:
            return Dataset.from_dict({c: [] for c in columns})
        return Dataset.from_list(records)
    except (TypeError, ValueError, pa.ArrowException) as err:
        if source is None:
            raise
        if isinstance(err, UnicodeEncodeError):  # JSON's "\ud800" escapes decode to unpaired surrogates
            raise UserError(f"{source} holds text that is not valid Unicode (an unpaired surrogate such as a "
                            f"JSON \\ud800 escape without its pair: {err.object[err.start:err.end]!r}); fix or drop "
                            "that escape") from None
        first = first_line(err) or type(err).__name__
        raise UserError(
            f"cannot combine the rows of {source} into one table ({first}); give every row the same "
            "fields, each with one type in every row"
        ) from None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except PermissionError as err:
        raise cannot_read(path, err) from None
    return h.hexdigest()


def files_under(folder: Path) -> list[Path]:
    """Every regular file below ``folder`` (recursive, through linked folders as ``load_from_disk``
    reads them; a folder reached twice, as by a link cycle, is walked once), sorted; hidden names
    skipped."""
    def refuse(err: OSError) -> None:  # ``folder`` itself; a subfolder it may not list is skipped, as before
        if isinstance(err, PermissionError) and os.path.samefile(err.filename or folder, folder):
            raise cannot_read(folder, err) from None

    out = []
    for root, dirs, files in walk_through_links(folder, onerror=refuse):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out.extend(Path(root) / f for f in sorted(files) if not f.startswith("."))
    return sorted(out)


def fingerprint_files(files: Iterable[Path], base: Path | None = None) -> str:
    """SHA-256 over (relative name, content SHA-256) of ``files``: changes when any byte does."""
    h = hashlib.sha256()
    for f in sorted(files):
        name = os.path.relpath(f, base) if base is not None else f.name
        h.update(name.encode("utf-8", "surrogateescape") + b"\0" + sha256_file(f).encode() + b"\n")
    return h.hexdigest()
