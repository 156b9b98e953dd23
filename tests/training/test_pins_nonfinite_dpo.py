"""Hand-checked pins on the non-finite guard's count and DPO's batch loss and accuracy (each caught
no one-line slip before: a run compared with another run of the same code cannot)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dschat.errors import UserError
from dschat.training.dpo import check_dpo_args, dpo_batch, evaluate_dpo
from dschat.training.nonfinite import NonFiniteGuard

NAN = torch.tensor(float("nan"))


class Engine:
    """What the guard asks of a DeepSpeed engine."""

    def __init__(self, applied: bool = True, fp16: bool = False) -> None:
        self.applied, self.fp16 = applied, fp16

    def is_gradient_accumulation_boundary(self) -> bool:
        return True

    def zero_optimization_stage(self) -> int:
        return 2

    def fp16_enabled(self) -> bool:
        return self.fp16

    def bfloat16_enabled(self) -> bool:
        return False

    def step(self) -> None:
        pass

    def was_step_applied(self) -> bool:
        return self.applied


def test_an_applied_step_ends_a_run_of_skips():
    guard = NonFiniteGuard(3, 0, "cpu")
    guard.loss_ok(NAN), guard.loss_ok(NAN)
    guard.step(Engine())
    guard.loss_ok(NAN), guard.loss_ok(NAN)
    assert guard.consecutive == 2  # never 3 in a row


def test_an_fp16_loss_scale_skip_is_not_counted():
    guard = NonFiniteGuard(1, 0, "cpu")
    guard.step(Engine(applied=False, fp16=True))
    assert guard.consecutive == 0


def test_a_step_ends_the_run_only_when_every_engine_applied_it():
    guard = NonFiniteGuard(5, 0, "cpu")
    guard.loss_ok(NAN)
    guard.applied(Engine(True), Engine(False))
    assert guard.consecutive == 1
    guard.applied(Engine(True), Engine(True))
    assert guard.consecutive == 0


def _fake(logits: torch.Tensor):
    return lambda **kwargs: SimpleNamespace(logits=logits)


# Pair 0 (rows 0 and 2) diverges at position 1, pair 1 (rows 1 and 3) at position 2.
BATCH = {"input_ids": torch.tensor([[1, 2, 3, 0], [1, 5, 6, 7], [1, 4, 0, 0], [1, 5, 8, 0]]),
         "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])}


def test_the_dpo_loss_is_the_mean_over_pairs_of_the_hand_formula():
    torch.manual_seed(0)
    policy, reference, beta = torch.randn(4, 4, 11), torch.randn(4, 4, 11), 0.5

    def logp(logits, row, tokens):  # the tokens from the first difference on: (position, token)
        return sum(torch.log_softmax(logits[row, pos - 1], -1)[tok] for pos, tok in tokens)

    def margin(chosen_row, chosen, rejected_row, rejected):
        return beta * ((logp(policy, chosen_row, chosen) - logp(reference, chosen_row, chosen))
                       - (logp(policy, rejected_row, rejected) - logp(reference, rejected_row, rejected)))

    z0 = margin(0, [(1, 2), (2, 3)], 2, [(1, 4)])
    z1 = margin(1, [(2, 6), (3, 7)], 3, [(2, 8)])
    expected = (-torch.nn.functional.logsigmoid(z0) - torch.nn.functional.logsigmoid(z1)) / 2
    got = dpo_batch(_fake(policy), _fake(reference), BATCH, beta=beta, label_smoothing=0.0).loss
    torch.testing.assert_close(got, expected)


def test_a_tie_is_not_a_correct_pair():
    """Before training the policy is the reference: every implicit reward is 0, accuracy 0 (upstream's >)."""
    logits = torch.randn(4, 4, 11)
    loader = torch.utils.data.DataLoader([BATCH], batch_size=None)
    result = evaluate_dpo(_Model(logits), _Model(logits), loader, torch.device("cpu"), beta=0.5, label_smoothing=0.0)
    assert result.accuracy == 0.0


class _Model:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def eval(self) -> None:
        pass

    def train(self, mode: bool = True) -> None:
        pass

    def __call__(self, **kwargs):
        return SimpleNamespace(logits=self.logits)


def test_label_smoothing_of_one_half_is_refused():
    with pytest.raises(UserError, match="--label_smoothing must be in \\[0, 0.5\\)"):
        check_dpo_args(0.1, 0.5)
