"""PPO-ptx text loading: sources, text column rule, and group_texts blocks."""
from __future__ import annotations

from itertools import chain
from types import SimpleNamespace

import pytest
from datasets import Dataset, DatasetDict

from dschat.data.unsupervised import get_unsupervised_data, unsupervised_training_enabled
from dschat.errors import UserError

from helpers.data import make_tokenizer, write_jsonl


def ptx_args(name, prompt_len=3, answer_len=2, config=None):
    return SimpleNamespace(
        unsupervised_dataset_name=str(name), unsupervised_dataset_config_name=config,
        preprocessing_num_workers=None, max_prompt_seq_len=prompt_len, max_answer_seq_len=answer_len,
    )


def expected_blocks(tok, texts, block):
    # Concatenate every text's ids, cut into `block`-token chunks, drop the remainder.
    ids = list(chain(*(tok(t)["input_ids"] for t in texts)))
    n = (len(ids) // block) * block if len(ids) >= block else len(ids)
    return [ids[i:i + block] for i in range(0, n, block)]


def test_enabled_by_name_alone():
    assert unsupervised_training_enabled(SimpleNamespace(unsupervised_dataset_name="x", unsupervised_dataset_config_name=None))
    assert not unsupervised_training_enabled(SimpleNamespace(unsupervised_dataset_name=None))


def test_txt_file_blocks_and_labels(tmp_path):
    tok = make_tokenizer()
    texts = ["the cat is happy", "why is the sky blue", "hello", "a dog and a bird"]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(texts[:2]) + "\n\n" + "\n".join(texts[2:]) + "\n", encoding="utf-8")  # blank line skipped
    ds = get_unsupervised_data(ptx_args(path), tok)
    blocks = expected_blocks(tok, texts, 5)  # block = max_prompt_seq_len + max_answer_seq_len = 3 + 2
    assert len(blocks) >= 2
    assert ds["input_ids"] == blocks and ds["labels"] == blocks
    assert ds["attention_mask"] == [[1] * 5 for _ in blocks]


def test_more_workers_than_cpus_are_the_cpus_this_process_may_use(tmp_path, monkeypatch, capsys):
    """datasets starts a process per worker, up to one per row: --preprocessing_num_workers 100000
    forked a process per row of the corpus (the machine ran out of memory). The map is asked for the
    CPUs' count and then run in this process: forking a test worker is itself refused (ENOMEM) on a
    loaded machine."""
    import dschat.data.unsupervised as unsupervised

    monkeypatch.setattr(unsupervised.os, "sched_getaffinity", lambda pid: {0, 1})
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(f"text number {i} here" for i in range(40)) + "\n", encoding="utf-8")
    args = ptx_args(path)
    args.preprocessing_num_workers = 100000
    started = []
    real_map = DatasetDict.map

    def counting_map(self, *a, **k):
        started.append(k.get("num_proc"))
        return real_map(self, *a, **{**k, "num_proc": None})

    monkeypatch.setattr(DatasetDict, "map", counting_map)
    tok = make_tokenizer()
    assert get_unsupervised_data(args, tok)["input_ids"] == expected_blocks(tok, [f"text number {i} here"
                                                                                  for i in range(40)], 5)
    assert started and set(started) == {2}
    assert ("--preprocessing_num_workers 100000: tokenising the PPO-ptx data with 2 processes, the CPUs this "
            "process may use") in capsys.readouterr().out


def test_short_corpus_keeps_one_short_block(tmp_path):
    # total_length < block_size: upstream keeps everything as one shorter block.
    tok = make_tokenizer()
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "hi"}])
    ds = get_unsupervised_data(ptx_args(path, 100, 100), tok)
    assert ds["input_ids"] == [tok("hi")["input_ids"]]


def test_text_column_else_first_column(tmp_path):
    tok = make_tokenizer()
    path = write_jsonl(tmp_path / "t.jsonl", [{"body": "the cat is happy today", "id": "1"}, {"body": "a dog", "id": "2"}])
    ds = get_unsupervised_data(ptx_args(path), tok)
    assert ds["input_ids"] == expected_blocks(tok, ["the cat is happy today", "a dog"], 5)


def test_save_to_disk_and_builtin(tmp_path):
    tok = make_tokenizer()
    texts = ["the cat is happy", "why is the sky blue and the sun red"]
    DatasetDict({"train": Dataset.from_dict({"text": texts})}).save_to_disk(str(tmp_path / "disk"))
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "disk").rglob("*"))
    ds = get_unsupervised_data(ptx_args(tmp_path / "disk"), tok)
    assert ds["input_ids"] == expected_blocks(tok, texts, 5)
    # With --data_output_path the maps' results are memory-mapped files of dschat's cache folder (0700);
    # none are written into the user's folder (they would fail in a read-only one).
    args = ptx_args(tmp_path / "disk")
    args.data_output_path = str(tmp_path / "cache")
    for _ in range(2):  # built, then read back
        ds = get_unsupervised_data(args, tok)
        assert ds["input_ids"] == expected_blocks(tok, texts, 5) and ds.cache_files
    (folder,) = (tmp_path / "cache").glob("ptx_*")
    assert (folder / "tokens.arrow").is_file() and oct(folder.stat().st_mode & 0o777) == "0o700"
    assert all(str(folder) in f["filename"] for f in ds.cache_files)
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "disk").rglob("*")) == before

    from dschat.data import builtin

    rows = builtin.read_rows("train")[:3]
    ds = get_unsupervised_data(ptx_args("dschat/builtin", 8, 8), tok)
    first = expected_blocks(tok, [r["prompt"] + r["chosen"] for r in rows], 16)[0]
    assert ds[0]["input_ids"] == first and len(ds[0]["input_ids"]) == 16


def test_folder_reads_its_train_shards_only(tmp_path):
    """A folder of the hub's ``<split>-NNNNN-of-NNNNN`` files: the train shards are the text, the
    held-out shard is left out."""
    tok = make_tokenizer()
    texts = ["the cat is happy", "why is the sky blue", "a dog and a bird"]
    write_jsonl(tmp_path / "d" / "train-00000-of-00002.jsonl", [{"text": texts[0]}])
    write_jsonl(tmp_path / "d" / "train-00001-of-00002.jsonl", [{"text": t} for t in texts[1:]])
    write_jsonl(tmp_path / "d" / "test-00000-of-00001.jsonl", [{"text": "held out words never trained on"}])
    ds = get_unsupervised_data(ptx_args(tmp_path / "d"), tok)
    assert ds["input_ids"] == expected_blocks(tok, texts, 5)


def test_bad_sources(tmp_path):
    tok = make_tokenizer()
    with pytest.raises(UserError, match="does not exist"):
        get_unsupervised_data(ptx_args(tmp_path / "missing.txt"), tok)
    path = write_jsonl(tmp_path / "n.jsonl", [{"n": 1}, {"n": 2}])
    with pytest.raises(UserError, match=r"n.jsonl:1: the text field 'n' has type int"):
        get_unsupervised_data(ptx_args(path), tok)
    DatasetDict({"train": Dataset.from_dict({"n": [1, 2]})}).save_to_disk(str(tmp_path / "ints"))
    with pytest.raises(UserError, match="not strings"):
        get_unsupervised_data(ptx_args(tmp_path / "ints"), tok)


@pytest.mark.parametrize("rows,message", [
    ([{"text": "the cat"}, {"text": None}], r"t.jsonl:2: the text field 'text' is null"),
    ([{"text": "the cat"}, {"body": "x"}], r"t.jsonl:2: the text field 'text' is missing"),
    ([{"text": "the cat"}, {"text": 3}], r"t.jsonl:2: the text field 'text' has type int"),
])
def test_text_that_is_not_a_string_names_file_and_row(tmp_path, rows, message):
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(UserError, match=message):
        get_unsupervised_data(ptx_args(path), make_tokenizer())


def test_null_text_in_a_save_to_disk_folder(tmp_path):
    DatasetDict({"train": Dataset.from_dict({"text": ["a", "b", None, None]})}).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(UserError, match=r"row 3 of the train split has no text \(null in column 'text'; 2 such rows\)"):
        get_unsupervised_data(ptx_args(tmp_path / "d"), make_tokenizer())


def test_every_block_is_full_so_the_collator_stacks_them(tmp_path):
    # 1010 lines: datasets maps 1000 texts at a time, and the last 10 lines alone are shorter than
    # a block. Upstream kept them as a short last block, which default_data_collator cannot stack
    # with the full ones (a ValueError in step 3).
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    tok = make_tokenizer()
    path = tmp_path / "ptx.txt"
    path.write_text("".join(f"the cat is happy and the dog is sad {i}\n" for i in range(1010)), encoding="utf-8")
    ds = get_unsupervised_data(ptx_args(path, 256, 256), tok)
    assert len(ds) > 1 and {len(ids) for ids in ds["input_ids"]} == {512}
    batch = default_data_collator([ds[len(ds) - 2], ds[len(ds) - 1]])
    assert batch["input_ids"].shape == batch["labels"].shape == (2, 512)
    assert sum(b["input_ids"].shape[0] for b in DataLoader(ds, batch_size=4, collate_fn=default_data_collator)) == len(ds)


def test_no_batch_fills_a_block_groups_the_whole_split(tmp_path):
    # Every batch of 1000 one-word texts is shorter than a block, but the split is not: grouping the
    # split at once gives full blocks (upstream: one short block per batch, of different lengths).
    tok = make_tokenizer()
    texts = ["hello"] * 2500
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    per_text = len(tok("hello")["input_ids"])
    block = 1000 * per_text + 10  # one batch of 1000 texts is just short of a block
    ds = get_unsupervised_data(ptx_args(path, block - 5, 5), tok)
    assert ds["input_ids"] == expected_blocks(tok, texts, block) and len(ds) == 2500 * per_text // block
