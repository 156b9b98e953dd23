"""Raw preference datasets: upstream's 16 adapters, our local forms, and one dispatch table.

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

Dispatch (:func:`get_raw_dataset`) is by *substring*, in upstream's order, so a local
``save_to_disk`` copy such as ``/data/Dahoas/rm-static`` still picks the rm-static adapter and loads
from disk. Beyond upstream: ``dschat/builtin`` (the embedded dataset), local ``.json`` / ``.jsonl`` /
``.parquet`` files or folders of them, and ``save_to_disk`` folders, all with ``prompt`` / ``chosen``
/ optional ``rejected`` columns used verbatim like rm-static's (``prompt + chosen``: write prompts as
``"\\n\\nHuman: ...\\n\\nAssistant:"`` or ``" Human: ... Assistant:"`` and answers with a leading space).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
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
    from torch.utils.data import Subset

    return Subset(dataset, list(index))


def _column_names(split: Any) -> list[str] | None:
    names = getattr(split, "column_names", None)
    return list(names) if names is not None else None


def _load_hub(name: str) -> Any:
    """``datasets.load_dataset(name)`` with failures turned into one actionable line."""
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
        # A single saved Dataset is its train split (upstream indexed it by split name and crashed).
        return lf.load_save_to_disk(path)
    # Beyond upstream: train.jsonl / test.jsonl ... (any of our data suffixes), or one file.
    files = [path] if path.is_file() else (lf.data_files_in(path) if path.is_dir() else [])
    if not files or any(f.suffix.lower() not in lf.DATA_SUFFIXES for f in files):
        raise UserError(
            f"{path} exists but is neither a save_to_disk folder nor .json/.jsonl/.parquet files; "
            f"for {dataset_name!r} pass a folder written by DatasetDict.save_to_disk"
        )
    from datasets import DatasetDict

    by_split: dict[str, list[Path]] = {}
    for f in files:
        by_split.setdefault(f.stem if len(files) > 1 else "train", []).append(f)
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


# ---------------------------------------------------------------------------------------------
# Upstream's adapters (English)
# ---------------------------------------------------------------------------------------------


class DahoasRmstaticDataset(PromptRawDataset):
    """``Dahoas/rm-static``: prompts already read ``"\\n\\nHuman: ...\\n\\nAssistant:"``; used verbatim."""

    dataset_name = "Dahoas/rm-static"
    dataset_name_clean = "Dahoas_rm_static"
    required_columns = ("prompt", "chosen", "rejected")

    def get_prompt(self, sample: Sample) -> str:
        return sample["prompt"]

    def get_chosen(self, sample: Sample) -> str:
        return sample["chosen"]

    def get_rejected(self, sample: Sample) -> str:
        return sample["rejected"]

    def get_prompt_and_chosen(self, sample: Sample) -> str:
        return sample["prompt"] + sample["chosen"]

    def get_prompt_and_rejected(self, sample: Sample) -> str:
        return sample["prompt"] + sample["rejected"]


class DahoasFullhhrlhfDataset(DahoasRmstaticDataset):
    """``Dahoas/full-hh-rlhf``: same schema and texts as rm-static."""

    dataset_name = "Dahoas/full-hh-rlhf"
    dataset_name_clean = "Dahoas_full_hh_rlhf"


class DahoasSyntheticinstructgptjpairwiseDataset(PromptRawDataset):
    """``Dahoas/synthetic-instruct-gptj-pairwise``: train split only (9:1)."""

    dataset_name = "Dahoas/synthetic-instruct-gptj-pairwise"
    dataset_name_clean = "Dahoas_synthetic_instruct_gptj_pairwise"
    eval_split = None
    required_columns = ("prompt", "chosen", "rejected")

    def get_prompt(self, sample: Sample) -> str:
        return _human(sample["prompt"])

    def get_chosen(self, sample: Sample) -> str:
        return " " + sample["chosen"]

    def get_rejected(self, sample: Sample) -> str:
        return " " + sample["rejected"]

    def get_prompt_and_chosen(self, sample: Sample) -> str:
        return _dialog(sample["prompt"], sample["chosen"])

    def get_prompt_and_rejected(self, sample: Sample) -> str:
        return _dialog(sample["prompt"], sample["rejected"])


class YitingxieRlhfrewarddatasetsDataset(PromptRawDataset):
    """``yitingxie/rlhf-reward-datasets``: answers carry the dialogue; the last turn is the answer."""

    dataset_name = "yitingxie/rlhf-reward-datasets"
    dataset_name_clean = "yitingxie_rlhf_reward_datasets"
    required_columns = ("prompt", "chosen", "rejected")

    def get_prompt(self, sample: Sample) -> str:
        return sample["prompt"] + "Assistant:"

    def get_chosen(self, sample: Sample) -> str:
        return sample["chosen"].split("Assistant:")[-1]

    def get_rejected(self, sample: Sample) -> str:
        return sample["rejected"].split("Assistant:")[-1]

    def get_prompt_and_chosen(self, sample: Sample) -> str:
        return sample["prompt"] + sample["chosen"]

    def get_prompt_and_rejected(self, sample: Sample) -> str:
        return sample["prompt"] + sample["rejected"]


def _strip_citations(text: str) -> str:
    # WebGPT answers cite sources as "[1]" / "(2)"; upstream removes them (with a leading space
    # first) because it does no browser-assisted fine-tuning.
    text = re.sub(r" [\(\[].*?[\)\]]", "", text)
    return re.sub(r"[\(\[].*?[\)\]]", "", text)


class OpenaiWebgptcomparisonsDataset(PromptRawDataset):
    """``openai/webgpt_comparisons``: chosen = higher score (a tie picks answer_0); train only (9:1)."""

    dataset_name = "openai/webgpt_comparisons"
    dataset_name_clean = "openai_webgpt_comparisons"
    eval_split = None
    required_columns = ("question", "answer_0", "answer_1", "score_0", "score_1")
    text_columns = ("answer_0", "answer_1")

    @staticmethod
    def _answer(sample: Sample, chosen: bool) -> str:
        first_wins = float(sample["score_0"]) >= float(sample["score_1"])
        response = sample["answer_0"] if first_wins == chosen else sample["answer_1"]
        return _strip_citations(response)

    def get_prompt(self, sample: Sample) -> str:
        return _human(sample["question"]["full_text"])

    def get_chosen(self, sample: Sample) -> str:
        return " " + self._answer(sample, chosen=True)

    def get_rejected(self, sample: Sample) -> str:
        return " " + self._answer(sample, chosen=False)

    def get_prompt_and_chosen(self, sample: Sample) -> str:
        return _dialog(sample["question"]["full_text"], self._answer(sample, chosen=True))

    def get_prompt_and_rejected(self, sample: Sample) -> str:
        return _dialog(sample["question"]["full_text"], self._answer(sample, chosen=False))


class StanfordnlpSHPDataset(PromptRawDataset):
    """``stanfordnlp/SHP``: ``labels == 1`` means human_ref_A is preferred."""

    dataset_name = "stanfordnlp/SHP"
    dataset_name_clean = "stanfordnlp_SHP"
    eval_split = "validation"
    required_columns = ("history", "human_ref_A", "human_ref_B", "labels")
    text_columns = ("history", "human_ref_A", "human_ref_B")

    @staticmethod
    def _answer(sample: Sample, chosen: bool) -> str:
        a_wins = int(sample["labels"]) == 1
        return sample["human_ref_A"] if a_wins == chosen else sample["human_ref_B"]

    def get_prompt(self, sample: Sample) -> str:
        return _human(sample["history"])

    def get_chosen(self, sample: Sample) -> str:
        return " " + self._answer(sample, chosen=True)

    def get_rejected(self, sample: Sample) -> str:
        return " " + self._answer(sample, chosen=False)

    def get_prompt_and_chosen(self, sample: Sample) -> str:
        return _dialog(sample["history"], self._answer(sample, chosen=True))

    def get_prompt_and_rejected(self, sample: Sample) -> str:
        return _dialog(sample["history"], self._answer(sample, chosen=False))


class PvduySharegptalpacaoavicunaformatDataset(_SingleAnswerDataset):
    """``pvduy/sharegpt_alpaca_oa_vicuna_format``: ``USER:``/``ASSISTANT:`` renamed; no rejected."""

    dataset_name = "pvduy/sharegpt_alpaca_oa_vicuna_format"
    dataset_name_clean = "pvduy_sharegpt_alpaca_oa_vicuna_format"
    required_columns = ("prompt", "label")
    skips_null_rows = True

    @staticmethod
    def _prompt(sample: Sample) -> str | None:
        if sample["prompt"] is not None and len(sample["prompt"]) > 0:
            return sample["prompt"].replace("USER", "Human").replace("ASSISTANT", "Assistant")
        return None

    def get_prompt(self, sample: Sample) -> str | None:
        return self._prompt(sample)

    def get_chosen(self, sample: Sample) -> str | None:
        if sample["label"] is not None and len(sample["label"]) > 0:
            return " " + sample["label"]
        return None

    def get_prompt_and_chosen(self, sample: Sample) -> str | None:
        prompt, chosen = self._prompt(sample), self.get_chosen(sample)
        if prompt is None or chosen is None:
            return None
        return prompt + chosen


# ---------------------------------------------------------------------------------------------
# Upstream's local JSON files
# ---------------------------------------------------------------------------------------------


def _source_root() -> Path:
    """The checkout holding the ``dschat`` package (upstream's DeepSpeed-Chat root)."""
    return Path(__file__).resolve().parents[2]


def find_local_jsonfile_dir() -> Path:
    """The folder holding ``data/train.json`` and ``data/eval.json`` for ``local/jsonfile``.

    Upstream only looked beside its source (``applications/DeepSpeed-Chat/data``), which is
    ``site-packages`` once installed; dschat tries the current directory first, then the checkout.
    """
    candidates = [Path.cwd(), _source_root()]
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
# Upstream's adapters (Chinese, Japanese)
# ---------------------------------------------------------------------------------------------


class Wangrui6ZhihuKOLDataset(_SingleAnswerDataset):
    """``wangrui6/Zhihu-KOL``: INSTRUCTION / RESPONSE; train only (9:1)."""

    dataset_name = "wangrui6/Zhihu-KOL"
    dataset_name_clean = "wangrui6_Zhihu_KOL"
    eval_split = None
    required_columns = ("INSTRUCTION", "RESPONSE")
    skips_null_rows = True

    def get_prompt(self, sample: Sample) -> str | None:
        if sample["INSTRUCTION"] is not None:
            return _human(sample["INSTRUCTION"])
        return None

    def get_chosen(self, sample: Sample) -> str | None:
        if sample["RESPONSE"] is not None:
            return " " + sample["RESPONSE"]
        return None

    def get_prompt_and_chosen(self, sample: Sample) -> str | None:
        if sample["INSTRUCTION"] is not None and sample["RESPONSE"] is not None:
            return _dialog(sample["INSTRUCTION"], sample["RESPONSE"])
        return None


def _first_text(passages: Sequence[Mapping[str, Any]] | None) -> str | None:
    # Upstream indexes [0] unguarded (an IndexError on a row without passages), except for the
    # Japanese rejected pair; here an empty list skips the row in every method.
    if not passages:
        return None
    return passages[0]["text"]


class CohereMiraclzhqueries2212Dataset(PromptRawDataset):
    """``Cohere/miracl-zh-queries-22-12``: first positive vs first negative passage; eval = dev."""

    dataset_name = "Cohere/miracl-zh-queries-22-12"
    dataset_name_clean = "Cohere_miracl_zh_queries_22_12"
    eval_split = "dev"
    required_columns = ("query", "positive_passages", "negative_passages")
    text_columns = ("query",)

    def get_prompt(self, sample: Sample) -> str:
        return _human(sample["query"])

    def get_chosen(self, sample: Sample) -> str | None:
        text = _first_text(sample["positive_passages"])
        return None if text is None else " " + text

    def get_rejected(self, sample: Sample) -> str | None:
        text = _first_text(sample["negative_passages"])
        return None if text is None else " " + text

    def get_prompt_and_chosen(self, sample: Sample) -> str | None:
        text = _first_text(sample["positive_passages"])
        return None if text is None else _dialog(sample["query"], text)

    def get_prompt_and_rejected(self, sample: Sample) -> str | None:
        text = _first_text(sample["negative_passages"])
        return None if text is None else _dialog(sample["query"], text)


class HelloSimpleAIHC3ChineseDataset(_SingleAnswerDataset):
    """``Hello-SimpleAI/HC3-Chinese``: question / first human answer; train only (9:1)."""

    dataset_name = "Hello-SimpleAI/HC3-Chinese"
    dataset_name_clean = "Hello_SimpleAI_HC3_Chinese"
    eval_split = None
    required_columns = ("question", "human_answers")
    text_columns = ("question",)
    skips_null_rows = True

    @staticmethod
    def _answer(sample: Sample) -> str | None:
        answers = sample["human_answers"]
        return answers[0] if answers else None  # upstream: IndexError on an empty list

    def get_prompt(self, sample: Sample) -> str | None:
        if sample["question"] is not None:
            return _human(sample["question"])
        return None

    def get_chosen(self, sample: Sample) -> str | None:
        answer = self._answer(sample)
        return None if answer is None else " " + answer

    def get_prompt_and_chosen(self, sample: Sample) -> str | None:
        answer = self._answer(sample)
        if sample["question"] is not None and answer is not None:
            return _dialog(sample["question"], answer)
        return None


class _MkqaDataset(_SingleAnswerDataset):
    """``mkqa`` (loaded from the hub as ``mkqa``) in one language; train only (9:1)."""

    dataset_name_clean = "mkqa"  # shared by both languages, as upstream
    eval_split = None
    hub_name = "mkqa"
    required_columns = ("queries", "answers")
    text_columns = ()
    lang: ClassVar[str] = ""

    def _question(self, sample: Sample) -> str | None:
        return sample["queries"][self.lang]

    def _answer(self, sample: Sample) -> str | None:
        answers = sample["answers"][self.lang]
        return answers[0]["text"] if answers else None

    def get_prompt(self, sample: Sample) -> str | None:
        question = self._question(sample)
        return None if question is None else _human(question)

    def get_chosen(self, sample: Sample) -> str | None:
        answer = self._answer(sample)
        return None if answer is None else " " + answer

    def get_prompt_and_chosen(self, sample: Sample) -> str | None:
        question, answer = self._question(sample), self._answer(sample)
        if question is not None and answer is not None:
            return _dialog(question, answer)
        return None


class MkqaChineseDataset(_MkqaDataset):
    """``mkqa-Chinese``: ``queries.zh_cn`` / ``answers.zh_cn[0].text``."""

    dataset_name = "mkqa-Chinese"
    lang = "zh_cn"


class MkqaJapaneseDataset(_MkqaDataset):
    """``mkqa-Japanese``: ``queries.ja`` / ``answers.ja[0].text``."""

    dataset_name = "mkqa-Japanese"
    lang = "ja"


class CohereMiracljaqueries2212Dataset(CohereMiraclzhqueries2212Dataset):
    """``Cohere/miracl-ja-queries-22-12``: like the Chinese set."""

    dataset_name = "Cohere/miracl-ja-queries-22-12"
    dataset_name_clean = "Cohere_miracl_ja_queries_22_12"


class LmqgQgjaquadDataset(_SingleAnswerDataset):
    """``lmqg/qg_jaquad``: question / sentence; eval = validation."""

    dataset_name = "lmqg/qg_jaquad"
    dataset_name_clean = "lmqg_qg_jaquad"
    eval_split = "validation"
    required_columns = ("question", "sentence")

    def get_prompt(self, sample: Sample) -> str:
        return _human(sample["question"])

    def get_chosen(self, sample: Sample) -> str:
        return " " + sample["sentence"]

    def get_prompt_and_chosen(self, sample: Sample) -> str:
        return _dialog(sample["question"], sample["sentence"])


class LmqgQagjaquadDataset(_SingleAnswerDataset):
    """``lmqg/qag_jaquad``: first question / paragraph; eval = validation."""

    dataset_name = "lmqg/qag_jaquad"
    dataset_name_clean = "lmqg_qag_jaquad"
    eval_split = "validation"
    required_columns = ("questions", "paragraph")
    text_columns = ("paragraph",)

    def get_prompt(self, sample: Sample) -> str:
        return _human(sample["questions"][0])

    def get_chosen(self, sample: Sample) -> str:
        return " " + sample["paragraph"]

    def get_prompt_and_chosen(self, sample: Sample) -> str:
        return _dialog(sample["questions"][0], sample["paragraph"])


# ---------------------------------------------------------------------------------------------
# Ours: local files / folders / save_to_disk folders / the builtin dataset
# ---------------------------------------------------------------------------------------------


def _clean_name(name: str) -> str:
    return "local_" + (re.sub(r"[^0-9A-Za-z]+", "_", Path(name).name or name).strip("_") or "data")


class LocalPreferenceDataset(PromptRawDataset):
    """Local prompt / chosen / (optional) rejected data, texts used verbatim (rm-static's convention).

    ``source`` is a ``.json`` / ``.jsonl`` / ``.parquet`` file, a folder of them (``train.*`` and
    ``eval.*``/``test.*``/``validation.*`` give both splits, otherwise all files are one train-only
    split, divided 9:1), or a ``save_to_disk`` folder (a ``DatasetDict`` with ``train`` and one of
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
            return [path]
        if lf.is_save_to_disk_dir(path):
            return lf.files_under(path)
        return lf.data_files_in(path)

    @staticmethod
    def read_groups(groups: Mapping[str, Sequence[Path]]) -> dict[str, Any]:
        """``{split: [files]}`` -> ``{split: Dataset}`` with the prompt/chosen/rejected columns."""
        out = {}
        for split, split_files in groups.items():
            rows: list[dict] = []
            for f in split_files:
                rows.extend(lf.check_columns(lf.read_records(f), f, PREF_REQUIRED, PREF_OPTIONAL))
            out[split] = lf.records_to_dataset(rows, PREF_REQUIRED + PREF_OPTIONAL)
        # Files without any "rejected" value give an all-null column: treat it as absent.
        for split, ds in out.items():
            if "rejected" in ds.column_names and all(v is None for v in ds["rejected"]):
                out[split] = ds.remove_columns("rejected")
        return out

    @classmethod
    def read(cls, path: Path) -> dict[str, Any]:
        if not path.exists():
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


def builtin_files() -> list[Path]:
    """``dschat/data/builtin_prefs/{train,eval}.jsonl``; a UserError if the package lacks them."""
    from dschat.data import builtin

    folder = Path(builtin.data_dir())
    files = [folder / "train.jsonl", folder / "eval.jsonl"]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise UserError(
            f"the builtin dataset files are missing ({', '.join(missing)}); reinstall dschat "
            "(the wheel ships dschat/data/builtin_prefs/*.jsonl)"
        )
    return files


class BuiltinDataset(LocalPreferenceDataset):
    """``dschat/builtin``: the preference set embedded in the package (train.jsonl + eval.jsonl)."""

    def __init__(
        self,
        output_path: str,
        seed: int | None,
        local_rank: int,
        dataset_name: str = "dschat/builtin",
        raw_datasets: Any = None,
    ) -> None:
        if raw_datasets is None:
            train, held_out = builtin_files()
            raw_datasets = self.read_groups({"train": [train], "eval": [held_out]})
        super().__init__(output_path, seed, local_rank, dataset_name, raw_datasets=raw_datasets)
        self.dataset_name_clean = "dschat_builtin"


# ---------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------

#: (substring of the --data_path entry, adapter), in upstream's ``get_raw_dataset`` order.
DATASET_TABLE: tuple[tuple[str, type[PromptRawDataset]], ...] = (
    ("Dahoas/rm-static", DahoasRmstaticDataset),
    ("Dahoas/full-hh-rlhf", DahoasFullhhrlhfDataset),
    ("Dahoas/synthetic-instruct-gptj-pairwise", DahoasSyntheticinstructgptjpairwiseDataset),
    ("yitingxie/rlhf-reward-datasets", YitingxieRlhfrewarddatasetsDataset),
    ("openai/webgpt_comparisons", OpenaiWebgptcomparisonsDataset),
    ("stanfordnlp/SHP", StanfordnlpSHPDataset),
    ("pvduy/sharegpt_alpaca_oa_vicuna_format", PvduySharegptalpacaoavicunaformatDataset),
    ("wangrui6/Zhihu-KOL", Wangrui6ZhihuKOLDataset),
    ("Cohere/miracl-zh-queries-22-12", CohereMiraclzhqueries2212Dataset),
    ("Hello-SimpleAI/HC3-Chinese", HelloSimpleAIHC3ChineseDataset),
    ("mkqa-Chinese", MkqaChineseDataset),
    ("mkqa-Japanese", MkqaJapaneseDataset),
    ("Cohere/miracl-ja-queries-22-12", CohereMiracljaqueries2212Dataset),
    ("lmqg/qg_jaquad", LmqgQgjaquadDataset),
    ("lmqg/qag_jaquad", LmqgQagjaquadDataset),
    ("local/jsonfile", LocalJsonFileDataset),
)

BUILTIN_NAME = "dschat/builtin"

LOCAL_FORMS = (
    f"{BUILTIN_NAME} (embedded), local/jsonfile (data/train.json + data/eval.json), a .json/.jsonl/"
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
    if dataset_name == BUILTIN_NAME:
        return BuiltinDataset
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
            if path.exists():
                files = lf.files_under(path) if path.is_dir() else [path]
                return DatasetSource(name, adapter, tuple(files), path if path.is_dir() else path.parent)
            if lf.looks_like_path(name):  # e.g. /data/Dahoas/rm-static: a local copy that is not there
                raise UserError(f"data path {name!r} does not exist; check --data_path (or pass the hub name)")
            return DatasetSource(name, adapter)
    if name == BUILTIN_NAME:
        files = builtin_files()
        return DatasetSource(name, BuiltinDataset, tuple(files), files[0].parent)
    path = lf.expand(name)
    if path.exists():
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


# ---------------------------------------------------------------------------------------------
# Phase selection: the rows of each dataset that one training phase uses (before tokenising)
# ---------------------------------------------------------------------------------------------


@dataclass
class PhaseRows:
    """One dataset's raw rows for one phase: the chunk of its train split and of its eval split."""

    raw: PromptRawDataset
    train: Any
    eval: Any


def empty_phase(raw: PromptRawDataset, split: str, phase: int, why: str, fix: str) -> None:
    """A dataset that adds no rows to a phase: an error for train, a warning for eval.

    An empty eval chunk of one dataset is tolerated (small sets round to zero rows); an empty eval
    set overall is an error in phases 1-2 (:func:`require_eval`).
    """
    message = f"dataset {raw.dataset_name!r}, phase {phase}, {split} split is empty: {why}; {fix}"
    if split == "eval":
        print(f"Warning: {message}")
        return
    raise UserError(message)


def require_eval(names: Sequence[str], phase: int, size: int) -> None:
    """An empty eval set is an error in phases 1-2.

    Upstream's step-1/2 evaluation divides by the number of eval batches, so an empty eval set
    crashes there, after the models are built. Phase 3 never evaluates on it.
    """
    if size == 0 and phase in (1, 2):
        raise UserError(
            f"phase {phase} eval split is empty for --data_path {' '.join(names)}: no dataset has held-out "
            "rows for this phase; add rows (or an eval.*/test.* file) or give the phase a larger --data_split share"
        )


def select_phase_rows(
    raw: PromptRawDataset,
    data_split: str,
    train_phase: int,
    seed: int | None,
    output_path: str = "",
    local_rank: int = -1,
) -> PhaseRows:
    """Chunk ``train_phase - 1`` of BOTH the raw train and raw eval splits (upstream's create_dataset)."""
    parts = {}
    for split_name, data in (("train", raw.get_train_data()), ("eval", raw.get_eval_data())):
        index = get_raw_dataset_split_index(
            local_rank, output_path, raw.dataset_name_clean, seed, split_name, data_split, train_phase - 1, len(data),
        )
        parts[split_name] = (_subset(data, index), len(data))
    for split_name, (rows, total) in parts.items():
        if len(rows) == 0:
            empty_phase(
                raw, split_name, train_phase,
                f"--data_split {data_split} gives phase {train_phase} 0 of its {total} {split_name} rows",
                "give that phase a larger share or add rows",
            )
    return PhaseRows(raw, parts["train"][0], parts["eval"][0])


@dataclass
class PhasePlan:
    """Validated inputs of one phase's build: every dataset loaded and its rows selected."""

    data_path: list[str]
    selections: list[PhaseRows]
    sft_selections: list[PhaseRows]


def plan_phase_data(
    data_path: Sequence[str],
    sft_only_data_path: Sequence[str],
    data_split: str,
    train_phase: int,
    seed: int | None,
    output_path: str = "",
    local_rank: int = -1,
) -> PhasePlan:
    """Load every dataset and select its rows for ``train_phase``; every input error surfaces here.

    ``sft_only_data_path`` datasets use split ``"10,0,0"`` (callers pass them in phase 1 only).
    Needs no torch: ``python -m dschat.data.prepare`` validates data with it before loading a model.
    """
    def select(name: str, split: str) -> PhaseRows:
        raw = get_raw_dataset(name, output_path, seed, local_rank)
        if train_phase == 2 and not raw.has_rejected:
            raise UserError(
                f"dataset {name!r} has no rejected responses, so it cannot train the reward model "
                "(phase 2); drop it from --data_path for step 2 or use it in step 1 via --sft_only_data_path"
            )
        return select_phase_rows(raw, split, train_phase, seed, output_path, local_rank)

    plan = PhasePlan(
        list(data_path),
        [select(name, data_split) for name in data_path],
        [select(name, "10,0,0") for name in sft_only_data_path],
    )
    names = list(data_path) + list(sft_only_data_path)
    require_eval(names, train_phase, sum(len(s.eval) for s in plan.selections + plan.sft_selections))
    return plan


#: Upstream's adapters by class name (the public names of ``raw_datasets.py``).
ADAPTERS: dict[str, type[PromptRawDataset]] = {cls.__name__: cls for _, cls in DATASET_TABLE}

__all__ = [
    "PromptRawDataset",
    *ADAPTERS,
    "LocalPreferenceDataset",
    "BuiltinDataset",
    "DATASET_TABLE",
    "DatasetSource",
    "match_adapter",
    "resolve_dataset",
    "get_raw_dataset",
    "find_local_jsonfile_dir",
    "PhaseRows",
    "PhasePlan",
    "select_phase_rows",
    "plan_phase_data",
]
