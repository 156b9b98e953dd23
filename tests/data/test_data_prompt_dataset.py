"""Per-phase tokenisation (vs upstream's per-sample calls), blending, and the on-disk cache."""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from dschat.data import prompt_dataset as pd
from dschat.data import token_dataset
from dschat.data import tokenization
from dschat.data.prompt_dataset import create_prompt_dataset
from dschat.data.token_dataset import PairItem, PromptItem
from dschat.data.tokenization import create_dataset, create_dataset_split
from dschat.data.adapters.local import LocalPreferenceDataset
from dschat.data.split import get_shuffle_idx
from dschat.errors import UserError

from helpers.data import files_in, make_tokenizer, pref_rows, save_tokenizer, subprocess_env, write_json, write_jsonl

EOT = "<|endoftext|>"


def adapter_for(rows):
    from datasets import Dataset

    return LocalPreferenceDataset("/unused", 1234, -1, "mem", raw_datasets={"train": Dataset.from_list(rows)})


def mixed_rows():
    """Short and long rows, a row without a rejected answer, and one without a chosen answer."""
    rows = pref_rows(6)
    rows[2]["chosen"] = " the cat " + "is very happy and the dog is sad " * 12  # longer than max_seq_len
    rows[3]["rejected"] = None  # skipped in phase 2 only
    rows[4]["chosen"] = None  # skipped in phases 1 and 2
    rows[5]["prompt"] = " Human: " + "why is the sky blue " * 10 + "? Assistant:"  # long prompt
    return rows


# --- reference: upstream's create_dataset_split, one tokenizer call per sample -------------------


def upstream_items(rows, adapter, phase, tok, eot, max_seq_len):
    items, filtered = [], 0
    for s in rows:
        if phase == 1:
            text = adapter.get_prompt_and_chosen(s)
            if text is None:
                continue
            t = tok(text + eot, max_length=max_seq_len, padding="max_length", truncation=True, return_tensors="pt")
            ids, mask = t["input_ids"].squeeze(0), t["attention_mask"].squeeze(0)
            items.append({"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)})
        elif phase == 2:
            c, r = adapter.get_prompt_and_chosen(s), adapter.get_prompt_and_rejected(s)
            if c is None or r is None:
                continue
            kw = dict(max_length=max_seq_len, padding="max_length", truncation=True, return_tensors="pt")
            ct, rt = tok(c + eot, **kw), tok(r + eot, **kw)
            items.append((ct["input_ids"], ct["attention_mask"], rt["input_ids"], rt["attention_mask"]))
        else:
            p = adapter.get_prompt(s)
            if p is None:
                continue
            t = tok(p, return_tensors="pt")
            if t["input_ids"].size()[-1] <= max_seq_len:
                items.append((t["input_ids"].squeeze(0).flip(0), t["attention_mask"].squeeze(0).flip(0), tok.pad_token_id))
            else:
                filtered += 1
    return items, filtered


def assert_same(ours, ref):
    if isinstance(ref, dict):
        assert ours.keys() == ref.keys()
        for k in ref:
            assert ours[k].dtype == ref[k].dtype == torch.int64 and torch.equal(ours[k], ref[k]), k
    else:
        assert len(ours) == len(ref)
        for a, b in zip(ours, ref):
            if isinstance(b, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b)
            else:
                assert a == b


@pytest.mark.parametrize("phase", [1, 2, 3])
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_batched_tokenisation_matches_upstream_per_sample(phase, padding_side, capsys):
    tok = make_tokenizer()
    tok.padding_side = padding_side
    rows = mixed_rows()
    adapter = adapter_for(rows)
    ds = create_dataset_split(rows, adapter, phase, tok, EOT, 32)
    ref, filtered = upstream_items(rows, adapter, phase, tok, EOT, 32)
    assert len(ds) == len(ref) == {1: 5, 2: 4, 3: 5}[phase]
    for i in range(len(ds)):
        assert_same(ds[i], ref[i])
    assert ds.filtered == filtered == (1 if phase == 3 else 0)
    line = f"Creating dataset {adapter.dataset_name_clean} for train_phase={phase} size={len(ds)}"
    assert line + (f" filtered={filtered}" if phase == 3 else "") in capsys.readouterr().out


def test_item_types():
    tok = make_tokenizer()
    rows = pref_rows(3)
    adapter = adapter_for(rows)
    item = create_dataset_split(rows, adapter, 2, tok, EOT, 16)[0]
    assert isinstance(item, PairItem) and item.chosen_ids.shape == (1, 16) and item[0] is item.chosen_ids
    item = create_dataset_split(rows, adapter, 3, tok, EOT, 64)[0]
    assert isinstance(item, PromptItem) and item[2] == tok.pad_token_id


def test_phase1_labels_mask_padding_only_even_when_pad_is_eos():
    # pad == eos (upstream's OPT/LLaMA setting): the appended EOS must still be a label.
    tok = make_tokenizer(pad_is_eos=True)
    row = {"prompt": " Human: hi? Assistant:", "chosen": " the cat."}
    ds = create_dataset_split([row], adapter_for([row]), 1, tok, tok.eos_token, 24)
    ids = tok(row["prompt"] + row["chosen"] + tok.eos_token)["input_ids"]
    n, pad = len(ids), tok.pad_token_id
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id == pad
    item = ds[0]
    assert item["input_ids"].tolist() == ids + [pad] * (24 - n)
    assert item["attention_mask"].tolist() == [1] * n + [0] * (24 - n)
    assert item["labels"].tolist() == ids + [-100] * (24 - n)  # prompt tokens and EOS are trained on


def no_bos_tokenizer():
    """The test tokenizer without its BOS (as GPT-2's and Qwen2's add none)."""
    from tokenizers import processors

    tok = make_tokenizer()
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B", special_tokens=[])
    return tok


def test_phase2_drops_and_counts_pairs_without_a_shared_first_token(capsys):
    """Without a BOS, an empty prompt leaves pairs whose answers start differently with no shared
    token: they are left out and counted (the pairwise loss compares after a shared prefix); the
    pairs with a prompt stay, and the reward model's loss runs on every kept pair."""
    import transformers

    from dschat.data.collators import DataCollatorReward
    from dschat.models.reward_model import RewardModel

    tok = no_bos_tokenizer()
    unshared = [{"prompt": "", "chosen": f" Human: what? Assistant: the cat {i}", "rejected": f"Human: no {i}"}
                for i in range(3)]
    prompted = [{"prompt": " Human: q? Assistant:", "chosen": f" yes {i}", "rejected": f" no {i}"} for i in range(4)]
    rows = [unshared[0], *prompted[:2], *unshared[1:], *prompted[2:]]
    adapter = adapter_for(rows)
    ds = create_dataset_split(rows, adapter, 2, tok, EOT, 32)
    assert (len(ds), ds.filtered) == (4, 3)
    expected = [tok(r["prompt"] + r["chosen"] + EOT)["input_ids"] for r in prompted]
    assert [ds[i].chosen_ids[ds[i].chosen_mask.bool()].tolist() for i in range(4)] == expected
    out = capsys.readouterr().out
    assert f"train_phase=2 size=4 filtered=3" in out and "Warning: 3 of 7 pairs" in out

    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    batch = DataCollatorReward()([ds[i] for i in range(len(ds))])
    assert torch.isfinite(RewardModel(transformers.LlamaModel(config), tok)(**batch)["loss"])


def test_phase2_counts_pairs_whose_two_sides_are_the_same_tokens(capsys):
    """A duplicate answer, or two answers that differ only after --max_seq_len: kept (as upstream) and
    counted in one note, which says why the accuracy cannot reach 1."""
    tok = make_tokenizer()
    rows = [{"prompt": " Human: q? Assistant:", "chosen": " yes", "rejected": " yes"},  # a duplicate
            {"prompt": " Human: q? Assistant:", "chosen": " yes" + " cat" * 40 + " a",
             "rejected": " yes" + " cat" * 40 + " b"},  # cut equal at 32 tokens
            {"prompt": " Human: q? Assistant:", "chosen": " yes", "rejected": " no"}]
    ds = create_dataset_split(rows, adapter_for(rows), 2, tok, EOT, 32)
    same = [torch.equal(ds[i].chosen_ids, ds[i].rejected_ids) for i in range(3)]
    assert same == [True, True, False]
    out = capsys.readouterr().out
    assert "Note: 2 of 3 pairs of mem have the same tokens chosen and rejected (duplicates, or cut equal at " \
           "--max_seq_len 32)" in out
    create_dataset_split(rows[2:], adapter_for(rows[2:]), 2, tok, EOT, 32)
    assert "Note:" not in capsys.readouterr().out


def test_a_dataset_whose_every_train_pair_is_the_same_tokens_is_refused(tmp_path):
    """Nothing to learn from (the pairwise loss is a constant): one line, which names the likely cause."""
    rows = [{"prompt": f" Human: q{i}? Assistant:", "chosen": " yes" + " cat" * 40 + " a",
             "rejected": " yes" + " cat" * 40 + " b"} for i in range(20)]  # differ after 32 tokens only
    write_jsonl(tmp_path / "same.jsonl", rows)
    with pytest.raises(UserError, match=r"every one of its \d+ phase-2 train pairs has the same tokens chosen and "
                                        r"rejected \(duplicates, or cut equal at --max_seq_len 32\)"):
        create_dataset(-1, str(tmp_path / "same.jsonl"), "1,1,1", str(tmp_path / "c"), 2, 1, make_tokenizer(), EOT, 32)
    train, _ = create_dataset(-1, str(tmp_path / "same.jsonl"), "1,1,1", str(tmp_path / "c"), 2, 1, make_tokenizer(),
                              EOT, 64)  # long enough to tell them apart
    assert len(train) > 0


@pytest.mark.parametrize("reload", [False, True])
def test_a_build_refused_midway_removes_only_the_folders_it_made(tmp_path, reload):
    """The refusal comes once the lock is held (tokenisation): the folders the call created go again,
    with its lock file, unless something else was put there meanwhile; a folder the user had stays."""
    rows = [{"prompt": f" Human: q{i}? Assistant:", "chosen": " yes", "rejected": " yes"} for i in range(20)]
    write_jsonl(tmp_path / "same.jsonl", rows)

    def refused(out):
        with pytest.raises(UserError, match="every one of its"):
            create_prompt_dataset(-1, [str(tmp_path / "same.jsonl")], "1,1,1", str(out), 2, 1, make_tokenizer(), 32,
                                  EOT, reload=reload)

    refused(tmp_path / "new" / "deeper")
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()
    refused(tmp_path / "mine" / "c")
    assert (tmp_path / "mine").is_dir() and not (tmp_path / "mine" / "c").exists()
    real_building = pd.building

    @contextlib.contextmanager
    def another_run_meanwhile(files):
        with real_building(files):
            (files.lock.parent / ".lock_another").touch()
            yield

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pd, "building", another_run_meanwhile)
        refused(tmp_path / "shared" / "c")
    assert sorted(files_in(tmp_path / "shared" / "c")) == [".lock_another"]
    # A folder the user had: the lock file this call made goes too; a lock file that was there stays
    # (another run may wait on it).
    mine = tmp_path / "mine" / "had"
    mine.mkdir(mode=0o700)
    locks = []

    @contextlib.contextmanager
    def noting_the_lock(files):
        locks.append(files.lock)
        with real_building(files):
            yield

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pd, "building", noting_the_lock)
        refused(mine)
        assert files_in(mine) == []
        locks[0].touch(mode=0o600)
        refused(mine)
    assert files_in(mine) == [locks[0].name]


def test_phase2_one_token_pairs_are_dropped():
    """A pair of one token on each side has no position after its shared token."""
    tok = no_bos_tokenizer()
    rows = [{"prompt": "", "chosen": "", "rejected": ""}, *pref_rows(2)]
    ds = create_dataset_split(rows, adapter_for(rows), 2, tok, EOT, 32)
    assert (len(ds), ds.filtered) == (2, 1)


def test_phase2_split_of_unshared_pairs_only_is_one_line(tmp_path):
    rows = [{"prompt": "", "chosen": f" yes {i}", "rejected": f"no {i}"} for i in range(20)]
    path = write_jsonl(tmp_path / "unshared.jsonl", rows)
    with pytest.raises(UserError) as err:
        create_prompt_dataset(-1, [str(path)], "0,10,0", str(tmp_path / "cache"), 2, 1234, no_bos_tokenizer(), 32, EOT)
    message = str(err.value)
    assert "unshared.jsonl" in message and "differ at their first token" in message and "\n" not in message


def test_phase3_filtering_count():
    tok = make_tokenizer()
    rows = pref_rows(5)
    lengths = [len(tok(r["prompt"])["input_ids"]) for r in rows]
    limit = sorted(lengths)[2]  # keeps the prompts of length <= limit
    ds = create_dataset_split(rows, adapter_for(rows), 3, tok, EOT, limit)
    assert ds.filtered == sum(n > limit for n in lengths) and len(ds) == sum(n <= limit for n in lengths)
    kept = [r for r, n in zip(rows, lengths) if n <= limit]
    assert ds[0].input_ids_flipped.tolist() == tok(kept[0]["prompt"])["input_ids"][::-1]


def test_phase3_leaves_out_prompts_of_no_tokens(capsys, tmp_path):
    """An empty prompt with a tokenizer that adds no BOS is a row of padding only: left out and counted,
    with a warning; a split of nothing else is one line."""
    tok = no_bos_tokenizer()
    empty = {"prompt": "", "chosen": " a", "rejected": " b"}
    rows = [empty, *pref_rows(3), empty]
    ds = create_dataset_split(rows, adapter_for(rows), 3, tok, EOT, 64)
    assert (len(ds), ds.filtered) == (3, 2)
    assert all(len(ds[i].input_ids_flipped) > 0 for i in range(3))
    assert "Warning: 2 of 5 prompts of mem have no tokens (an empty text, and the tokenizer adds no BOS)" \
        in capsys.readouterr().out
    with_bos = create_dataset_split(rows, adapter_for(rows), 3, make_tokenizer(), EOT, 64)
    assert (len(with_bos), with_bos.filtered) == (5, 0)  # the BOS is a context
    path = write_jsonl(tmp_path / "empty.jsonl", [empty] * 20)
    with pytest.raises(UserError, match=r"all \d+ prompts are longer than max_seq_len=64 tokens or have none"):
        create_prompt_dataset(-1, [str(path)], "0,0,1", str(tmp_path / "c"), 3, 1234, tok, 64, EOT)


# --- create_prompt_dataset: blending, sft-only, empty phases -------------------------------------


def ids_of(ds):
    return [tuple(ds[i]["input_ids"].tolist()) for i in range(len(ds))]


def test_blending_two_paths_and_sft_only(tmp_path):
    tok = make_tokenizer()
    a = write_jsonl(tmp_path / "a.jsonl", pref_rows(20, tag="a"))
    b = write_jsonl(tmp_path / "b.jsonl", pref_rows(20, tag="b"))
    c = write_jsonl(tmp_path / "c.jsonl", pref_rows(10, tag="c", rejected=False))
    out = str(tmp_path / "cache")
    a_train, a_eval = create_dataset(-1, str(a), "10,0,0", out, 1, 1234, tok, EOT, 32)
    b_train, b_eval = create_dataset(-1, str(b), "10,0,0", out, 1, 1234, tok, EOT, 32)
    train, held_out = create_prompt_dataset(-1, [str(a), str(b)], "10,0,0", out, 1, 1234, tok, 32, EOT)
    # Concat then Subset(get_shuffle_idx(seed, total)), for train and eval alike.
    concat = ids_of(a_train) + ids_of(b_train)
    assert ids_of(train) == [concat[i] for i in get_shuffle_idx(1234, len(concat))]
    concat_eval = ids_of(a_eval) + ids_of(b_eval)
    assert ids_of(held_out) == [concat_eval[i] for i in get_shuffle_idx(1234, len(concat_eval))]
    assert len(train) == 36 and len(held_out) == 4  # 9:1 of 20 rows each

    # sft-only (phase 1): "10,0,0" chunk appended to the (unshuffled, single) dataset, then reshuffled.
    c_train, c_eval = create_dataset(-1, str(c), "10,0,0", out, 1, 1234, tok, EOT, 32)
    train, held_out = create_prompt_dataset(-1, [str(a)], "2,4,4", out, 1, 1234, tok, 32, EOT, sft_only_data_path=[str(c)])
    # a's eval split has 2 rows: "2,4,4" gives phase 1 round(0.4)=0 of them (a warning, not an
    # error, since c's eval row keeps the phase-1 eval set non-empty).
    a1_train, a1_eval = create_dataset(-1, str(a), "2,4,4", out, 1, 1234, tok, EOT, 32)
    assert len(a1_eval) == 0
    concat = ids_of(a1_train) + ids_of(c_train)
    assert ids_of(train) == [concat[i] for i in get_shuffle_idx(1234, len(concat))]
    concat_eval = ids_of(c_eval)
    assert ids_of(held_out) == [concat_eval[i] for i in get_shuffle_idx(1234, len(concat_eval))]
    # Phases 2-3 ignore --sft_only_data_path, as upstream.
    t2, _ = create_prompt_dataset(-1, [str(a)], "2,4,4", out, 2, 1234, tok, 32, EOT, sft_only_data_path=[str(c)])
    t2b, _ = create_prompt_dataset(-1, [str(a)], "2,4,4", out, 2, 1234, tok, 32, EOT)
    assert len(t2) == len(t2b) and t2.cache_key == t2b.cache_key


def test_phase3_keeps_held_out_prompts_and_seed_none(tmp_path, capsys):
    tok = make_tokenizer()
    path = write_jsonl(tmp_path / "p.jsonl", pref_rows(50))
    out = str(tmp_path / "cache")
    train, held_out = create_prompt_dataset(-1, [str(path)], "2,4,4", out, 3, None, tok, 64)
    assert len(train) > 0 and len(held_out) > 0 and isinstance(held_out[0], PromptItem)
    assert "using 1234" in capsys.readouterr().out
    train2, _ = create_prompt_dataset(-1, [str(path)], "2,4,4", out, 3, 1234, tok, 64)
    assert train2.cache_key == train.cache_key


def test_empty_phase_is_a_user_error_and_writes_nothing(tmp_path):
    tok = make_tokenizer()
    path = write_jsonl(tmp_path / "p.jsonl", pref_rows(20))
    out = tmp_path / "cache"
    with pytest.raises(UserError, match=r"p.jsonl', phase 2, train split is empty: --data_split 10,0,0 gives phase 2 0 of its 18 train rows"):
        create_prompt_dataset(-1, [str(path)], "10,0,0", str(out), 2, 1234, tok, 32)
    assert files_in(out) == []


@pytest.mark.parametrize("phase, split", [(1, "2,4,4"), (2, "4,2,4")])
def test_empty_eval_overall_is_an_error(tmp_path, phase, split):
    # 20 rows -> 9:1 -> 2 eval rows; the split gives the phase none of them, and no other dataset has any.
    path = write_jsonl(tmp_path / "p.jsonl", pref_rows(20))
    with pytest.raises(UserError, match=f"phase {phase} eval split is empty"):
        create_prompt_dataset(-1, [str(path)], split, str(tmp_path / "c"), phase, 1234, make_tokenizer(), 32)
    assert files_in(tmp_path / "c") == []


def test_a_blended_eval_set_is_shuffled_as_upstream(tmp_path):
    """Two datasets' eval rows are concatenated, then shuffled by the seed (as the train rows): a step-2
    evaluation capped by --eval_iters sees both, not the first dataset's rows only."""
    tok = make_tokenizer()
    paths = [write_jsonl(tmp_path / f"{t}.jsonl", pref_rows(100, tag=t)) for t in "ab"]
    out = str(tmp_path / "cache")
    evals = [create_dataset(-1, str(p), "10,0,0", out, 1, 1234, tok, EOT, 32)[1] for p in paths]
    _, held_out = create_prompt_dataset(-1, [str(p) for p in paths], "10,0,0", out, 1, 1234, tok, 32, EOT)
    concat = ids_of(evals[0]) + ids_of(evals[1])
    order = get_shuffle_idx(1234, len(concat))
    assert list(order) != list(range(len(concat)))
    assert ids_of(held_out) == [concat[i] for i in order]


def test_phase2_needs_rejected(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", pref_rows(20, rejected=False))
    with pytest.raises(UserError, match="no rejected responses.*use it in step 1 via --sft_only_data_path"):
        create_prompt_dataset(-1, [str(path)], "2,4,4", str(tmp_path / "c"), 2, 1234, make_tokenizer(), 32)
    assert files_in(tmp_path / "c") == []
    # Prompts only (the word game's, a step-3 set): step 1 would find no answers to train on either.
    with pytest.raises(UserError, match=r"no rejected responses.*\(it holds prompts only \(no chosen answers "
                                        r"either\), for step 3's --data_path\)$"):
        create_prompt_dataset(-1, ["dschat/wordgame"], "2,4,4", str(tmp_path / "c"), 2, 1234, make_tokenizer(), 32)


def test_phase3_all_prompts_too_long(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", pref_rows(20))
    # 18 train rows, "2,4,4": round(3.6)=4, round(7.2)=7, round(7.2)=7 -> phase 3 gets 7 prompts.
    with pytest.raises(UserError, match="all 7 prompts are longer than max_seq_len=4"):
        create_prompt_dataset(-1, [str(path)], "2,4,4", str(tmp_path / "c"), 3, 1234, make_tokenizer(), 4)


# --- the cache -----------------------------------------------------------------------------------


class BuildCounter:
    def __init__(self, monkeypatch):
        self.calls = 0
        real = pd._build_datasets

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(pd, "_build_datasets", counted)


def cache_names(folder):
    return [n for n in files_in(folder) if not n.startswith(".lock_")]


def test_cache_hit_loads_without_building(tmp_path, monkeypatch):
    tok = make_tokenizer()
    path = write_jsonl(tmp_path / "p.jsonl", pref_rows(30))
    out = tmp_path / "cache"
    first = create_prompt_dataset(-1, [str(path)], "2,4,4", str(out), 2, 1234, tok, 32)

    def fail(*args, **kwargs):
        raise AssertionError("cache miss: rebuilt")

    monkeypatch.setattr(pd, "_build_datasets", fail)
    second = create_prompt_dataset(-1, [str(path)], "2,4,4", str(out), 2, 1234, tok, 32)
    for a, b in zip(first, second):
        assert len(a) == len(b) and all(assert_same(a[i], b[i]) is None for i in range(len(a)))
    key = first[0].cache_key
    assert cache_names(out) == [f"evaldata_{key}.safetensors", f"meta_{key}.json", f"traindata_{key}.safetensors"]


def test_cache_files_are_safetensors_and_json_only(tmp_path):
    tok = make_tokenizer()
    path = write_jsonl(tmp_path / "p.jsonl", pref_rows(30))
    out = tmp_path / "cache"
    train, held_out = create_prompt_dataset(-1, [str(path)], "2,4,4", str(out), 1, 1234, tok, 32)
    key = train.cache_key
    meta = json.loads((out / f"meta_{key}.json").read_text())
    assert meta["key"] == key and meta["train"]["size"] == len(train) and meta["eval"]["size"] == len(held_out)
    assert meta["pad_token_id"] == tok.pad_token_id and meta["key_fields"]["end_of_conversation_token"] == EOT
    tensors = load_file(str(out / f"traindata_{key}.safetensors"))  # no unpickling anywhere
    assert set(tensors) == {"chosen.ids", "chosen.mask", "chosen.offsets"}
    assert tensors["chosen.offsets"].numel() == len(train) + 1
    rows = token_dataset.TokenRows.from_tensors(tensors, "chosen")
    assert rows.row(0)[0].tolist() == train[0]["input_ids"][train[0]["attention_mask"].bool()].tolist()


def test_cache_invalidation(tmp_path, monkeypatch):
    counter = BuildCounter(monkeypatch)
    tok = make_tokenizer()
    path = write_jsonl(tmp_path / "p.jsonl", pref_rows(30))
    out = str(tmp_path / "cache")

    def run(**kw):
        args = dict(eot=EOT, max_seq_len=32, tok=tok)
        args.update(kw)
        return create_prompt_dataset(-1, [str(path)], "2,4,4", out, 1, 1234, args["tok"], args["max_seq_len"], args["eot"])

    base = run()[0]
    assert counter.calls == 1
    run()
    assert counter.calls == 1  # hit
    # Tokenizer state set by calls (truncation/padding on the backend) must not change the key.
    tok(["a b", "c"], padding="max_length", max_length=9, truncation=True)
    assert run()[0].cache_key == base.cache_key and counter.calls == 1

    changed = {}
    changed["eot"] = run(eot="</s>")[0].cache_key
    changed["max_seq_len"] = run(max_seq_len=40)[0].cache_key
    changed["vocab"] = run(tok=make_tokenizer(vocab_size=380))[0].cache_key
    added = make_tokenizer()
    added.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    changed["added_token"] = run(tok=added)[0].cache_key
    assert counter.calls == 5 and base.cache_key not in changed.values() and len(set(changed.values())) == 4

    # Same size, different content: the key follows the bytes, not the name or mtime.
    rows = pref_rows(30)
    rows[0]["chosen"] = " the dog 0 is happy."
    write_jsonl(path, rows)
    new = run()[0]
    assert counter.calls == 6 and new.cache_key != base.cache_key


def test_the_cache_key_follows_seed_split_phase_sft_data_eot_and_padding_side(tmp_path):
    """Every input that changes the rows changes the key: a rerun with another --seed, --data_split,
    --sft_only_data_path, phase, a phase-2 --end_of_conversation_token or tokenizer sides must not
    read another run's cache."""
    from dschat.data.cache import cache_key, key_fields
    from dschat.data.dispatch import resolve_dataset

    tok = make_tokenizer()
    data = [resolve_dataset(str(write_jsonl(tmp_path / "p.jsonl", pref_rows(30))))]
    sft = [resolve_dataset(str(write_jsonl(tmp_path / "s.jsonl", pref_rows(30, tag="s"))))]

    def key(sft_sources=(), split=(2, 4, 4), phase=2, seed=1234, tokenizer=tok, eot=EOT):
        return cache_key(key_fields(data, list(sft_sources), split, phase, seed, tokenizer, 32, eot))

    left = make_tokenizer()
    left.padding_side = "left"
    keys = [key(), key(seed=1235), key(split=(3, 4, 3)), key(phase=1), key(phase=1, sft_sources=sft),
            key(eot="</s>"), key(tokenizer=left)]
    assert len(set(keys)) == len(keys)
    assert key(phase=3) == key(phase=3, eot="</s>")  # prompts only: the eot token is not in them


def test_cache_key_ignores_the_path_the_tokenizer_was_loaded_from(tmp_path, monkeypatch):
    """One tokenizer folder named three ways (relative, absolute, absolute with a trailing slash) is
    one cache: built once, hit twice."""
    from dschat.models.tokenizer import load_hf_tokenizer

    counter = BuildCounter(monkeypatch)
    folder = save_tokenizer(tmp_path / "tok")
    path = write_jsonl(tmp_path / "p.jsonl", pref_rows(30))
    monkeypatch.chdir(tmp_path)
    keys = set()
    for name in ("./tok", str(folder), f"{folder}/"):
        tok = load_hf_tokenizer(name)
        keys.add(create_prompt_dataset(-1, [str(path)], "2,4,4", str(tmp_path / "cache"), 2, 1234, tok, 32, EOT)[0].cache_key)
    assert len(keys) == 1 and counter.calls == 1


def test_reload_rebuilds_on_local_rank_zero_only(tmp_path, monkeypatch):
    counter = BuildCounter(monkeypatch)
    tok = make_tokenizer()
    path = write_jsonl(tmp_path / "p.jsonl", pref_rows(30))
    out = str(tmp_path / "cache")
    create_prompt_dataset(-1, [str(path)], "2,4,4", out, 3, 1234, tok, 64)
    create_prompt_dataset(0, [str(path)], "2,4,4", out, 3, 1234, tok, 64, reload=True)
    assert counter.calls == 2
    create_prompt_dataset(1, [str(path)], "2,4,4", out, 3, 1234, tok, 64, reload=True)
    assert counter.calls == 2  # other local ranks load what local rank 0 rebuilt


def test_error_mid_build_leaves_no_cache_files(tmp_path, monkeypatch):
    import safetensors.torch

    tok = make_tokenizer()
    path = write_jsonl(tmp_path / "p.jsonl", pref_rows(30))
    out = tmp_path / "cache"
    real_save = safetensors.torch.save_file
    calls = []

    def save_then_fail(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:  # train file written, eval file fails
            raise OSError("disk full")
        return real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", save_then_fail)
    with pytest.raises(OSError, match="disk full"):
        create_prompt_dataset(-1, [str(path)], "2,4,4", str(out), 1, 1234, tok, 32)
    assert cache_names(out) == []  # no data file, no temp file, no meta

    def tokenizer_crash(*args, **kwargs):
        raise RuntimeError("tokenizer crashed")

    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    monkeypatch.setattr(tokenization, "_tokenize", tokenizer_crash)
    with pytest.raises(RuntimeError, match="tokenizer crashed"):
        create_prompt_dataset(-1, [str(path)], "2,4,4", str(out), 2, 1234, tok, 32)
    assert cache_names(out) == []
    monkeypatch.undo()
    create_prompt_dataset(-1, [str(path)], "2,4,4", str(out), 1, 1234, tok, 32)  # recovers
    assert len(cache_names(out)) == 3


def test_failed_rebuild_keeps_the_previous_cache(tmp_path, monkeypatch):
    # A full disk while writing the eval file of a rebuild: the message says the previous files are
    # unchanged, and they are (upstream-style unlinking would have deleted all three).
    import errno
    import os

    import safetensors.torch

    tok = make_tokenizer()
    path = write_jsonl(tmp_path / "p.jsonl", pref_rows(30))
    out = tmp_path / "cache"
    first, _ = create_prompt_dataset(-1, [str(path)], "2,4,4", str(out), 1, 1234, tok, 32)
    before = {name: (out / name).read_bytes() for name in cache_names(out)}
    assert len(before) == 3
    real_save = safetensors.torch.save_file
    calls = []

    def eval_file_fails(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", eval_file_fails)
    with pytest.raises(UserError, match=r"the disk is full .*\(the previous files there, if any, are unchanged\)"):
        create_prompt_dataset(0, [str(path)], "2,4,4", str(out), 1, 1234, tok, 32, reload=True)
    assert files_in(out) == sorted([*before, f".lock_{first.cache_key}"])  # no temp file either
    assert {name: (out / name).read_bytes() for name in before} == before
    monkeypatch.undo()
    counter = BuildCounter(monkeypatch)
    again, _ = create_prompt_dataset(-1, [str(path)], "2,4,4", str(out), 1, 1234, tok, 32)
    assert counter.calls == 0 and ids_of(again) == ids_of(first)  # still a valid cache


def test_upstream_five_argument_prompt_dataset():
    # Upstream builds PromptDataset(prompt, chosen, reject, pad_token_id, train_phase); rows it
    # tokenised with padding="max_length" all have max_seq_len tokens, so items pad to that.
    tok = make_tokenizer()
    texts = [r["prompt"] + r["chosen"] + EOT for r in pref_rows(3)]
    enc = tok(texts, max_length=24, padding="max_length", truncation=True)
    rows = token_dataset.TokenRows.from_lists(enc["input_ids"], enc["attention_mask"])
    ds = token_dataset.PromptDataset(None, rows, rows, tok.pad_token_id, 2)
    assert ds.max_seq_len == 24 and len(ds) == 3
    assert ds[1].chosen_ids.tolist() == [enc["input_ids"][1]] and ds[1].rejected_mask.tolist() == [enc["attention_mask"][1]]
    # Unpadded rows: every item is padded to the longest, so a batch stacks.
    enc = tok(texts[:2] + [" Human: hi? Assistant: yes."])
    ds = token_dataset.PromptDataset(None, token_dataset.TokenRows.from_lists(enc["input_ids"], enc["attention_mask"]), None, tok.pad_token_id, 1)
    assert {ds[i]["input_ids"].numel() for i in range(3)} == {max(len(x) for x in enc["input_ids"])}
    with pytest.raises(TypeError, match="TokenRows.from_lists"):
        token_dataset.PromptDataset(None, [{"input_ids": torch.ones(1, 4)}], None, 0, 1)


def test_hub_dataset_cache_hit_does_not_load_the_hub(tmp_path, monkeypatch):
    # Keyed by name (as upstream): a node with the tokenised cache needs neither the network nor the
    # Hugging Face cache. The price: a new hub revision is served from the old cache until
    # --rebuild_data_cache (README "Data").
    from test_data_adapters import HH, fake_hub

    source, loaded = fake_hub(monkeypatch, tmp_path)
    write_jsonl(source / "train.jsonl", [{**HH, "chosen": f" Hello {i}!"} for i in range(30)])
    write_jsonl(source / "test.jsonl", [HH] * 10)
    counter = BuildCounter(monkeypatch)
    tok = make_tokenizer()
    out = str(tmp_path / "cache")
    first, _ = create_prompt_dataset(-1, ["Dahoas/rm-static"], "2,4,4", out, 1, 1234, tok, 32)
    write_jsonl(source / "train.jsonl", [{**HH, "chosen": f" Bye {i}!"} for i in range(30)])  # "new revision"
    again, _ = create_prompt_dataset(-1, ["Dahoas/rm-static"], "2,4,4", out, 1, 1234, tok, 32)
    assert counter.calls == 1 and again.cache_key == first.cache_key and loaded == ["Dahoas/rm-static"]
    rebuilt, _ = create_prompt_dataset(-1, ["Dahoas/rm-static"], "2,4,4", out, 1, 1234, tok, 32, reload=True)
    assert counter.calls == 2 and tok.decode(rebuilt[0]["input_ids"]).count("Bye") == 1


TWO_RANK_SCRIPT = textwrap.dedent(
    """
    import datetime, sys
    import torch.distributed as dist
    from transformers import AutoTokenizer
    from dschat.data.prompt_dataset import create_prompt_dataset
    from dschat.errors import UserError
    rank, port, tok_dir, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    tok = AutoTokenizer.from_pretrained(tok_dir)
    print("CALL1", flush=True)
    try:  # every prompt is longer than 3 tokens: only the building rank (local rank 0) can tell
        create_prompt_dataset(rank, ["dschat/builtin"], "2,4,4", out, 3, 1234, tok, 3, reload=True)
        print("RESULT returned", flush=True)
    except UserError as err:
        print("RESULT UserError:", err, flush=True)
    print("CALL2", flush=True)
    train, held_out = create_prompt_dataset(rank, ["dschat/builtin"], "2,4,4", out, 3, 1234, tok, 64, reload=True)
    print("RESULT2", len(train), len(held_out), flush=True)
    dist.barrier()
    from dschat.runtime.dist import destroy_gloo_group
    destroy_gloo_group()  # the steps' teardown: gc first (a bare destroy aborted now and then)
    """
)


@pytest.mark.slow
def test_reload_error_on_the_building_rank_reaches_every_rank(tmp_path):
    # Upstream-style barrier(): local rank 0 raised, rank 1 waited until gloo said "Connection closed
    # by peer" (NCCL: a hang). Now both raise the same UserError and the group stays usable.
    import socket

    tok_dir = save_tokenizer(tmp_path / "tok")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TWO_RANK_SCRIPT, str(rank), str(port), str(tok_dir), str(tmp_path / "cache")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    results = []
    for stdout, _ in outputs:
        call1 = stdout[stdout.index("CALL1"):stdout.index("CALL2")]
        results.append([line for line in call1.splitlines() if line.startswith("RESULT")])
        assert [line for line in stdout.splitlines() if line.startswith("RESULT2")]
    assert results[0] == results[1] and len(results[0]) == 1
    assert results[0][0].startswith("RESULT UserError:") and "longer than max_seq_len=3" in results[0][0]
    rank1_call1 = outputs[1][0][outputs[1][0].index("CALL1"):outputs[1][0].index("CALL2")]
    assert "Creating prompt dataset" not in rank1_call1  # rank 1 learnt it from rank 0, did not build
    assert outputs[0][0].count("RESULT2") == outputs[1][0].count("RESULT2") == 1


RACE_SCRIPT = textwrap.dedent(
    """
    import hashlib, os, sys, time
    from pathlib import Path
    from transformers import AutoTokenizer
    from dschat.data.prompt_dataset import create_prompt_dataset
    tok_dir, out, ready, go = sys.argv[1:5]
    tok = AutoTokenizer.from_pretrained(tok_dir)
    Path(ready).touch()
    while not os.path.exists(go):
        time.sleep(0.01)
    train, held_out = create_prompt_dataset(-1, ["dschat/builtin"], "2,4,4", out, 2, 1234, tok, 48)
    h = hashlib.sha256()
    for ds in (train, held_out):
        for k, v in sorted(ds.tensors().items()):
            h.update(k.encode() + v.numpy().tobytes())
    print("RESULT", len(train), len(held_out), h.hexdigest())
    """
)


@pytest.mark.slow
def test_two_processes_race_on_one_cache_dir(tmp_path):
    tok_dir = save_tokenizer(tmp_path / "tok")
    out = tmp_path / "cache"
    go = tmp_path / "go"
    procs = []
    for i in range(2):
        cmd = [sys.executable, "-c", RACE_SCRIPT, str(tok_dir), str(out), str(tmp_path / f"ready{i}"), str(go)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env()))
    import time

    deadline = time.time() + 120
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
        assert time.time() < deadline and all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.05)
    go.touch()  # both start at once
    outputs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    stdout = [o[0] for o in outputs]
    assert sum(s.count("Creating prompt dataset") for s in stdout) == 1  # exactly one build
    results = [next(line for line in s.splitlines() if line.startswith("RESULT")) for s in stdout]
    assert results[0] == results[1]  # both loaded identical data
    assert len(cache_names(out)) == 3


def test_local_jsonfile_and_parquet_through_the_cache(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq


    counter = BuildCounter(monkeypatch)
    tok = make_tokenizer()
    rows = [{"prompt": r["prompt"].strip(), "chosen": r["chosen"].strip(), "rejected": r["rejected"].strip()} for r in pref_rows(30)]
    write_json(tmp_path / "data" / "train.json", rows)
    write_json(tmp_path / "data" / "eval.json", rows[:10])
    monkeypatch.chdir(tmp_path)
    out = str(tmp_path / "cache")
    train, held_out = create_prompt_dataset(-1, ["local/jsonfile"], "2,4,4", out, 1, 1234, tok, 48)
    # local/jsonfile texts: " " + prompt + " " + chosen, then the eot token.
    expected = tok(" " + rows[get_shuffle_idx(1234, 30)[0]]["prompt"] + " " + rows[get_shuffle_idx(1234, 30)[0]]["chosen"] + EOT)["input_ids"]
    assert train[0]["input_ids"][: len(expected)].tolist() == expected
    assert (len(train), len(held_out)) == (6, 2)  # "2,4,4" of 30 and of 10 rows
    create_prompt_dataset(-1, ["local/jsonfile"], "2,4,4", out, 1, 1234, tok, 48)
    assert counter.calls == 1
    write_json(tmp_path / "data" / "eval.json", rows[:12])  # upstream's key ignored this edit
    _, held_out = create_prompt_dataset(-1, ["local/jsonfile"], "2,4,4", out, 1, 1234, tok, 48)
    assert counter.calls == 2 and len(held_out) == 2

    pq.write_table(pa.Table.from_pylist(pref_rows(40)), tmp_path / "p.parquet")
    train, held_out = create_prompt_dataset(-1, [str(tmp_path / "p.parquet")], "2,4,4", out, 2, 1234, tok, 48)
    assert isinstance(train[0], PairItem) and len(train) == 14 and len(held_out) == 2


def test_blending_and_shuffling_keep_the_filtered_counts():
    """The prompts each dataset left out (too long) add up over a blend and survive its shuffle: what
    the prepare tool and the cache's meta report."""
    rows = token_dataset.TokenRows.from_lists([[5, 6], [7]], [[1, 1], [1]])
    parts = [token_dataset.PromptDataset(rows, None, None, 0, 3, filtered=n) for n in (1, 2)]
    blended = token_dataset.PromptDataset.concat(parts)
    assert blended.filtered == 3 and blended.take([3, 0]).filtered == 3
