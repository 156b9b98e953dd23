"""Upstream's adapter template, :class:`PromptRawDataset`, and how an adapter loads its data.

Every adapter turns a row of its source into upstream's text convention (``raw_datasets.py``):

* ``get_prompt(s)``: ``" Human: " + question + " Assistant:"``
* ``get_chosen(s)`` / ``get_rejected(s)``: ``" " + answer``
* ``get_prompt_and_chosen(s)`` / ``get_prompt_and_rejected(s)``: the full conversation text,
  usually ``" Human: " + question + " Assistant: " + answer``

(the Dahoas sets already carry ``"\\n\\nHuman: ...\\n\\nAssistant:"`` prompts and are used verbatim).
A method returns ``None`` when the row has no usable text; such rows are skipped. Datasets without a
rejected answer return ``None`` for the rejected methods and cannot feed phase 2.

Datasets that ship only a train split are divided 9:1 into train/eval through
:func:`dschat.data.split.get_raw_dataset_split_index` with ``split_name="train_eval"``, ``"9,1"``.

An adapter's data is injected (``raw_datasets``), read from an existing local path (a
``save_to_disk`` folder or split-named files), or loaded from the Hugging Face hub.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

from dschat.data import local_files as lf
from dschat.data.split import get_raw_dataset_split_index
from dschat.errors import UserError, first_line

Sample = Mapping[str, Any]

#: Column names of our local forms (and of ``local/jsonfile``).
PREF_REQUIRED: tuple[str, ...] = ("prompt", "chosen")
PREF_OPTIONAL: tuple[str, ...] = ("rejected",)


def _subset(dataset: Any, index: Sequence[int]) -> Any:
    """Rows ``index`` of ``dataset``: ``Dataset.select`` for HF datasets, else a torch ``Subset``."""
    if hasattr(dataset, "select"):
        return dataset.select(index)
    # lazy: torch costs 1.3 s at import (python -X importtime); the adapters stay torch-free so that
    # python -m dschat.data.prepare checks names, paths and rows before it loads torch
    from torch.utils.data import Subset

    return Subset(dataset, list(index))


def _column_names(split: Any) -> list[str] | None:
    names = getattr(split, "column_names", None)
    return list(names) if names is not None else None


def _load_hub(name: str) -> Any:
    """``datasets.load_dataset(name)`` with failures turned into one actionable line."""
    # lazy: datasets costs 1.0 s at import (python -X importtime); a cached build (and local data) never loads the hub
    from datasets import load_dataset
    from datasets.exceptions import DatasetsError

    try:
        return load_dataset(name)
    except (OSError, ValueError, DatasetsError) as err:
        first = first_line(err)
        raise UserError(
            f"cannot load dataset {name!r} from the Hugging Face hub ({type(err).__name__}: {first}); "
            "check the network (and HF_HUB_OFFLINE / HF_DATASETS_OFFLINE), or pass a local copy: a "
            "save_to_disk folder whose path contains the name, e.g. /data/" + name
        ) from None


def _load_local_copy(path: Path, dataset_name: str, adapter: type["PromptRawDataset"]) -> Any:
    """A local copy of a hub dataset: a ``save_to_disk`` folder (upstream), or split-named files.

    Rows of files are checked against ``adapter``'s columns as local preference files are (a
    missing field, a null the adapter cannot skip, a non-string text field: one line naming the
    file and row) and keep only those columns.
    """
    if lf.is_save_to_disk_dir(path):
        # A single saved Dataset is its train split (upstream crashed: docs/upstream.md#small-fixes).
        return lf.load_save_to_disk(path)
    # Beyond upstream: train.jsonl / test.jsonl / train-00000-of-00001.parquet ... (any of our data suffixes), or one file.
    files = [path] if path.is_file() else (lf.data_files_in(path) if path.is_dir() else [])
    if not files or any(f.suffix.lower() not in lf.DATA_SUFFIXES for f in files):
        raise UserError(
            f"{path} exists but is neither a save_to_disk folder nor .json/.jsonl/.parquet files; "
            f"for {dataset_name!r} pass a folder written by DatasetDict.save_to_disk"
        )
    # lazy: datasets costs 1.0 s at import (see _load_hub)
    from datasets import DatasetDict

    # A file's split is its stem without the hub's shard suffix (train-00000-of-00001.parquet and
    # dev-00000-of-00001.parquet are the train and dev splits).
    by_split: dict[str, list[Path]] = {}
    for f in files:
        by_split.setdefault(lf.shard_base(f).lower() if len(files) > 1 else "train", []).append(f)
    required = adapter.required_columns
    out = {}
    for split, split_files in by_split.items():
        records = []
        for f in split_files:
            records.extend(lf.check_columns(
                lf.read_records(f), f, required, text=adapter.text_columns, nullable=adapter.skips_null_rows,
            ))
        source = split_files[0] if len(split_files) == 1 else path
        out[split] = lf.records_to_dataset(records, required, source=source)
    return DatasetDict(out)


# ---------------------------------------------------------------------------------------------
# Base class
# ---------------------------------------------------------------------------------------------


class PromptRawDataset:
    """Upstream's template: a dataset of prompts with chosen (and maybe rejected) answers.

    Subclasses declare where their splits live (``train_split`` / ``eval_split``; ``eval_split =
    None`` means a 9:1 split of the train split) and which columns they read (``required_columns``,
    checked when the data is loaded so a wrong schema fails at once with the column's name, not as
    a ``KeyError`` mid-tokenisation).

    ``raw_datasets`` (beyond upstream) injects an already loaded ``DatasetDict`` / mapping of splits,
    e.g. an in-memory one in tests. Otherwise an existing local path is loaded from disk, and any
    other name from the Hugging Face hub.
    """

    dataset_name: str = ""
    dataset_name_clean: str = ""
    #: Split names read from ``raw_datasets`` (``eval_split = None``: 9:1 split of train).
    train_split: str = "train"
    eval_split: str | None = "test"
    #: Top-level columns the text methods read.
    required_columns: ClassVar[tuple[str, ...]] = ()
    #: Those of them that hold text (None: all of them); checked in rows of local JSON/parquet copies.
    text_columns: ClassVar[tuple[str, ...] | None] = None
    #: True if every text method returns None (the row is skipped) for a null in a required column;
    #: otherwise a null there is refused when a local copy is read.
    skips_null_rows: ClassVar[bool] = False
    #: False for single-answer datasets (no rejected response: unusable for phase 2).
    has_rejected: bool = True
    #: False for prompt-only datasets (no chosen answer either: for step 3 only).
    has_chosen: bool = True
    #: Name passed to ``load_dataset`` when it differs from the ``--data_path`` entry (mkqa).
    hub_name: ClassVar[str | None] = None

    def __init__(
        self,
        output_path: str,
        seed: int | None,
        local_rank: int,
        dataset_name: str,
        raw_datasets: Any = None,
    ) -> None:
        self.output_path = output_path
        self.seed = seed
        self.local_rank = local_rank
        self._warned_no_rejected = False
        if raw_datasets is None:
            raw_datasets = self._load(dataset_name)
        self.raw_datasets = raw_datasets
        if self.raw_datasets is not None:
            self._check_schema(dataset_name)

    # -- loading ------------------------------------------------------------------------------
    def _load(self, dataset_name: str) -> Any:
        path = lf.expand(dataset_name)
        if path.exists():
            return _load_local_copy(path, dataset_name, type(self))
        if dataset_name == "local/jsonfile":
            return None  # LocalJsonFileDataset loads its own files (upstream)
        return _load_hub(self.hub_name or dataset_name)

    def _splits_used(self) -> list[str]:
        return [self.train_split] + ([self.eval_split] if self.eval_split else [])

    def _check_schema(self, source: str) -> None:
        available = list(self.raw_datasets.keys()) if hasattr(self.raw_datasets, "keys") else None
        for split in self._splits_used():
            if available is not None and split not in available:
                raise UserError(
                    f"dataset {source!r} has no {split!r} split (it has {available}); the "
                    f"{type(self).__name__} adapter reads {self._splits_used()}"
                )
            columns = _column_names(self.raw_datasets[split])
            missing = [c for c in self.required_columns if columns is not None and c not in columns]
            if missing:
                raise UserError(
                    f"dataset {source!r} split {split!r} lacks column(s) {missing} (has {columns}); "
                    f"the {type(self).__name__} adapter needs {list(self.required_columns)}"
                )
            self._check_text_types(source, split)

    def _check_text_types(self, source: str, split: str) -> None:
        """A text column of a loaded ``Dataset`` (a ``save_to_disk`` folder, a hub dataset) whose
        feature is not a string (an ``int64`` prompt): one line, where JSON and parquet rows get theirs
        from :func:`~dschat.data.local_files.check_columns` (it was a ``TypeError`` mid-tokenisation)."""
        features = getattr(self.raw_datasets[split], "features", None)
        if not isinstance(features, Mapping):
            return
        for col in self.required_columns if self.text_columns is None else self.text_columns:
            if col not in features:
                continue
            dtype = getattr(features[col], "dtype", type(features[col]).__name__)
            if dtype not in ("string", "large_string", "null"):
                raise UserError(f"dataset {source!r} split {split!r} column {col!r} holds {dtype}, not text; the "
                                f"{type(self).__name__} adapter reads it as text: save it as strings")

    # -- splits -------------------------------------------------------------------------------
    def _train_eval_subset(self, index: int) -> Any:
        """Chunk ``index`` (0 = train, 1 = eval) of a 9:1 split of a train-only dataset."""
        dataset = self.raw_datasets[self.train_split]
        rows = get_raw_dataset_split_index(
            self.local_rank, self.output_path, self.dataset_name_clean, self.seed,
            "train_eval", "9,1", index, len(dataset),
        )
        return _subset(dataset, rows)

    def get_train_data(self) -> Any:
        if self.eval_split is None:
            return self._train_eval_subset(0)
        return self.raw_datasets[self.train_split]

    def get_eval_data(self) -> Any:
        if self.eval_split is None:
            return self._train_eval_subset(1)
        return self.raw_datasets[self.eval_split]

    # -- text (upstream's template returns None) ----------------------------------------------
    # The prompt should be in the format of: " Human: " + actual_prompt_sentence + " Assistant:"
    def get_prompt(self, sample: Sample) -> str | None:
        return None

    # The chosen response should be in the format of: " " + actual_response_sentence
    def get_chosen(self, sample: Sample) -> str | None:
        return None

    # The rejected response should be in the format of: " " + actual_response_sentence;
    # None if the dataset has no rejected response.
    def get_rejected(self, sample: Sample) -> str | None:
        return None

    def get_prompt_and_chosen(self, sample: Sample) -> str | None:
        return None

    def get_prompt_and_rejected(self, sample: Sample) -> str | None:
        return None

    def _no_rejected(self) -> None:
        # Upstream prints this for every row; once per dataset is enough.
        if not self._warned_no_rejected:
            print(f"Warning: dataset {self.dataset_name} does not include rejected response.")
            self._warned_no_rejected = True
        return None


class _SingleAnswerDataset(PromptRawDataset):
    """Datasets with one answer per prompt: no rejected response."""

    has_rejected = False

    def get_rejected(self, sample: Sample) -> None:
        return self._no_rejected()

    def get_prompt_and_rejected(self, sample: Sample) -> None:
        return self._no_rejected()


def _human(question: str) -> str:
    return " Human: " + question + " Assistant:"


def _dialog(question: str, answer: str) -> str:
    return " Human: " + question + " Assistant: " + answer
