"""Every upstream adapter on a tiny in-memory dataset of its schema, the dispatch table, local forms."""
from __future__ import annotations

import json

import pytest
from datasets import Dataset, DatasetDict

from dschat.data import local_files as lf
from dschat.data import dispatch
from dschat.data.adapters import local as local_adapters
from dschat.data.adapters import upstream as hub_adapters
from dschat.data.split import get_shuffle_idx
from dschat.errors import UserError

from helpers.data import pref_rows, write_json, write_jsonl


def dd(**splits) -> DatasetDict:
    return DatasetDict({name: Dataset.from_list(rows) for name, rows in splits.items()})


def make(cls, raw, name=None):
    return cls("/unused", 1234, -1, name or getattr(cls, "dataset_name", "x"), raw_datasets=raw)


def texts(adapter, sample):
    return (
        adapter.get_prompt(sample), adapter.get_chosen(sample), adapter.get_rejected(sample),
        adapter.get_prompt_and_chosen(sample), adapter.get_prompt_and_rejected(sample),
    )


# --- one row per schema, with the exact five strings upstream's adapter produces ----------------

HH = {"prompt": "\n\nHuman: Hi?\n\nAssistant:", "chosen": " Hello!", "rejected": " Go away."}
COHERE_ROW = {
    "query": "Q?",
    "positive_passages": [{"docid": "1", "text": "pos text", "title": "t"}],
    "negative_passages": [{"docid": "2", "text": "neg text", "title": "t"}],
}
MKQA_ROW = {
    "queries": {"zh_cn": "问题", "ja": "質問"},
    "answers": {"zh_cn": [{"text": "答案", "type": 1}], "ja": [{"text": "答え", "type": 1}]},
}

CASES = [
    (hub_adapters.DahoasRmstaticDataset, HH, ("train", "test"),
     (HH["prompt"], " Hello!", " Go away.", HH["prompt"] + " Hello!", HH["prompt"] + " Go away.")),
    (hub_adapters.DahoasFullhhrlhfDataset, HH, ("train", "test"),
     (HH["prompt"], " Hello!", " Go away.", HH["prompt"] + " Hello!", HH["prompt"] + " Go away.")),
    (hub_adapters.DahoasSyntheticinstructgptjpairwiseDataset, {"prompt": "How?", "chosen": "Thus.", "rejected": "No."}, ("train",),
     (" Human: How? Assistant:", " Thus.", " No.", " Human: How? Assistant: Thus.", " Human: How? Assistant: No.")),
    (hub_adapters.YitingxieRlhfrewarddatasetsDataset,
     {"prompt": "Human: Hi ", "chosen": "Assistant: ok Assistant: fine", "rejected": "Assistant: bad"}, ("train", "test"),
     # chosen/rejected keep the text after the LAST "Assistant:"; the pair texts use the full field.
     ("Human: Hi Assistant:", " fine", " bad", "Human: Hi Assistant: ok Assistant: fine", "Human: Hi Assistant: bad")),
    (hub_adapters.StanfordnlpSHPDataset, {"history": "Why?", "human_ref_A": "A says", "human_ref_B": "B says", "labels": 0},
     ("train", "validation"),
     # labels == 0: B is preferred.
     (" Human: Why? Assistant:", " B says", " A says", " Human: Why? Assistant: B says", " Human: Why? Assistant: A says")),
    (hub_adapters.PvduySharegptalpacaoavicunaformatDataset, {"prompt": "USER: hi ASSISTANT:", "label": "hello"}, ("train", "test"),
     ("Human: hi Assistant:", " hello", None, "Human: hi Assistant: hello", None)),
    (hub_adapters.Wangrui6ZhihuKOLDataset, {"INSTRUCTION": "问?", "RESPONSE": "答。"}, ("train",),
     (" Human: 问? Assistant:", " 答。", None, " Human: 问? Assistant: 答。", None)),
    (hub_adapters.CohereMiraclzhqueries2212Dataset, COHERE_ROW, ("train", "dev"),
     (" Human: Q? Assistant:", " pos text", " neg text", " Human: Q? Assistant: pos text", " Human: Q? Assistant: neg text")),
    (hub_adapters.HelloSimpleAIHC3ChineseDataset, {"question": "问", "human_answers": ["人答"], "chatgpt_answers": ["机答"]}, ("train",),
     (" Human: 问 Assistant:", " 人答", None, " Human: 问 Assistant: 人答", None)),
    (hub_adapters.MkqaChineseDataset, MKQA_ROW, ("train",),
     (" Human: 问题 Assistant:", " 答案", None, " Human: 问题 Assistant: 答案", None)),
    (hub_adapters.MkqaJapaneseDataset, MKQA_ROW, ("train",),
     (" Human: 質問 Assistant:", " 答え", None, " Human: 質問 Assistant: 答え", None)),
    (hub_adapters.CohereMiracljaqueries2212Dataset, COHERE_ROW, ("train", "dev"),
     (" Human: Q? Assistant:", " pos text", " neg text", " Human: Q? Assistant: pos text", " Human: Q? Assistant: neg text")),
    (hub_adapters.LmqgQgjaquadDataset, {"question": "Q", "sentence": "S", "paragraph": "P"}, ("train", "validation"),
     (" Human: Q Assistant:", " S", None, " Human: Q Assistant: S", None)),
    (hub_adapters.LmqgQagjaquadDataset, {"questions": ["Q1", "Q2"], "paragraph": "P"}, ("train", "validation"),
     (" Human: Q1 Assistant:", " P", None, " Human: Q1 Assistant: P", None)),
    (local_adapters.LocalJsonFileDataset, {"prompt": "Human: hi Assistant:", "chosen": "yes", "rejected": "no"}, ("train", "eval"),
     (" Human: hi Assistant:", " yes", " no", " Human: hi Assistant: yes", " Human: hi Assistant: no")),
]


@pytest.mark.parametrize("cls, row, splits, expected", CASES, ids=[c[0].__name__ for c in CASES])
def test_adapter_texts(cls, row, splits, expected):
    raw = dd(**{s: [row] * 20 for s in splits})
    adapter = make(cls, raw)
    sample = adapter.get_train_data()[0]
    assert texts(adapter, sample) == expected
    assert adapter.has_rejected == (expected[2] is not None)
    assert adapter.dataset_name and adapter.dataset_name_clean


def test_sixteen_upstream_adapters_in_upstream_order():
    names = [needle for needle, _ in dispatch.DATASET_TABLE]
    assert len(names) == 16
    assert names[0] == "Dahoas/rm-static" and names[-1] == "local/jsonfile"
    assert names.index("mkqa-Chinese") < names.index("mkqa-Japanese") < names.index("Cohere/miracl-ja-queries-22-12")
    covered = {c[0] for c in CASES} | {hub_adapters.OpenaiWebgptcomparisonsDataset}
    assert {cls for _, cls in dispatch.DATASET_TABLE} == covered


def webgpt_row(s0, s1, a0="Because [1] of the sun(2)[3].", a1="No idea (see [4]) at all."):
    return {"question": {"full_text": "Why blue?"}, "answer_0": a0, "answer_1": a1, "score_0": s0, "score_1": s1}


def test_webgpt_scores_tie_and_citations():
    adapter = make(hub_adapters.OpenaiWebgptcomparisonsDataset, dd(train=[webgpt_row(1.0, -1.0)] * 10))
    row = webgpt_row(1.0, -1.0)
    # " [1]" goes with its leading space (first regex), "(2)" and "[3]" without (second regex).
    assert adapter.get_chosen(row) == " Because of the sun."
    # Upstream's lazy regex stops at the first closer: " (see [4]" goes, the ")" stays (kept as is).
    assert adapter.get_rejected(row) == " No idea) at all."
    assert adapter.get_prompt(row) == " Human: Why blue? Assistant:"
    assert adapter.get_prompt_and_chosen(row) == " Human: Why blue? Assistant: Because of the sun."
    assert adapter.get_prompt_and_rejected(row) == " Human: Why blue? Assistant: No idea) at all."
    # answer_1 scored higher: roles swap.
    assert adapter.get_chosen(webgpt_row(-1.0, 0.5)) == " No idea) at all."
    # A tie picks answer_0 as chosen and answer_1 as rejected (>= vs <).
    tie = webgpt_row(0.0, 0.0)
    assert adapter.get_chosen(tie) == " Because of the sun."
    assert adapter.get_rejected(tie) == " No idea) at all."


def test_shp_label_rule():
    adapter = make(hub_adapters.StanfordnlpSHPDataset, dd(train=[{"history": "h", "human_ref_A": "A", "human_ref_B": "B", "labels": 1}],
                                               validation=[{"history": "h", "human_ref_A": "A", "human_ref_B": "B", "labels": 0}]))
    a_wins = adapter.get_train_data()[0]
    assert (adapter.get_chosen(a_wins), adapter.get_rejected(a_wins)) == (" A", " B")
    b_wins = adapter.get_eval_data()[0]
    assert (adapter.get_chosen(b_wins), adapter.get_rejected(b_wins)) == (" B", " A")


def test_none_cases():
    pv = make(hub_adapters.PvduySharegptalpacaoavicunaformatDataset, dd(train=[{"prompt": "x", "label": "y"}], test=[{"prompt": "x", "label": "y"}]))
    assert pv.get_prompt({"prompt": "", "label": "y"}) is None
    assert pv.get_chosen({"prompt": "x", "label": None}) is None
    assert pv.get_prompt_and_chosen({"prompt": "x", "label": ""}) is None
    zh = make(hub_adapters.Wangrui6ZhihuKOLDataset, dd(train=[{"INSTRUCTION": "a", "RESPONSE": "b"}]))
    assert zh.get_prompt({"INSTRUCTION": None, "RESPONSE": "b"}) is None
    assert zh.get_prompt_and_chosen({"INSTRUCTION": "a", "RESPONSE": None}) is None
    ja = make(hub_adapters.CohereMiracljaqueries2212Dataset, dd(train=[COHERE_ROW], dev=[COHERE_ROW]))
    no_neg = dict(COHERE_ROW, negative_passages=[])
    assert ja.get_prompt_and_rejected(no_neg) is None  # upstream guards this one
    assert ja.get_rejected(no_neg) is None  # upstream: IndexError
    lj = make(local_adapters.LocalJsonFileDataset, dd(train=[{"prompt": "p", "chosen": "c", "rejected": "r"}],
                                          eval=[{"prompt": "p", "chosen": "c", "rejected": "r"}]))
    assert lj.get_prompt_and_chosen({"prompt": None, "chosen": "c", "rejected": "r"}) is None
    assert lj.get_prompt_and_rejected({"prompt": "p", "chosen": "c", "rejected": None}) is None


def test_single_answer_warns_once(capsys):
    adapter = make(hub_adapters.LmqgQgjaquadDataset, dd(train=[{"question": "q", "sentence": "s"}], validation=[{"question": "q", "sentence": "s"}]))
    for _ in range(3):
        assert adapter.get_prompt_and_rejected({"question": "q", "sentence": "s"}) is None
    assert capsys.readouterr().out.count("does not include rejected response") == 1


def test_train_only_datasets_split_nine_to_one():
    rows = [{"prompt": f"p{i}", "chosen": "c", "rejected": "r"} for i in range(20)]
    adapter = make(hub_adapters.DahoasSyntheticinstructgptjpairwiseDataset, dd(train=rows))
    # "9,1" on 20 rows: round(18.0)=18, round(2.0)=2 -> [0,18,20].
    shuffle = get_shuffle_idx(1234, 20).tolist()
    train, held_out = adapter.get_train_data(), adapter.get_eval_data()
    assert [r["prompt"] for r in train] == [f"p{i}" for i in shuffle[:18]]
    assert [r["prompt"] for r in held_out] == [f"p{i}" for i in shuffle[18:]]


def test_wrong_schema_names_the_column():
    with pytest.raises(UserError, match=r"lacks column\(s\) \['rejected'\]"):
        make(hub_adapters.DahoasRmstaticDataset, dd(train=[{"prompt": "p", "chosen": "c"}], test=[{"prompt": "p", "chosen": "c"}]))
    with pytest.raises(UserError, match="no 'validation' split"):
        make(hub_adapters.StanfordnlpSHPDataset, dd(train=[{"history": "h", "human_ref_A": "a", "human_ref_B": "b", "labels": 1}]))


# --- dispatch --------------------------------------------------------------------------------


def test_dispatch_by_substring_loads_local_copy_from_disk(tmp_path):
    folder = tmp_path / "data" / "Dahoas" / "rm-static"
    dd(train=[HH] * 5, test=[HH] * 3).save_to_disk(str(folder))
    adapter = dispatch.get_raw_dataset(str(folder), str(tmp_path / "out"), 1234, -1)
    assert type(adapter) is hub_adapters.DahoasRmstaticDataset
    assert len(adapter.get_train_data()) == 5 and len(adapter.get_eval_data()) == 3
    assert adapter.get_prompt_and_chosen(adapter.get_train_data()[0]) == HH["prompt"] + HH["chosen"]
    # The key fingerprint covers the folder's files.
    assert dispatch.resolve_dataset(str(folder)).fingerprint()["content_sha256"]


@pytest.mark.parametrize("where", ["Dahoas/rm-static", "mine"])
def test_a_save_to_disk_text_column_of_numbers_is_one_line(tmp_path, where):
    """A saved Dataset whose prompt column is int64 (JSON and parquet rows are checked row by row): a
    TypeError mid-tokenisation before; one line naming the column now, for a local copy of a hub
    dataset and for a preference folder alike. SHP's numeric ``labels`` is no text column."""
    folder = tmp_path / "data" / where
    Dataset.from_dict({"prompt": list(range(8)), "chosen": ["a"] * 8, "rejected": ["b"] * 8}).save_to_disk(str(folder))
    with pytest.raises(UserError, match=rf"^dataset '.*{where}' split 'train' column 'prompt' holds int64, not text; "
                                        r"the \w+ adapter reads it as text: save it as strings$"):
        dispatch.get_raw_dataset(str(folder), str(tmp_path / "out"), 1234, -1)
    shp = tmp_path / "data" / "stanfordnlp" / "SHP"
    row = {"history": "h", "human_ref_A": "A", "human_ref_B": "B", "labels": 1}
    dd(train=[row] * 4, validation=[row] * 2).save_to_disk(str(shp))
    dispatch.get_raw_dataset(str(shp), str(tmp_path / "out"), 1234, -1)


def test_upstream_name_with_split_files(tmp_path):
    # Beyond upstream: a local copy of a hub dataset may also be split-named JSON Lines files.
    shp = {"history": "h", "human_ref_A": "A", "human_ref_B": "B", "labels": 1}
    folder = tmp_path / "stanfordnlp" / "SHP"
    write_jsonl(folder / "train.jsonl", [shp] * 4)
    write_jsonl(folder / "validation.jsonl", [shp] * 2)
    adapter = dispatch.get_raw_dataset(str(folder), "/unused", 1, -1)
    assert type(adapter) is hub_adapters.StanfordnlpSHPDataset
    assert (len(adapter.get_train_data()), len(adapter.get_eval_data())) == (4, 2)
    assert adapter.get_prompt_and_chosen(adapter.get_train_data()[0]) == " Human: h Assistant: A"


def test_dispatch_order_and_names():
    assert dispatch.match_adapter("Dahoas/rm-static") is hub_adapters.DahoasRmstaticDataset
    assert dispatch.match_adapter("/mnt/x/openai/webgpt_comparisons") is hub_adapters.OpenaiWebgptcomparisonsDataset
    assert dispatch.match_adapter("mkqa-Japanese") is hub_adapters.MkqaJapaneseDataset
    assert dispatch.match_adapter("dschat/builtin") is local_adapters.BuiltinDataset
    assert dispatch.match_adapter("nope/nothing") is None
    hub = dispatch.resolve_dataset("stanfordnlp/SHP")
    assert (hub.name, hub.adapter, hub.files) == ("stanfordnlp/SHP", hub_adapters.StanfordnlpSHPDataset, ())
    # Keyed by name only (as upstream): a cache hit needs no hub load (see test_data_prompt_dataset).
    assert hub.fingerprint() == {"name": "stanfordnlp/SHP", "adapter": "StanfordnlpSHPDataset", "content_sha256": None}


def fake_hub(monkeypatch, tmp_path):
    """Serve every hub name from ``tmp_path/hub`` (a data folder ``load_dataset`` reads like a hub
    repo); returns that folder and a list of the names loaded."""
    import datasets

    real = datasets.load_dataset
    source = tmp_path / "hub"
    loaded = []

    def load_dataset(name, *args, **kwargs):
        loaded.append(name)
        return real(str(source), cache_dir=str(tmp_path / "hf-cache"))

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return source, loaded


def test_unknown_dataset_lists_supported_names():
    with pytest.raises(UserError) as err:
        dispatch.resolve_dataset("someone/unknown-set")
    message = str(err.value)
    assert "unknown dataset 'someone/unknown-set'" in message
    for name in ("Dahoas/rm-static", "stanfordnlp/SHP", "lmqg/qag_jaquad", "dschat/builtin", "local/jsonfile", ".jsonl"):
        assert name in message
    assert "\n" not in message


def test_missing_local_path(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        dispatch.resolve_dataset(str(tmp_path / "missing.jsonl"))
    with pytest.raises(UserError, match="does not exist"):  # an upstream name, but clearly a path
        dispatch.resolve_dataset(str(tmp_path / "Dahoas" / "rm-static"))


def test_hub_failure_is_a_user_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(UserError, match="cannot load dataset 'Dahoas/rm-static'"):
        dispatch.get_raw_dataset("Dahoas/rm-static", "/unused", 1, -1)


# --- local forms -----------------------------------------------------------------------------


def check_verbatim(adapter, n_train, n_eval):
    train, held_out = adapter.get_train_data(), adapter.get_eval_data()
    assert (len(train), len(held_out)) == (n_train, n_eval)
    row = train[0]
    assert adapter.get_prompt(row) == row["prompt"]
    assert adapter.get_prompt_and_chosen(row) == row["prompt"] + row["chosen"]
    if adapter.has_rejected:
        assert adapter.get_prompt_and_rejected(row) == row["prompt"] + row["rejected"]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_local_file_train_only_is_split_nine_to_one(tmp_path, suffix):
    rows = pref_rows(20)
    path = tmp_path / f"prefs{suffix}"
    if suffix == ".jsonl":
        write_jsonl(path, rows)
    elif suffix == ".json":
        write_json(path, rows)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    adapter = dispatch.get_raw_dataset(str(path), str(tmp_path / "out"), 1234, -1)
    assert type(adapter) is local_adapters.LocalPreferenceDataset and adapter.has_rejected
    check_verbatim(adapter, 18, 2)
    shuffle = get_shuffle_idx(1234, 20).tolist()
    assert adapter.get_train_data()[0]["prompt"] == rows[shuffle[0]]["prompt"]


def test_json_lines_saved_as_json(tmp_path):
    path = write_jsonl(tmp_path / "rows.json", pref_rows(10))
    check_verbatim(dispatch.get_raw_dataset(str(path), "/unused", 1, -1), 9, 1)


def test_folder_with_split_files(tmp_path):
    write_jsonl(tmp_path / "d" / "train.jsonl", pref_rows(7))
    write_json(tmp_path / "d" / "test.json", pref_rows(3, tag="t"))
    adapter = dispatch.get_raw_dataset(str(tmp_path / "d"), "/unused", 1, -1)
    check_verbatim(adapter, 7, 3)
    assert adapter.get_eval_data()[0]["prompt"].startswith(" Human: t 0")


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_folder_of_hub_parquet_shards_keeps_its_test_split(tmp_path):
    """The hub's parquet export names its files ``<split>-NNNNN-of-NNNNN``: its test rows are the held-out
    split (never divided 9:1 into training), and the shards of one split are read together."""
    folder = tmp_path / "data"
    write_parquet(folder / "train-00000-of-00002.parquet", pref_rows(5, tag="a"))
    write_parquet(folder / "train-00001-of-00002.parquet", pref_rows(4, tag="b"))
    write_parquet(folder / "test-00000-of-00001.parquet", pref_rows(3, tag="t"))
    adapter = dispatch.get_raw_dataset(str(folder), "/unused", 1, -1)
    check_verbatim(adapter, 9, 3)
    assert {row["prompt"][:9] for row in adapter.get_eval_data()} == {" Human: t"}
    assert not any(row["prompt"].startswith(" Human: t") for row in adapter.get_train_data())


@pytest.mark.parametrize("name, split", [
    ("train.jsonl", "train"), ("train-00000-of-00001.parquet", "train"), ("Train.json", "train"),
    ("eval.json", "eval"), ("test-00000-of-00001.parquet", "test"), ("validation.jsonl", "validation"),
    ("Train_part2.json", None), ("train_small.jsonl", None), ("train.bak.jsonl", None),
    ("training.jsonl", None), ("data.jsonl", None), ("retrain.jsonl", None), ("testing-set.jsonl", None),
    ("dev-00000-of-00001.parquet", None),
    ("train-00000-of-00001-2a1df75c6bce91ab.parquet", "train"),  # the hub's shard with a hash (Dahoas/rm-static)
    ("test-00000-of-00001-8c7c51afc6d45980.parquet", "test"),
])
def test_split_name_from_the_file_name(name, split):
    from pathlib import Path

    assert lf.split_name(Path(name)) == split


def test_a_file_beside_the_split_files_is_refused_not_merged(tmp_path):
    # train_small.jsonl is no split name: it would be silently read twice if it counted as train
    for name in ("train.jsonl", "train_small.jsonl", "test.jsonl"):
        write_jsonl(tmp_path / "d" / name, pref_rows(3))
    with pytest.raises(UserError, match=r"mixes split files .* with other data files \(train_small.jsonl\)"):
        dispatch.get_raw_dataset(str(tmp_path / "d"), "/unused", 1, -1)


def test_shard_base_keeps_any_split_name():
    from pathlib import Path

    assert [lf.shard_base(Path(n)) for n in ("dev-00000-of-00001.parquet", "train.jsonl", "x-1-of-2.json",
                                              "test-00000-of-00001-8c7c51afc6d45980.parquet")] == [
        "dev", "train", "x-1-of-2", "test"]


def test_hub_shards_with_a_hash_keep_their_splits(tmp_path):
    """Dahoas/rm-static's own file names: a local copy, and the same files in a plain data folder."""
    names = ("train-00000-of-00001-2a1df75c6bce91ab.parquet", "test-00000-of-00001-8c7c51afc6d45980.parquet")
    for folder in (tmp_path / "Dahoas" / "rm-static", tmp_path / "plain"):
        write_parquet(folder / names[0], [HH] * 5)
        write_parquet(folder / names[1], [HH] * 3)
        adapter = dispatch.get_raw_dataset(str(folder), "/unused", 1, -1)
        assert (len(adapter.get_train_data()), len(adapter.get_eval_data())) == (5, 3), folder


def test_held_out_shards_without_a_train_split_are_refused(tmp_path):
    write_parquet(tmp_path / "d" / "test-00000-of-00001.parquet", pref_rows(3))
    with pytest.raises(UserError, match="test-00000-of-00001.parquet but no train"):
        dispatch.get_raw_dataset(str(tmp_path / "d"), "/unused", 1, -1)


def test_local_copy_of_a_hub_dataset_in_parquet_shards(tmp_path):
    """A hub dataset's parquet export (``huggingface-cli download``) at a path naming it: the shards
    give the splits its adapter reads."""
    shp = {"history": "h", "human_ref_A": "A", "human_ref_B": "B", "labels": 1}
    folder = tmp_path / "stanfordnlp" / "SHP"
    write_parquet(folder / "train-00000-of-00002.parquet", [shp] * 3)
    write_parquet(folder / "train-00001-of-00002.parquet", [shp] * 2)
    write_parquet(folder / "validation-00000-of-00001.parquet", [shp] * 2)
    adapter = dispatch.get_raw_dataset(str(folder), "/unused", 1, -1)
    assert type(adapter) is hub_adapters.StanfordnlpSHPDataset
    assert (len(adapter.get_train_data()), len(adapter.get_eval_data())) == (5, 2)


def test_folder_without_split_names_is_train_only(tmp_path):
    write_jsonl(tmp_path / "d" / "a.jsonl", pref_rows(10, rejected=False))
    write_jsonl(tmp_path / "d" / "b.jsonl", pref_rows(10, tag="b", rejected=False))
    adapter = dispatch.get_raw_dataset(str(tmp_path / "d"), "/unused", 1, -1)
    assert not adapter.has_rejected  # no rejected column anywhere
    check_verbatim(adapter, 18, 2)


def test_folder_mixing_split_and_other_files(tmp_path):
    write_jsonl(tmp_path / "d" / "train.jsonl", pref_rows(3))
    write_jsonl(tmp_path / "d" / "extra.jsonl", pref_rows(3))
    with pytest.raises(UserError, match="extra.jsonl"):
        dispatch.get_raw_dataset(str(tmp_path / "d"), "/unused", 1, -1)


def test_save_to_disk_folder(tmp_path):
    dd(train=pref_rows(6), validation=pref_rows(2, tag="v")).save_to_disk(str(tmp_path / "disk"))
    check_verbatim(dispatch.get_raw_dataset(str(tmp_path / "disk"), "/unused", 1, -1), 6, 2)
    Dataset.from_list(pref_rows(10)).save_to_disk(str(tmp_path / "single"))
    check_verbatim(dispatch.get_raw_dataset(str(tmp_path / "single"), "/unused", 1, -1), 9, 1)


def test_local_jsonfile_from_current_directory(tmp_path, monkeypatch):
    write_json(tmp_path / "data" / "train.json", [{"prompt": "Human: a Assistant:", "chosen": "b", "rejected": "c"}] * 4)
    write_json(tmp_path / "data" / "eval.json", [{"prompt": "Human: a Assistant:", "chosen": "b", "rejected": "c"}] * 2)
    monkeypatch.chdir(tmp_path)
    adapter = dispatch.get_raw_dataset("local/jsonfile", "/unused", 1, -1)
    assert type(adapter) is local_adapters.LocalJsonFileDataset and adapter.dataset_name_clean == "jsonfile"
    row = adapter.get_train_data()[0]
    assert adapter.get_prompt_and_chosen(row) == " Human: a Assistant: b"
    assert (len(adapter.get_train_data()), len(adapter.get_eval_data())) == (4, 2)


def test_local_jsonfile_missing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(local_adapters, "_source_root", lambda: tmp_path / "no-checkout")
    with pytest.raises(UserError, match="data/train.json and data/eval.json"):
        dispatch.resolve_dataset("local/jsonfile")


def test_builtin_dataset():
    from dschat.data import builtin

    adapter = dispatch.get_raw_dataset("dschat/builtin", "/unused", 1234, -1)
    assert type(adapter) is local_adapters.BuiltinDataset and adapter.has_rejected
    first = builtin.read_rows("train")[0]
    assert adapter.get_train_data()[0] == first
    assert adapter.get_prompt_and_chosen(first) == first["prompt"] + first["chosen"]
    assert len(adapter.get_train_data()) == len(builtin.read_rows("train"))
    assert len(adapter.get_eval_data()) == len(builtin.read_rows("eval"))
    assert dispatch.resolve_dataset("dschat/builtin").fingerprint()["content_sha256"]


# --- bad local files -------------------------------------------------------------------------


def test_malformed_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(pref_rows(1)[0]) + "\n\n" + '{"prompt": "x", "chosen": \n', encoding="utf-8")
    with pytest.raises(UserError, match=r"bad.jsonl:3: malformed JSON"):
        dispatch.get_raw_dataset(str(path), "/unused", 1, -1)


def test_malformed_json_names_file_and_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n {"prompt": "a", "chosen": "b"},\n {"prompt": "a" "chosen": "b"}\n]\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"bad.json:3: malformed JSON"):
        dispatch.get_raw_dataset(str(path), "/unused", 1, -1)


def test_an_unpaired_surrogate_escape_is_named_as_such(tmp_path):
    path = tmp_path / "surrogate.jsonl"
    rows = pref_rows(20)
    path.write_text("\n".join(json.dumps(r) for r in rows).replace(" Human:", " Human: \\ud800", 1) + "\n",
                    encoding="utf-8")
    with pytest.raises(UserError, match=r"surrogate.jsonl holds text that is not valid Unicode \(an unpaired surrogate"):
        dispatch.get_raw_dataset(str(path), "/unused", 1, -1)


def test_missing_field_names_file_row_and_column(tmp_path):
    rows = pref_rows(3)
    del rows[1]["chosen"]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(UserError, match=r"rows.jsonl:2: missing field 'chosen'"):
        dispatch.get_raw_dataset(str(path), "/unused", 1, -1)


def test_non_string_field(tmp_path):
    path = write_json(tmp_path / "rows.json", [{"prompt": "p", "chosen": 3}])
    with pytest.raises(UserError, match=r"rows.json item 1: field 'chosen' must be a string"):
        dispatch.get_raw_dataset(str(path), "/unused", 1, -1)


def test_missing_parquet_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "p", "answer": "a"}]), tmp_path / "x.parquet")
    with pytest.raises(UserError, match=r"x.parquet row 1: missing field 'chosen'"):
        dispatch.get_raw_dataset(str(tmp_path / "x.parquet"), "/unused", 1, -1)


def test_json_lines_keep_unicode_line_separators_inside_strings(tmp_path):
    # U+2028 / U+2029 / U+0085 are legal raw characters in JSON strings (json.dumps(ensure_ascii=
    # False) writes them raw); str.splitlines() would cut those rows in two.
    rows = pref_rows(3)
    rows[0]["prompt"] = " Human: hi\u2028there Assistant:"
    rows[1]["chosen"] = " a\x85b\u2029c"
    text = "\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\r\n"  # Windows line ends
    for name in ("rows.jsonl", "rows.json"):  # .json: JSON Lines saved as .json
        path = tmp_path / name
        path.write_bytes(text.encode("utf-8"))
        records = lf.read_records(path)
        assert [r for _, r in records] == rows
        assert [where for where, _ in records] == [f"{path}:{i}" for i in (1, 2, 3)]
    # Line numbers still count "\n" lines only.
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0], ensure_ascii=False) + "\n\n" + '{"prompt": "x\u2028y", "chosen": \n', encoding="utf-8")
    with pytest.raises(UserError, match=r"bad.jsonl:3: malformed JSON"):
        lf.read_records(bad)


def test_malformed_json_message_reads_once(tmp_path):
    # json's own message ends in "at" here ("Unterminated string starting at"): no "at at".
    for name in ("bad.jsonl", "bad.json"):
        path = tmp_path / name
        path.write_text('{"prompt": "never closed}', encoding="utf-8")
        with pytest.raises(UserError) as err:
            lf.read_records(path)
        assert "(Unterminated string starting at column 12)" in str(err.value)
    path.write_text('{"prompt": }\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"\(Expecting value at column 12\)"):
        lf.read_records(path)


# --- local copies of hub datasets: the same row checks as local preference files ----------------


def rm_static_copy(tmp_path, bad_row):
    folder = tmp_path / "Dahoas" / "rm-static"
    rows = [dict(HH) for _ in range(4)]
    rows[1] = bad_row
    write_jsonl(folder / "train.jsonl", rows)
    write_jsonl(folder / "test.jsonl", [HH] * 2)
    return folder


@pytest.mark.parametrize("bad_row,message", [
    ({"prompt": HH["prompt"], "chosen": " ok"}, r"train.jsonl:2: missing field 'rejected'"),
    ({**HH, "chosen": None}, r"train.jsonl:2: field 'chosen' is null; every row of train.jsonl needs a value"),
    ({**HH, "chosen": 5}, r"train.jsonl:2: field 'chosen' must be a string, got int"),
])
def test_local_copy_of_a_hub_dataset_checks_rows(tmp_path, bad_row, message):
    folder = rm_static_copy(tmp_path, bad_row)
    with pytest.raises(UserError, match=message):
        dispatch.get_raw_dataset(str(folder), "/unused", 1, -1)


def test_local_copy_with_structured_columns(tmp_path):
    # Only the adapter's text columns must be strings; the others keep their JSON types.
    row = {"question": {"full_text": "Why?"}, "answer_0": "A [1].", "answer_1": "B", "score_0": 1.0,
           "score_1": -1.0, "extra": "dropped"}
    folder = tmp_path / "openai" / "webgpt_comparisons"
    write_jsonl(folder / "train.jsonl", [row] * 10)
    adapter = dispatch.get_raw_dataset(str(folder), "/unused", 1, -1)
    sample = adapter.get_train_data()[0]
    assert sorted(sample) == sorted(hub_adapters.OpenaiWebgptcomparisonsDataset.required_columns)
    assert adapter.get_prompt_and_chosen(sample) == " Human: Why? Assistant: A."
    # A field whose type changes from row to row cannot form a table: one line naming the file.
    write_jsonl(folder / "train.jsonl", [row, {**row, "question": "Why?"}])
    with pytest.raises(UserError, match=r"cannot combine the rows of .*train.jsonl"):
        dispatch.get_raw_dataset(str(folder), "/unused", 1, -1)


def test_local_copy_nulls_where_the_adapter_skips_them(tmp_path):
    # Zhihu-KOL's methods return None for a null field (the row is skipped), so a null is allowed.
    folder = tmp_path / "wangrui6" / "Zhihu-KOL"
    rows = [{"INSTRUCTION": "问?", "RESPONSE": "答。"}, {"INSTRUCTION": "问?", "RESPONSE": None}]
    write_jsonl(folder / "train.jsonl", rows * 5)
    adapter = dispatch.get_raw_dataset(str(folder), "/unused", 1, -1)
    texts_ = [adapter.get_prompt_and_chosen(s) for s in adapter.raw_datasets["train"]]
    assert texts_.count(None) == 5
    write_jsonl(folder / "train.jsonl", [{"INSTRUCTION": "问?", "RESPONSE": 3}])
    with pytest.raises(UserError, match=r"field 'RESPONSE' must be a string or null, got int"):
        dispatch.get_raw_dataset(str(folder), "/unused", 1, -1)


def test_a_local_folder_keeps_the_fields_reward_functions_and_environments_read(tmp_path):
    """A local preference folder keeps its rows' other fields (here ``answer``, missing from one row),
    so `--reward_fn dschat.rewards:math_exact_match` and `--env dschat.envs_examples:calculator` find
    them beside each phase-3 prompt."""
    from dschat.data.prompt_columns import load_prompt_columns
    from dschat.models.tokenizer import load_hf_tokenizer

    folder = tmp_path / "math"
    rows = [{"prompt": f"What is {i} + {i}?", "chosen": f"{2 * i}", "answer": f"#### {2 * i}"} for i in range(20)]
    rows[3] = {"prompt": "What is 3 + 3?", "chosen": "6"}
    write_jsonl(folder / "train.jsonl", rows)
    write_jsonl(folder / "eval.jsonl", rows[:4])
    columns = load_prompt_columns([str(folder)], "0,0,1", 1234, str(tmp_path / "out"), -1,
                                  load_hf_tokenizer("tiny-opt"))
    found = {record.text: record.fields.get("answer") for record in columns.records.values()}
    assert found["What is 5 + 5?"] == "#### 10" and found["What is 3 + 3?"] is None


def test_other_fields_that_cannot_form_a_table_are_left_out_with_a_note(tmp_path, capsys):
    """A field steps 1-2 never read, whose type changes from row to row, does not stop the data: it
    is left out, with one note naming the file."""
    folder = tmp_path / "mixed"
    rows = [{"prompt": f"Q{i}?", "chosen": f"A{i}.", "id": i if i % 2 else f"q-{i}"} for i in range(20)]
    write_jsonl(folder / "train.jsonl", rows)
    write_jsonl(folder / "eval.jsonl", rows[:4])
    adapter = dispatch.get_raw_dataset(str(folder), "/unused", 1, -1)
    assert sorted(adapter.get_train_data().column_names) == ["chosen", "prompt"]
    out = capsys.readouterr().out
    assert "train.jsonl: the fields ['id'] are left out (" in out and out.count("note:") >= 1


@pytest.mark.parametrize("folder, rows, phase, message", [
    # A flattened export: the question is a string, not {"full_text": ...} (TypeError in the adapter).
    ("openai/webgpt_comparisons", [{"question": "Why?", "answer_0": "A", "answer_1": "B", "score_0": 1.0,
                                    "score_1": -1.0}] * 10, 2, "TypeError"),
    # An empty question list (IndexError in the adapter).
    ("lmqg/qag_jaquad", [{"questions": [], "paragraph": "段落。"}] * 10, 3, "IndexError"),
])
def test_a_local_copy_row_of_another_shape_is_one_line_showing_the_row(tmp_path, folder, rows, phase, message):
    """Fields the text checks do not cover (structured ones) reach the adapter's getters: a row of
    another shape than the hub dataset's is one line naming the dataset and showing the row, not a
    traceback mid-tokenisation."""
    from dschat.data.tokenization import create_dataset

    from helpers.data import make_tokenizer

    write_jsonl(tmp_path / folder / "train.jsonl", rows)
    write_jsonl(tmp_path / folder / "validation.jsonl", rows)  # qag_jaquad's eval split
    with pytest.raises(UserError, match=rf"a row does not have the fields its adapter reads \({message}: .*\): \{{"):
        create_dataset(-1, str(tmp_path / folder), "1,1,1", str(tmp_path / "cache"), phase, 1, make_tokenizer(),
                       "<|endoftext|>", 64)
