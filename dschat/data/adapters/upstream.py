"""Upstream's 16 hub dataset adapters (English, Chinese, Japanese), as upstream's ``raw_datasets.py``.

Each maps a row of its hub dataset to the text convention of :mod:`dschat.data.adapters.base`;
``local/jsonfile``, upstream's 16th, reads local files and lives in :mod:`dschat.data.adapters.local`.
"""
from __future__ import annotations

import re
from typing import Any, ClassVar, Mapping, Sequence

from dschat.data.adapters.base import PromptRawDataset, Sample, _dialog, _human, _SingleAnswerDataset

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
    # An empty list skips the row in every method (docs/upstream.md#small-fixes).
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


#: Upstream's hub datasets, (substring of a ``--data_path`` entry, adapter), in upstream's
#: ``get_raw_dataset`` order: the one list of them (:data:`dschat.data.dispatch.DATASET_TABLE` and
#: the names of upstream's ``raw_datasets`` module are derived from it).
HUB_ADAPTERS: tuple[tuple[str, type[PromptRawDataset]], ...] = (
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
)

#: The hub adapters' class names (``from dschat.utils.data.raw_datasets import *``, upstream's names).
__all__ = [adapter.__name__ for _, adapter in HUB_ADAPTERS]
