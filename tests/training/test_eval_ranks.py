"""Held-out evaluation over ranks counts every row once: ``DistributedSampler`` repeats rows to give
every rank as many batches when the world size does not divide the split; those repeats are run (the
forwards are collective) but left out of step 2's pair counts, accuracy and scores and step 1's loss."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dschat.data.collators import DataCollatorReward
from dschat.training.eval_loops import evaluate_perplexity, evaluate_reward
from dschat.training.loaders import EvalShardSampler, eval_batches, make_eval_loader

ROWS = 5
WIDTH = 3


class CountingModel:
    """A model's train/eval switches (which do nothing) and a count of its forward passes."""

    forwards = 0

    def eval(self) -> None:
        pass

    def train(self) -> None:
        pass


class FakeEngine(CountingModel):
    """Stands in for a DeepSpeed engine: step 2's outputs (scores read from the first token, loss the
    pairs' mean of ``rejected - chosen``) or step 1's (loss: the rows' mean first token)."""

    def __init__(self, reward: bool) -> None:
        self.reward = reward

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs) -> object:
        self.forwards += 1
        first = input_ids[:, 0].double()
        if not self.reward:
            return SimpleNamespace(loss=first.mean())
        chosen, rejected = first.chunk(2)
        return {"chosen_mean_scores": chosen, "rejected_mean_scores": rejected, "loss": (rejected - chosen).mean()}


def pair_rows() -> list[tuple[torch.Tensor, ...]]:
    """Pair i scores chosen 10 + i against rejected 12 (right only for i = 3, 4)."""
    ones = torch.ones(1, WIDTH, dtype=torch.long)
    return [(ones * (10 + i), ones, ones * 12, ones) for i in range(ROWS)]


def lm_rows() -> list[dict[str, torch.Tensor]]:
    ones = torch.ones(WIDTH, dtype=torch.long)
    return [{"input_ids": ones * (i + 1), "attention_mask": ones} for i in range(ROWS)]


def stack(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([item[k] for item in items]) for k in items[0]}


def shard_loader(rows: list, rank: int, batch_size: int, collate) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(rows, batch_size=batch_size, collate_fn=collate,
                                       sampler=EvalShardSampler(rows, num_replicas=2, rank=rank))


@pytest.mark.parametrize("batch_size", [1, 2, 4])
def test_each_held_out_row_is_marked_real_on_one_rank_only(batch_size):
    """Rank 1's shard of 5 rows ends with a repeat of row 0: it is marked, in a batch of its own
    (batch size 2) or after real rows (batch size 4)."""
    real_rows = []
    for rank in (0, 1):
        loader = shard_loader(lm_rows(), rank, batch_size, stack)
        for batch, real in eval_batches(loader):
            real_rows += batch["input_ids"][:real, 0].tolist()
    assert sorted(real_rows) == [i + 1 for i in range(ROWS)]


@pytest.mark.parametrize("batch_size", [2, 4])
def test_two_ranks_count_what_one_process_counts(batch_size):
    """Both ranks run as many forwards; their sums are one process's: 5 pairs, 2 right, not 6."""
    one = evaluate_reward(FakeEngine(True), make_eval_loader(pair_rows(), batch_size, DataCollatorReward()),
                          torch.device("cpu"), None)
    assert (one.pairs, one.accuracy, one.chosen) == (ROWS, 2 / ROWS, 12.0)
    engines = [FakeEngine(True), FakeEngine(True)]
    per_rank = [evaluate_reward(engines[rank], shard_loader(pair_rows(), rank, batch_size, DataCollatorReward()),
                                torch.device("cpu"), None) for rank in (0, 1)]
    assert engines[0].forwards == engines[1].forwards
    pairs = sum(r.pairs for r in per_rank)
    assert pairs == ROWS
    for field in ("accuracy", "chosen", "rejected", "loss"):
        assert sum(getattr(r, field) * r.pairs for r in per_rank) / pairs == pytest.approx(getattr(one, field)), field


def test_perplexity_is_the_mean_of_the_real_batches_losses():
    """Upstream's formula: the mean of the batches' losses; rank 1's batch of a repeat only is run
    but not one of them (batch size 2: rank 0 reads rows {1, 3}, {5}; rank 1 {2, 4} and a repeat of 1)."""
    engines = [FakeEngine(False), FakeEngine(False)]
    sums = []
    for rank in (0, 1):
        _, loss = evaluate_perplexity(engines[rank], shard_loader(lm_rows(), rank, 2, stack), torch.device("cpu"))
        sums.append(loss)
    assert engines[0].forwards == engines[1].forwards == 2
    assert sums == [pytest.approx((2 + 5) / 2), pytest.approx(3.0)]  # rank 0: (1+3)/2 and 5; rank 1: (2+4)/2


class FakeLM(CountingModel):
    """A causal LM whose next-token logits favour token ``input_id + 1`` by ``scale x input_id`` (so
    pair 0's chosen answer is the likely one); the reference is the same model scaled down."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs) -> object:
        self.forwards += 1
        logits = torch.zeros(*input_ids.shape, 32, dtype=torch.float64)
        logits.scatter_(2, ((input_ids + 1) % 32).unsqueeze(-1), self.scale * input_ids.double().unsqueeze(-1))
        return SimpleNamespace(logits=logits)


def dpo_pair_rows() -> list[tuple[torch.Tensor, ...]]:
    """Pair i: chosen [1, 2, 3 + i], rejected [1, 2, 9]: they diverge at the last token."""
    ones = torch.ones(1, WIDTH, dtype=torch.long)
    return [(torch.tensor([[1, 2, 3 + i]]), ones, torch.tensor([[1, 2, 9]]), ones) for i in range(ROWS)]


def test_dpo_evaluation_counts_each_pair_once_over_two_ranks():
    from dschat.training.dpo import evaluate_dpo

    def run(loader: torch.utils.data.DataLoader) -> object:
        return evaluate_dpo(FakeLM(1.0), FakeLM(0.5), loader, torch.device("cpu"), beta=0.1, label_smoothing=0.0)

    one = run(make_eval_loader(dpo_pair_rows(), 2, DataCollatorReward()))
    assert one.pairs == ROWS
    per_rank = [run(shard_loader(dpo_pair_rows(), rank, 2, DataCollatorReward())) for rank in (0, 1)]
    assert sum(r.pairs for r in per_rank) == ROWS  # not 6: rank 1's repeat of pair 0 is left out
    for field in ("chosen", "rejected", "loss", "accuracy"):
        assert sum(getattr(r, field) * r.pairs for r in per_rank) / ROWS == pytest.approx(getattr(one, field)), field


GLOO_RANKS = r'''
import json, sys
import torch
import torch.distributed as dist

rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
import importlib.util
spec = importlib.util.spec_from_file_location("eval_ranks", "tests/training/test_eval_ranks.py")
test_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(test_module)
FakeEngine, pair_rows = test_module.FakeEngine, test_module.pair_rows
from dschat.data.collators import DataCollatorReward
from dschat.training.eval_loops import evaluate_reward
from dschat.training.loaders import make_eval_loader

scores = evaluate_reward(FakeEngine(True), make_eval_loader(pair_rows(), 2, DataCollatorReward()), torch.device("cpu"), 0)
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump([scores.pairs, scores.accuracy, scores.chosen, scores.loss], f)
dist.barrier()
from dschat.runtime.dist import destroy_gloo_group
destroy_gloo_group()  # the steps' teardown: gc first (a bare destroy aborted now and then)
'''


@pytest.mark.slow
def test_two_gloo_ranks_report_the_split_once(tmp_path):
    """The step's own loader on two ranks: every rank reports the 5 pairs once."""
    from helpers.two_ranks import run_gloo_ranks

    one = evaluate_reward(FakeEngine(True), make_eval_loader(pair_rows(), 2, DataCollatorReward()),
                          torch.device("cpu"), 0)
    expected = [one.pairs, one.accuracy, one.chosen, one.loss]
    assert run_gloo_ranks(GLOO_RANKS, tmp_path) == [pytest.approx(expected), pytest.approx(expected)]
