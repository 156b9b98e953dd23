"""Which adapter reads a ``--data_path`` entry: upstream's table, dschat's local forms, ``get_raw_dataset``.

Dispatch is by *substring*, in upstream's order, so a local ``save_to_disk`` copy such as
``/data/Dahoas/rm-static`` still picks the rm-static adapter and loads from disk. Beyond upstream:
``dschat/builtin`` and ``dschat/wordgame`` (the embedded datasets), local ``.json`` / ``.jsonl`` / ``.parquet`` files or
folders of them, and ``save_to_disk`` folders (:mod:`dschat.data.adapters.local`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dschat.data import local_files as lf
from dschat.data import wordgame
from dschat.data.adapters.base import PromptRawDataset
from dschat.data.adapters.local import (
    BUILTIN_NAME,
    BUILTIN_SAMPLES_NAME,
    BuiltinDataset,
    LocalJsonFileDataset,
    LocalPreferenceDataset,
    builtin_files,
    builtin_folders,
    find_local_jsonfile_dir,
)
from dschat.data.adapters.upstream import HUB_ADAPTERS, _MkqaDataset
from dschat.errors import UserError

#: (substring of the --data_path entry, adapter), in upstream's ``get_raw_dataset`` order.
DATASET_TABLE: tuple[tuple[str, type[PromptRawDataset]], ...] = (*HUB_ADAPTERS, ("local/jsonfile", LocalJsonFileDataset))

LOCAL_FORMS = (
    f"{BUILTIN_NAME}, {BUILTIN_SAMPLES_NAME} and {wordgame.NAME} (embedded), local/jsonfile (data/train.json + data/eval.json), a .json/.jsonl/"
    ".parquet file or a folder of them with prompt/chosen[/rejected] columns (train.* + eval.*/test.*/"
    "validation.* for both splits), or a save_to_disk folder with those columns"
)


@dataclass(frozen=True)
class DatasetSource:
    """A resolved ``--data_path`` entry: which adapter reads it, and from which local files."""

    name: str
    adapter: type[PromptRawDataset]
    files: tuple[Path, ...] = field(default=())
    base: Path | None = None

    def fingerprint(self) -> dict[str, Any]:
        """Identity for the cache key: name, adapter, and a SHA-256 of any local file contents.

        Hub datasets are identified by name only (as upstream), so a cached build is used without
        loading the hub data (a node with the tokenised cache needs neither the network nor the
        Hugging Face cache); after a new hub revision, rebuild with ``--rebuild_data_cache``.
        """
        content = lf.fingerprint_files(self.files, self.base) if self.files else None
        return {"name": self.name, "adapter": self.adapter.__name__, "content_sha256": content}


def match_adapter(dataset_name: str) -> type[PromptRawDataset] | None:
    """The adapter whose table substring occurs in ``dataset_name`` (first match), else None."""
    for needle, adapter in DATASET_TABLE:
        if needle in dataset_name:
            return adapter
    if dataset_name in builtin_folders():
        return BuiltinDataset
    if dataset_name == wordgame.NAME:
        return wordgame.WordGameDataset
    return None


def resolve_dataset(dataset_name: str) -> DatasetSource:
    """Pick the adapter for ``dataset_name`` and list the local files it will read.

    Raises :class:`UserError` for unknown names and missing local files, without loading any data.
    """
    name = str(dataset_name)
    for needle, adapter in DATASET_TABLE:
        if needle in name:
            if adapter is LocalJsonFileDataset:
                root = find_local_jsonfile_dir()
                return DatasetSource(name, adapter, tuple(LocalJsonFileDataset.source_files(root)), root)
            path = lf.expand(name)
            if lf.exists(path):
                files = lf.files_under(path) if path.is_dir() else [path]
                return DatasetSource(name, adapter, tuple(files), path if path.is_dir() else path.parent)
            if lf.looks_like_path(name):  # e.g. /data/Dahoas/rm-static: a local copy that is not there
                raise UserError(f"data path {name!r} does not exist; check --data_path (or pass the hub name)")
            return DatasetSource(name, adapter)
    if name in builtin_folders():
        files = builtin_files(name)
        return DatasetSource(name, BuiltinDataset, tuple(files), files[0].parent)
    if name == wordgame.NAME:
        files = wordgame.data_files()
        return DatasetSource(name, wordgame.WordGameDataset, tuple(files), files[0].parent)
    path = lf.expand(name)
    if lf.exists(path):
        files = LocalPreferenceDataset.source_files(path)
        if not files:
            raise UserError(
                f"{path} holds no .json/.jsonl/.parquet files and is not a save_to_disk folder; "
                "point --data_path at a data file or a folder of them"
            )
        return DatasetSource(name, LocalPreferenceDataset, tuple(files), path if path.is_dir() else path.parent)
    if lf.looks_like_path(name):
        raise UserError(f"data path {name!r} does not exist; check --data_path (relative paths start at {Path.cwd()})")
    supported = ", ".join(needle for needle, _ in DATASET_TABLE if needle != "local/jsonfile")
    raise UserError(
        f"unknown dataset {name!r}; supported hub datasets: {supported}; local forms: {LOCAL_FORMS}"
    )


def get_raw_dataset(
    dataset_name: str,
    output_path: str,
    seed: int | None,
    local_rank: int,
    raw_datasets: Any = None,
) -> PromptRawDataset:
    """Upstream's dispatcher: the adapter instance for a ``--data_path`` entry (data loaded)."""
    if raw_datasets is not None:  # injected data: pick the adapter by name only
        adapter = match_adapter(dataset_name) or LocalPreferenceDataset
        root = None
    else:
        source = resolve_dataset(dataset_name)
        adapter, root = source.adapter, source.base
    if adapter is LocalJsonFileDataset:
        return LocalJsonFileDataset(output_path, seed, local_rank, dataset_name, root, raw_datasets=raw_datasets)
    if issubclass(adapter, _MkqaDataset) and not lf.expand(dataset_name).exists():
        # Upstream passes the literal "mkqa" (both languages live in one hub dataset).
        return adapter(output_path, seed, local_rank, "mkqa", raw_datasets=raw_datasets)
    return adapter(output_path, seed, local_rank, dataset_name, raw_datasets=raw_datasets)


#: Upstream's adapters by class name (the public names of ``raw_datasets.py``).
ADAPTERS: dict[str, type[PromptRawDataset]] = {cls.__name__: cls for _, cls in DATASET_TABLE}
