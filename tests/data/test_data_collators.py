"""Collators, the left-padding flip trick and RolloutBuffer (upstream's MiniDataset), against tensors written out by hand."""
from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler
from torch.utils.data.distributed import DistributedSampler

from dschat.data.collators import DataCollatorReward, DataCollatorRLHF, set_epoch_if_distributed
from dschat.rlhf.experience import RolloutBuffer
from dschat.utils.data.data_utils import MiniDataset
from dschat.data.token_dataset import PairItem, PromptDataset, PromptItem, TokenRows

from helpers.data import make_tokenizer

T = torch.tensor


def test_reward_collator_stacks_chosen_then_rejected():
    batch = [
        PairItem(T([[1, 2, 3]]), T([[1, 1, 1]]), T([[1, 4, 0]]), T([[1, 1, 0]])),
        (T([[1, 5, 0]]), T([[1, 1, 0]]), T([[1, 6, 6]]), T([[1, 1, 1]])),  # a plain tuple works too
    ]
    out = DataCollatorReward()(batch)
    assert set(out) == {"input_ids", "attention_mask"}
    assert out["input_ids"].tolist() == [[1, 2, 3], [1, 5, 0], [1, 4, 0], [1, 6, 6]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 1]]


def test_rlhf_collator_left_pads_to_exactly_max_token_len():
    # Prompts [11, 12, 13] and [21, 22], stored reversed. pad_sequence (right) gives
    # [[13,12,11],[22,21,0]]; F.pad to 5 gives [[13,12,11,0,0],[22,21,0,0,0]]; flipping back:
    batch = [PromptItem(T([13, 12, 11]), T([1, 1, 1]), 0), PromptItem(T([22, 21]), T([1, 1]), 0)]
    out = DataCollatorRLHF(max_token_len=5, inference_tp_size=1)(batch)
    assert out["prompt"].tolist() == [[0, 0, 11, 12, 13], [0, 0, 0, 21, 22]]
    assert out["prompt_att_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]
    # pad id comes from the last item (upstream: data[-1][-1]).
    out = DataCollatorRLHF(4, 1)([PromptItem(T([5]), T([1]), 9)])
    assert out["prompt"].tolist() == [[9, 9, 9, 5]]
    # Already max_token_len wide: no extra padding.
    out = DataCollatorRLHF(2, 1)([PromptItem(T([2, 1]), T([1, 1]), 0)])
    assert out["prompt"].tolist() == [[1, 2]]


def test_phase3_items_through_collator_match_tokenizer_left_padding():
    tok = make_tokenizer()
    prompts = [" Human: the cat? Assistant:", " Human: why is the sky blue and the sun red? Assistant:"]
    enc = tok(prompts)
    rows = TokenRows.from_lists(enc["input_ids"], enc["attention_mask"])
    ds = PromptDataset(rows, None, None, tok.pad_token_id, 3, max_seq_len=32)
    width = 24
    out = DataCollatorRLHF(width, 1)([ds[0], ds[1]])
    ref = tok(prompts, padding="max_length", max_length=width, padding_side="left", return_tensors="pt")
    assert torch.equal(out["prompt"], ref["input_ids"])
    assert torch.equal(out["prompt_att_mask"], ref["attention_mask"])


class Exp(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


def test_mini_dataset_splits_every_kind_of_batch():
    assert MiniDataset is RolloutBuffer  # upstream's name still works
    mini = RolloutBuffer(max_size=2, small_batch_size=2)
    first = {"x": T([0, 1, 2]), "y": T([[0], [1], [2]])}
    assert mini.add(first) is None
    out = mini.add({"x": T([3, 4]), "y": T([[3], [4]])})
    # 3 rows -> [0:2], [2:3]; then 2 rows -> [0:2]; in order.
    assert [o["x"].tolist() for o in out] == [[0, 1], [2], [3, 4]]
    assert [o["y"].tolist() for o in out] == [[[0], [1]], [[2]], [[3], [4]]]
    assert mini.dataset == []  # freed

    mini = RolloutBuffer(1, 2)
    out = mini.add([T([1, 2, 3]), T([4, 5, 6])])  # list -> per-element slices
    assert [[t.tolist() for t in o] for o in out] == [[[1, 2], [4, 5]], [[3], [6]]]
    out = mini.add((T([1, 2, 3]),))  # tuple -> list, as upstream
    assert isinstance(out[0], list)
    out = mini.add(Exp(T([1, 2, 3]), T([4, 5, 6])))  # NamedTuple keeps its type and slices rows
    assert isinstance(out[0], Exp) and out[0].a.tolist() == [1, 2] and out[1].b.tolist() == [6]
    out = mini.add(T([[1], [2], [3]]))  # tensor
    assert [o.tolist() for o in out] == [[[1], [2]], [[3]]]
    out = RolloutBuffer(1, 2).add([[None] * 4])  # step 3 without ptx adds [[None] * batch]
    assert out == [[[None, None]], [[None, None]]]


def test_mini_dataset_spelling_and_overflow():
    assert MiniDataset.seperate is MiniDataset.separate
    with pytest.raises(ValueError, match="full"):
        MiniDataset(0, 1).add([T([1])])


def test_set_epoch_if_distributed_changes_the_order():
    data = list(range(16))
    sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=0)
    loader = DataLoader(data, sampler=sampler, batch_size=4)
    epoch0 = [x for b in loader for x in b.tolist()]
    assert set_epoch_if_distributed(loader, 1) is True and sampler.epoch == 1
    epoch1 = [x for b in loader for x in b.tolist()]
    assert epoch0 != epoch1  # upstream never called set_epoch: every epoch repeated epoch 0
    assert set_epoch_if_distributed(sampler, 2) and sampler.epoch == 2
    assert set_epoch_if_distributed(DataLoader(data, sampler=RandomSampler(data)), 1) is False
