"""Each phase-3 prompt's dataset row (dschat.data.prompt_columns): the cache and step 3's batches carry
every prompt's source (data path entry, split, row), so a reward function, a judge and an environment
get the answer's own row's fields, also where several rows share one prompt and differ in another
field (a constant "Guess my number." with a per-row secret). A batch without sources finds a row by
its prompt's tokens, and a shared prompt there is one line naming the fix, never a silent guess."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

import env_fixtures
import reward_fixtures
from dschat.data.collators import SOURCES_KEY, DataCollatorRLHF, drop_padding_columns
from dschat.data.prompt_columns import PromptColumns, load_prompt_columns
from dschat.data.prompt_dataset import create_prompt_dataset
from dschat.errors import UserError
from dschat.models.tokenizer import load_hf_tokenizer

from helpers.data import write_jsonl
from helpers.step3 import base_argv, step3_main

GUESS = "Guess my number."
SHARED = r"the prompt 'Guess my number\.' is in 12 rows whose 'secret' differ.*pass the batch's 'prompt_sources'"


@pytest.fixture(scope="module")
def tok():
    return load_hf_tokenizer("tiny-opt")


def guessing_data(folder: Path) -> Path:
    """Ten rows of one guessing-game prompt with their own secrets (two more in eval), a prompt asked
    twice with the same fields, and ten ordinary prompts; first, a row without a prompt (skipped: every
    later row's source must still be its own position)."""
    rows = ([{"prompt": None, "chosen": "x", "secret": -1}]
            + [{"prompt": GUESS, "chosen": "5", "secret": i} for i in range(10)]
            + [{"prompt": "Say hi.", "chosen": "hi", "secret": 0}] * 2
            + [{"prompt": f"Q{i}?", "chosen": f"A{i}.", "secret": i} for i in range(10)])
    write_jsonl(folder / "train.jsonl", rows)
    write_jsonl(folder / "eval.jsonl", [{"prompt": GUESS, "chosen": "5", "secret": 10 + i} for i in range(2)])
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory, tok) -> tuple[PromptColumns, list, list]:
    """The guessing data's columns and its phase-3 (train, eval) datasets, as step 3 loads them."""
    folder = guessing_data(tmp_path_factory.mktemp("guess"))
    out = str(tmp_path_factory.mktemp("out"))
    columns = load_prompt_columns([str(folder)], "0,0,1", 1234, out, -1, tok)
    train, held_out = create_prompt_dataset(-1, [str(folder)], "0,0,1", out, 3, 1234, tok, 16)
    return columns, train, held_out


def batch_of(items) -> dict[str, torch.Tensor]:
    """The step-3 loader's batch of ``items``, padding-only columns dropped (as the PPO loop does)."""
    return drop_padding_columns(DataCollatorRLHF(16)(list(items)), "prompt_att_mask", side="left")


def texts_of(tok, batch) -> list[str]:
    return [tok.decode(row[m.bool()], skip_special_tokens=True) for row, m in zip(batch["prompt"], batch["prompt_att_mask"])]


def test_every_prompt_carries_its_own_rows_fields(data, tok):
    columns, train, held_out = data
    assert len(columns.shared) == 1
    (shared,) = columns.shared.values()
    assert (shared.text, shared.rows, shared.fields) == (GUESS, 12, frozenset({"secret"}))
    secrets: Counter = Counter()
    for ds in (train, held_out):
        batch = batch_of(ds[i] for i in range(len(ds)))
        assert batch[SOURCES_KEY].shape == (len(ds), 3)
        texts = texts_of(tok, batch)
        got = columns.for_batch(batch["prompt"], batch["prompt_att_mask"], texts, batch[SOURCES_KEY])
        rows = columns.rows_for_batch(batch["prompt"], batch["prompt_att_mask"], texts, batch[SOURCES_KEY])
        assert got["secret"] == [row["secret"] for row in rows] and [row["prompt"] for row in rows] == texts
        secrets.update(s for s, text in zip(got["secret"], texts) if text == GUESS)
    assert secrets == Counter(range(12))  # each guessing row's own secret, once


def test_sources_survive_the_cache_shuffles_and_blends(data, tok, tmp_path):
    """A second read of the cache, and two data paths blended and shuffled, keep each row's source."""
    columns, train, _ = data
    folder = guessing_data(tmp_path / "again")
    out = str(tmp_path / "out")
    blended, _ = create_prompt_dataset(-1, [str(folder), "dschat/builtin"], "2,4,4", out, 3, 1234, tok, 16)
    cached, _ = create_prompt_dataset(-1, [str(folder), "dschat/builtin"], "2,4,4", out, 3, 1234, tok, 16)
    assert torch.equal(blended.prompt_sources, cached.prompt_sources)
    assert set(blended.prompt_sources[:, 0].tolist()) == {0, 1}  # both entries, mixed
    both = load_prompt_columns([str(folder), "dschat/builtin"], "2,4,4", 1234, out, -1, tok)
    batch = batch_of(cached[i] for i in range(len(cached)))
    rows = both.rows_for_batch(batch["prompt"], batch["prompt_att_mask"], texts_of(tok, batch), batch[SOURCES_KEY])
    assert [row["prompt"] for row in rows] == texts_of(tok, batch)


def test_without_sources_a_shared_prompt_is_one_line_and_others_are_found(data, tok):
    columns, train, _ = data
    by_text = {}
    for i in range(len(train)):
        by_text.setdefault(tok.decode(train[i][0].flip(0), skip_special_tokens=True), train[i])
    for text, fine in ((GUESS, False), ("Say hi.", True), ("Q3?", True)):
        batch = batch_of([by_text[text]])
        if fine:
            row, = columns.rows_for_batch(batch["prompt"], batch["prompt_att_mask"], [text])
            assert row["secret"] == (0 if text == "Say hi." else 3)  # asked twice with the same fields: not shared
        else:
            for look in (columns.for_batch, columns.rows_for_batch):
                with pytest.raises(UserError, match=SHARED):
                    look(batch["prompt"], batch["prompt_att_mask"], [text])


def test_columns_read_as_the_dataset_is_built(data, tok, tmp_path):
    """A seed of None means the data's default seed, and one data path may be a string, as in
    create_prompt_dataset."""
    columns, _, _ = data
    folder = guessing_data(tmp_path / "g")
    again = load_prompt_columns(str(folder), "0,0,1", None, str(tmp_path / "out"), -1, tok)
    assert {k: r.fields for k, r in again.records.items()} == {k: r.fields for k, r in columns.records.items()}


def test_a_source_that_is_not_the_prompts_row_is_one_line(data, tok):
    columns, train, _ = data
    batch = batch_of([train[0], train[1]])
    texts = texts_of(tok, batch)
    wrong = batch[SOURCES_KEY].flip(0) if texts[0] != texts[1] else batch[SOURCES_KEY] + torch.tensor([0, 0, 1000])
    with pytest.raises(UserError, match=r"\(batch row 0\) is not .*the phase-3 data; use the prompt data, split"):
        columns.for_batch(batch["prompt"], batch["prompt_att_mask"], texts, wrong)
    with pytest.raises(UserError, match=r"is not in the phase-3 data"):
        columns.for_batch(batch["prompt"], batch["prompt_att_mask"], texts, batch[SOURCES_KEY] + torch.tensor([5, 0, 0]))
    with pytest.raises(UserError, match=r"prompt_sources must be \(2, 3\) for 2 prompts, got \(1, 3\)"):
        columns.for_batch(batch["prompt"], batch["prompt_att_mask"], texts, batch[SOURCES_KEY][:1])


def test_upstreams_three_field_items_and_padding_trim_hold(data, tok, tmp_path):
    _, train, _ = data
    item = train[0]
    assert len(item) == 3 and item[-1] == item.pad_token_id and item.source is not None
    assert item._replace(pad_token_id=7).source == item.source
    # Upstream's per-dataset function cannot know the data path entry: its prompts have no sources.
    from dschat.data.tokenization import create_dataset
    alone, _ = create_dataset(-1, "dschat/builtin", "2,4,4", str(tmp_path), 3, 1234, tok, "<|endoftext|>", 16)
    assert alone.prompt_sources is None and alone[0].source is None
    assert SOURCES_KEY not in DataCollatorRLHF(16)([alone[0], alone[1]])
    # A batch exactly as wide as a source (3 columns) keeps its sources whole.
    narrow = DataCollatorRLHF(3)([train[0]])
    trimmed = drop_padding_columns({**narrow, "prompt_att_mask": torch.tensor([[0, 1, 1]])}, "prompt_att_mask",
                                   side="left")
    assert torch.equal(trimmed[SOURCES_KEY], narrow[SOURCES_KEY])


def test_field_values_are_the_same_when_equal_or_both_nan():
    import numpy as np

    from dschat.data.prompt_columns import _ABSENT, _same
    assert _same(1, 1.0) and _same("a", "a") and _same(float("nan"), float("nan"))
    assert _same(np.float32("nan"), float("nan")) and _same([1, 2], [1, 2])
    assert not _same(1, 2) and not _same(float("nan"), 1.0) and not _same(None, 0)
    assert not _same(np.array([1, 2]), np.array([1, 2]))  # no plain bool: counted as different
    assert _same(_ABSENT, _ABSENT) and not _same(_ABSENT, None)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("algorithm", ["grpo", "remax"])
def test_step3_gives_each_answer_its_own_rows_secret(algorithm, tmp_path, capsys):
    """Eight guessing rows (two more held out) sharing one prompt, one epoch of two prompts x two
    answers: the reward function and the environment see every training row's own secret once per
    answer (ReMax: and once for its greedy answer); the held-out evaluation plays both held-out rows
    and its judge sees their secrets. The retired --shared_prompt_fields is accepted with a note."""
    rows = [{"prompt": GUESS, "chosen": "5", "secret": i} for i in range(8)]
    data = tmp_path / "guess"
    write_jsonl(data / "train.jsonl", rows)
    write_jsonl(data / "eval.jsonl", [{"prompt": GUESS, "chosen": "5", "secret": 8 + i} for i in range(2)])
    argv = base_argv("tiny-opt", Path("unused"), tmp_path / "cache", "--algorithm", algorithm, "--num_generations", "2",
                     "--reward_fn", "reward_fixtures:reward_secret", "--env", "env_fixtures:reads_secret",
                     "--max_turns", "1", "--eval_interval", "2", "--eval_prompts", "2",
                     "--eval_judge", "reward_fixtures:judge_secret", "--num_train_epochs", "1", steps=4)
    i = argv.index("--critic_model_name_or_path")
    del argv[i:i + 2]
    argv[argv.index("--data_path") + 1] = str(data)
    argv += ["--data_split", "0,0,1", "--shared_prompt_fields", "first"]
    for seen in (*reward_fixtures.SECRETS.values(), env_fixtures.SECRETS_READ):
        seen.clear()
    result = step3_main().main(argv)
    assert len(result.history) == 4
    per_answer = 3 if algorithm == "remax" else 2
    for seen in (reward_fixtures.SECRETS["reward"], env_fixtures.SECRETS_READ):
        assert Counter(s for s in seen if s < 8) == Counter({s: per_answer for s in range(8)})
        assert {s for s in seen if s >= 8} == {8, 9}  # with --env the evaluation takes distinct rows
    assert set(reward_fixtures.SECRETS["judge"]) == {8, 9}
    assert "note: --shared_prompt_fields is no longer needed and is ignored" in capsys.readouterr().out


def test_rows_are_copies_and_columns_are_those_every_row_has():
    """rows_for_batch's rows are copies (an environment may edit its row), and for_batch passes only
    the columns every row of the batch has (two blended --data_path files with other columns)."""
    from dschat.data.prompt_columns import PromptRecord

    fields = {"prompt": "hi", "answer": "3"}
    cols = PromptColumns({(0, 0, 0): PromptRecord((5, 6), "hi", fields)})
    cols.rows_for_batch(torch.tensor([[5, 6]]), torch.ones(1, 2), ["hi"])[0]["answer"] = "changed"
    assert fields["answer"] == "3"
    # Deep copies: a list in the row (a hint game popping its hints) is the episode's own, and one
    # prompt's K rows (a GRPO group) do not share it; nor do a reward function's columns.
    hints = {"prompt": "hi", "hints": ["red", "round"]}
    cols = PromptColumns({(0, 0, 0): PromptRecord((5, 6), "hi", hints)})
    group = cols.rows_for_batch(torch.tensor([[5, 6]] * 2), torch.ones(2, 2), ["hi"] * 2,
                                torch.zeros(2, 3, dtype=torch.long))
    group[0]["hints"].pop(0)
    assert group[1]["hints"] == ["red", "round"] and hints["hints"] == ["red", "round"]
    cols.for_batch(torch.tensor([[5, 6]] * 2), torch.ones(2, 2), ["hi"] * 2)["hints"][0].clear()
    assert hints["hints"] == ["red", "round"]
    mixed = PromptColumns({(0, 0, 0): PromptRecord((5, 6), "hi", {"prompt": "hi", "answer": "3"}),
                           (1, 0, 0): PromptRecord((7, 8), "yo", {"prompt": "yo", "word": "cat"})})
    assert mixed.for_batch(torch.tensor([[5, 6], [7, 8]]), torch.ones(2, 2), ["hi", "yo"]) == {}
