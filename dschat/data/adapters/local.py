"""Adapters of local data: upstream's ``local/jsonfile``, dschat's local files and folders, and the
embedded dataset (``dschat/builtin``).

Local ``.json`` / ``.jsonl`` / ``.parquet`` files or folders of them, and ``save_to_disk`` folders,
hold ``prompt`` / ``chosen`` / optional ``rejected`` columns used verbatim like rm-static's
(``prompt + chosen``: write prompts as ``"\\n\\nHuman: ...\\n\\nAssistant:"`` or
``" Human: ... Assistant:"`` and answers with a leading space).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from dschat.data import builtin
from dschat.data import local_files as lf
from dschat.data.adapters.base import PREF_OPTIONAL, PREF_REQUIRED, PromptRawDataset, Sample, _column_names
from dschat.errors import UserError

#: The ``--data_path`` entry of the embedded dataset.
BUILTIN_NAME = "dschat/builtin"
#: The ``--data_path`` entry of the embedded pairs of an SFT actor's own answers (the CPU demo's
#: step 2 reads them beside ``dschat/builtin``; :mod:`dschat.eval.sample_pairs`).
BUILTIN_SAMPLES_NAME = "dschat/builtin-samples"

# ---------------------------------------------------------------------------------------------
# Upstream's local JSON files
# ---------------------------------------------------------------------------------------------


def _source_root() -> Path:
    """The checkout holding the ``dschat`` package (upstream's DeepSpeed-Chat root)."""
    return Path(__file__).resolve().parents[3]


def find_local_jsonfile_dir() -> Path:
    """The folder holding ``data/train.json`` and ``data/eval.json`` for ``local/jsonfile``.

    The current directory first, then the checkout (docs/upstream.md#small-fixes).
    """
    candidates = list(dict.fromkeys(p.resolve() for p in (Path.cwd(), _source_root())))  # once each
    for root in candidates:
        if (root / "data" / "train.json").is_file() and (root / "data" / "eval.json").is_file():
            return root
    raise UserError(
        "local/jsonfile needs data/train.json and data/eval.json (JSON lists of objects with prompt, "
        f"chosen, rejected); none found under {' or '.join(str(c) for c in candidates)}; create them "
        "there or pass the files directly (--data_path my_data/ with train.json and eval.json)"
    )


class LocalJsonFileDataset(PromptRawDataset):
    """``local/jsonfile``: ``data/train.json`` + ``data/eval.json``; texts ``" " + prompt + " " + chosen``."""

    dataset_name = "local/jsonfile"
    dataset_name_clean = "jsonfile"
    eval_split = "eval"
    required_columns = PREF_REQUIRED

    def __init__(
        self,
        output_path: str,
        seed: int | None,
        local_rank: int,
        dataset_name: str,
        chat_path: str | os.PathLike | None = None,
        raw_datasets: Any = None,
    ) -> None:
        if raw_datasets is None:
            root = Path(chat_path) if chat_path is not None else find_local_jsonfile_dir()
            raw_datasets = self._read(root)
        super().__init__(output_path, seed, local_rank, dataset_name, raw_datasets=raw_datasets)
        self.has_rejected = "rejected" in (_column_names(self.raw_datasets["train"]) or ["rejected"])

    @staticmethod
    def source_files(root: Path) -> list[Path]:
        return [root / "data" / "train.json", root / "data" / "eval.json"]

    @classmethod
    def _read(cls, root: Path) -> Any:
        # lazy: datasets costs 1.0 s at import (python -X importtime); a cached build reads no raw data
        from datasets import DatasetDict

        out = {}
        for split, path in zip(("train", "eval"), cls.source_files(root)):
            rows = lf.check_columns(lf.read_records(path), path, PREF_REQUIRED, PREF_OPTIONAL)
            out[split] = lf.records_to_dataset(rows, PREF_REQUIRED + PREF_OPTIONAL)
        return DatasetDict(out)

    def get_prompt(self, sample: Sample) -> str | None:
        if sample["prompt"] is not None:
            return " " + sample["prompt"]
        return None

    def get_chosen(self, sample: Sample) -> str | None:
        if sample["chosen"] is not None:
            return " " + sample["chosen"]
        return None

    def get_rejected(self, sample: Sample) -> str | None:
        if sample.get("rejected") is not None:
            return " " + sample["rejected"]
        return None

    def get_prompt_and_chosen(self, sample: Sample) -> str | None:
        if sample["prompt"] is not None and sample["chosen"] is not None:
            return " " + sample["prompt"] + " " + sample["chosen"]
        return None

    def get_prompt_and_rejected(self, sample: Sample) -> str | None:
        if sample["prompt"] is not None and sample.get("rejected") is not None:
            return " " + sample["prompt"] + " " + sample["rejected"]
        return None


# ---------------------------------------------------------------------------------------------
# Ours: local files / folders / save_to_disk folders / the builtin dataset
# ---------------------------------------------------------------------------------------------


def _clean_name(name: str) -> str:
    return "local_" + (re.sub(r"[^0-9A-Za-z]+", "_", Path(name).name or name).strip("_") or "data")


class LocalPreferenceDataset(PromptRawDataset):
    """Local prompt / chosen / (optional) rejected data, texts used verbatim (rm-static's convention).

    ``source`` is a ``.json`` / ``.jsonl`` / ``.parquet`` file, a folder of them (``train*`` and
    ``eval*``/``test*``/``validation*`` give both splits, :func:`~dschat.data.local_files.split_name`;
    otherwise all files are one train-only split, divided 9:1), or a ``save_to_disk`` folder (a ``DatasetDict`` with ``train`` and one of
    ``eval``/``test``/``validation``, or one split to divide 9:1).
    """

    required_columns = PREF_REQUIRED

    def __init__(
        self,
        output_path: str,
        seed: int | None,
        local_rank: int,
        dataset_name: str,
        raw_datasets: Any = None,
    ) -> None:
        self.dataset_name = dataset_name
        self.dataset_name_clean = _clean_name(dataset_name)
        if raw_datasets is None:
            raw_datasets = self.read(lf.expand(dataset_name))
        raw_datasets = dict(raw_datasets.items()) if hasattr(raw_datasets, "items") else {"train": raw_datasets}
        held_out = [s for s in ("eval",) + lf.EVAL_STEMS if s in raw_datasets]
        self.eval_split = held_out[0] if held_out else None  # per instance: depends on the files
        super().__init__(output_path, seed, local_rank, dataset_name, raw_datasets=raw_datasets)
        self.has_rejected = "rejected" in (_column_names(raw_datasets["train"]) or [])

    @staticmethod
    def source_files(path: Path) -> list[Path]:
        """The files this dataset reads (for the cache fingerprint)."""
        if path.is_file():
            lf.check_data_suffix(path)
            return [path]
        if lf.is_save_to_disk_dir(path):
            return lf.files_under(path)
        return lf.data_files_in(path)

    @staticmethod
    def read_groups(groups: Mapping[str, Sequence[Path]]) -> dict[str, Any]:
        """``{split: [files]}`` -> ``{split: Dataset}`` with the prompt/chosen/rejected columns and the
        rows' other fields."""
        out = {}
        for split, split_files in groups.items():
            rows: list[dict] = []
            for f in split_files:
                # Other fields (a reference answer, ...) stay: reward functions and environments read them.
                rows.extend(lf.check_columns(lf.read_records(f), f, PREF_REQUIRED, PREF_OPTIONAL, keep_extra=True))
            out[split] = _with_extra_fields(rows, split_files)
        # Files without any "rejected" value give an all-null column: treat it as absent.
        for split, ds in out.items():
            if "rejected" in ds.column_names and all(v is None for v in ds["rejected"]):
                out[split] = ds.remove_columns("rejected")
        return out

    @classmethod
    def read(cls, path: Path) -> dict[str, Any]:
        if not lf.exists(path):
            raise UserError(f"data path {path} does not exist; check --data_path")
        if lf.is_save_to_disk_dir(path):
            return cls._read_disk(path)
        files = cls.source_files(path)
        if not files:
            raise UserError(
                f"{path} holds no .json/.jsonl/.parquet files and is not a save_to_disk folder; "
                "point --data_path at a data file or a folder of them"
            )
        groups = lf.split_data_files(files) if path.is_dir() else {"train": files}
        return cls.read_groups(groups)

    @staticmethod
    def _read_disk(path: Path) -> dict[str, Any]:
        splits = lf.load_save_to_disk(path)
        if "train" not in splits:
            if len(splits) != 1:
                raise UserError(f"save_to_disk folder {path} has splits {sorted(splits)} but no 'train' split")
            splits = {"train": next(iter(splits.values()))}
        return splits

    def get_prompt(self, sample: Sample) -> str | None:
        return sample["prompt"]

    def get_chosen(self, sample: Sample) -> str | None:
        return sample["chosen"]

    def get_rejected(self, sample: Sample) -> str | None:
        return sample.get("rejected")

    def get_prompt_and_chosen(self, sample: Sample) -> str | None:
        if sample["prompt"] is None or sample["chosen"] is None:
            return None
        return sample["prompt"] + sample["chosen"]

    def get_prompt_and_rejected(self, sample: Sample) -> str | None:
        if sample["prompt"] is None or sample.get("rejected") is None:
            return None
        return sample["prompt"] + sample["rejected"]


def builtin_folders() -> dict[str, Path]:
    """The embedded datasets: ``--data_path`` entry -> folder of its ``train.jsonl`` + ``eval.jsonl``."""
    return {BUILTIN_NAME: Path(builtin.data_dir()), BUILTIN_SAMPLES_NAME: Path(builtin.samples_dir())}


def builtin_files(name: str = BUILTIN_NAME) -> list[Path]:
    """``train.jsonl`` and ``eval.jsonl`` of an embedded dataset; a UserError if the package lacks them."""
    folder = builtin_folders()[name]
    files = [folder / "train.jsonl", folder / "eval.jsonl"]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise UserError(
            f"the files of {name} are missing ({', '.join(missing)}); reinstall dschat "
            "(the wheel ships dschat/data/builtin_prefs/)"
        )
    return files


class BuiltinDataset(LocalPreferenceDataset):
    """An embedded preference set (``dschat/builtin`` or ``dschat/builtin-samples``): train.jsonl + eval.jsonl."""

    def __init__(
        self,
        output_path: str,
        seed: int | None,
        local_rank: int,
        dataset_name: str = BUILTIN_NAME,
        raw_datasets: Any = None,
    ) -> None:
        if raw_datasets is None:
            train, held_out = builtin_files(dataset_name)
            raw_datasets = self.read_groups({"train": [train], "eval": [held_out]})
        super().__init__(output_path, seed, local_rank, dataset_name, raw_datasets=raw_datasets)
        self.dataset_name_clean = dataset_name.replace("/", "_").replace("-", "_")


def _with_extra_fields(rows: list[dict], files: Sequence[Path]) -> Any:
    """The rows as one table with their other fields; when those cannot form one (a field whose type
    changes from row to row), without them and one note naming the files: steps 1-2 never read them,
    and reward functions or environments that do then say which column they miss."""
    try:
        return lf.records_to_dataset(rows, PREF_REQUIRED + PREF_OPTIONAL, source=files[0] if files else None)
    except UserError as err:
        extra = sorted({col for row in rows for col in row} - set(PREF_REQUIRED + PREF_OPTIONAL))
        if not extra:
            raise
        print(f"note: {', '.join(str(f) for f in files)}: the fields {extra} are left out ({err}); reward "
              "functions and environments cannot read them", flush=True)
        kept = [{col: row.get(col) for col in PREF_REQUIRED + PREF_OPTIONAL} for row in rows]
        return lf.records_to_dataset(kept, PREF_REQUIRED + PREF_OPTIONAL)
