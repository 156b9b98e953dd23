"""dschat/wordgame, the multi-turn demo's embedded prompts: registered, deterministic, prompts that never
show the secret word, and train and held-out games that share no prompt and no word."""
import json

import pytest

from dschat.data import wordgame
from dschat.data.dispatch import get_raw_dataset, resolve_dataset
from dschat.data.phases import select_phase_rows
from dschat.data.prompt_columns import load_prompt_columns
from dschat.errors import UserError
from dschat.models.tokenizer import load_hf_tokenizer


def shipped() -> dict[str, list[dict]]:
    return {split: [json.loads(line) for line in (wordgame.data_dir() / f"{split}.jsonl").read_text().splitlines()]
            for split in wordgame.SPLITS}


def test_the_shipped_files_are_the_generator_s():
    assert shipped() == wordgame.make_rows()


def test_the_generator_writes_them(tmp_path):
    wordgame.main(["--out", str(tmp_path), "--train_rows", "5", "--eval_rows", "3", "--seed", "7"])
    rows = {s: [json.loads(x) for x in (tmp_path / f"{s}.jsonl").read_text().splitlines()] for s in wordgame.SPLITS}
    assert rows == wordgame.make_rows(7, 5, 3) != wordgame.make_rows(8, 5, 3)


def test_prompts_hide_the_word_and_the_splits_are_disjoint():
    rows = shipped()
    assert (len(rows["train"]), len(rows["eval"])) == (wordgame.DEFAULT_TRAIN_ROWS, wordgame.DEFAULT_EVAL_ROWS)
    for split_rows in rows.values():
        assert len({r["prompt"] for r in split_rows}) == len(split_rows)  # one row per prompt: columns by prompt
        for r in split_rows:
            assert set(r) == {"prompt", "word"} and r["word"] not in r["prompt"].lower()
            assert r["prompt"].endswith("<|im_start|>assistant\n")
    assert not {r["prompt"] for r in rows["train"]} & {r["prompt"] for r in rows["eval"]}
    assert not {r["word"] for r in rows["train"]} & {r["word"] for r in rows["eval"]}


def test_registered_as_a_data_path(tmp_path):
    source = resolve_dataset("dschat/wordgame")
    assert source.adapter is wordgame.WordGameDataset and source.files == tuple(wordgame.data_files())
    raw = get_raw_dataset("dschat/wordgame", str(tmp_path), 1234, -1)
    sel = select_phase_rows(raw, "0,0,1", 3, 1234, str(tmp_path), -1)
    assert (len(sel.train), len(sel.eval)) == (wordgame.DEFAULT_TRAIN_ROWS, wordgame.DEFAULT_EVAL_ROWS)
    sample = sel.train[0]
    assert raw.get_prompt(sample) == sample["prompt"] and raw.get_chosen(sample) is None


def test_the_word_reaches_the_environment(tmp_path):
    """Step 3 looks each prompt's row up by its source: the ``word`` column comes with it."""
    tok = load_hf_tokenizer("tiny-opt")
    columns = load_prompt_columns(["dschat/wordgame"], "0,0,1", 1234, str(tmp_path), -1, tok)
    by_prompt = {r["prompt"]: r["word"] for split in shipped().values() for r in split}
    assert len(columns) == len(by_prompt)
    for record in columns.records.values():
        assert record.fields["word"] == by_prompt[record.fields["prompt"]]


def test_missing_files_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(wordgame, "WORDGAME_DATA_DIR", tmp_path)
    with pytest.raises(UserError, match=r"the files of dschat/wordgame are missing .*python -m dschat.data.wordgame"):
        resolve_dataset("dschat/wordgame")
