"""PPO-ptx text loading: sources, text column rule, and group_texts blocks."""
from __future__ import annotations

from itertools import chain
from types import SimpleNamespace

import pytest
from datasets import Dataset, DatasetDict

from dschat.data.unsupervised import get_unsupervised_data, unsupervised_training_enabled
from dschat.errors import UserError
from test_data_common import make_tokenizer, write_jsonl


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
    ds = get_unsupervised_data(ptx_args(tmp_path / "disk"), tok)
    assert ds["input_ids"] == expected_blocks(tok, texts, 5)

    from dschat.data import builtin

    rows = builtin.read_rows("train")[:3]
    ds = get_unsupervised_data(ptx_args("dschat/builtin", 8, 8), tok)
    first = expected_blocks(tok, [r["prompt"] + r["chosen"] for r in rows], 16)[0]
    assert ds[0]["input_ids"] == first and len(ds[0]["input_ids"]) == 16


def test_bad_sources(tmp_path):
    tok = make_tokenizer()
    with pytest.raises(UserError, match="does not exist"):
        get_unsupervised_data(ptx_args(tmp_path / "missing.txt"), tok)
    path = write_jsonl(tmp_path / "n.jsonl", [{"n": 1}, {"n": 2}])
    with pytest.raises(UserError, match="not strings"):
        get_unsupervised_data(ptx_args(path), tok)
