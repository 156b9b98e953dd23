"""Step 3's update and trainer facade on a real tiny trainer (tiny-opt, CPU, fp32):

* ``--align_overflow`` (fp16 only, so its optimizer overflow check is stood in for here): a
  non-finite actor or critic loss skips both models' backward and step, so neither carries a lone
  gradient into the next micro-step and their micro-step counts stay together; an aligned step both
  models applied ends a run of non-finite skips (``--max_nonfinite_steps`` counts skips in a row);
* upstream's ``_generate_sequence(prompts, mask, step)``: the generated sequences (prompt + answer).
"""
from __future__ import annotations

import pytest
import torch

from helpers.step3 import base_argv, step3_main

PROMPTS = torch.tensor([[1, 2, 40, 41], [2, 42, 43, 44]])
PROMPT_MASK = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])


def _trainer(critic_dirs, data_cache, *extra: str):
    from dschat.models.tokenizer import load_hf_tokenizer
    from dschat.rlhf.ppo_trainer import DeepSpeedPPOTrainer
    from dschat.rlhf.rlhf_engine import DeepSpeedRLHFEngine
    from dschat.runtime.dist import init_distributed

    init_distributed()
    args = step3_main().parse_args(base_argv("tiny-opt", critic_dirs["tiny-opt"], data_cache, *extra))
    tokenizer = load_hf_tokenizer("tiny-opt")
    torch.manual_seed(0)
    engine = DeepSpeedRLHFEngine("tiny-opt", str(critic_dirs["tiny-opt"]), tokenizer, args, 10)
    return DeepSpeedPPOTrainer(engine, args), tokenizer


def _aligned_trainer(monkeypatch, critic_dirs, data_cache):
    """A trainer whose update aligns the two models' steps as under fp16 ``--align_overflow``: the
    fp16 optimizers' external overflow check reports no overflow."""
    trainer, tokenizer = _trainer(critic_dirs, data_cache, "--max_nonfinite_steps", "2")
    update = trainer.update
    monkeypatch.setattr(update, "align_overflow", True)
    for engine in (update.actor_model, update.critic_model):
        monkeypatch.setattr(engine.optimizer, "check_overflow", lambda external=False: False, raising=False)
    seq = torch.cat([PROMPTS, torch.tensor([[50, 51, tokenizer.eos_token_id], [55, 56, 57]])], dim=1)
    from dschat.rlhf.rollout.sampling import Rollout

    monkeypatch.setattr(trainer.generator, "rollout", lambda prompts, mask: Rollout(seq.clone(), None))
    exp = trainer.generate_experience(PROMPTS, PROMPT_MASK, step=0)
    trainer.prepare_rollout([exp])
    return trainer, exp


def _has_gradient(engine) -> bool:
    return any(p.grad is not None and bool(p.grad.any()) for p in engine.module.parameters())


@pytest.mark.parametrize("nonfinite", ["critic", "actor"])
def test_align_overflow_skips_both_models_when_one_loss_is_not_finite(nonfinite, monkeypatch, critic_dirs,
                                                                      data_cache):
    trainer, exp = _aligned_trainer(monkeypatch, critic_dirs, data_cache)
    update = trainer.update
    actor, critic = update.actor_model, update.critic_model
    name = "critic_loss_fn" if nonfinite == "critic" else "policy_loss"
    loss_fn = getattr(trainer, name)
    monkeypatch.setattr(trainer, name, lambda *a, **k: loss_fn(*a, **k) * float("nan"))
    update.train_rlhf(exp)
    # Neither model ran its backward: no lone gradient waits for the next micro-step.
    assert not _has_gradient(actor) and not _has_gradient(critic)
    assert (actor.micro_steps, critic.micro_steps) == (0, 0)
    assert trainer.nonfinite.consecutive == 1 and trainer.nonfinite.skipped == 1
    monkeypatch.setattr(trainer, name, loss_fn)
    update.train_rlhf(exp)
    assert (actor.micro_steps, critic.micro_steps) == (1, 1)
    assert trainer.nonfinite.consecutive == 0  # an aligned step both applied ends the run of skips


def test_align_overflow_stops_only_after_skips_in_a_row(monkeypatch, critic_dirs, data_cache):
    # --max_nonfinite_steps 2: skip, good step, skip is not two in a row.
    trainer, exp = _aligned_trainer(monkeypatch, critic_dirs, data_cache)
    loss_fn = trainer.critic_loss_fn
    for bad in (True, False, True):
        monkeypatch.setattr(trainer, "critic_loss_fn",
                            (lambda *a, **k: loss_fn(*a, **k) * float("nan")) if bad else loss_fn)
        trainer.update.train_rlhf(exp)
    assert trainer.nonfinite.consecutive == 1 and trainer.nonfinite.skipped == 2


def test_generate_sequence_returns_prompt_and_answer_as_upstream(monkeypatch, critic_dirs, data_cache, capsys):
    from dschat.rlhf.rollout.sampling import Rollout

    trainer, tokenizer = _trainer(critic_dirs, data_cache)
    trainer.train()
    seq = trainer._generate_sequence(PROMPTS, PROMPT_MASK, 0)  # the actor's own answers
    assert not trainer.actor_model.module.training  # generated in evaluation mode, as upstream
    assert seq.shape[0] <= 2 and PROMPTS.shape[1] < seq.shape[1] <= PROMPTS.shape[1] + 16
    assert all(any(torch.equal(row[:PROMPTS.shape[1]], prompt) for prompt in PROMPTS) for row in seq)
    # Upstream drops the rows whose answer is one token (here: EOS at once); none left: None.
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    answers = torch.tensor([[50, 51, eos], [eos, pad, pad]])
    fixed = torch.cat([PROMPTS, answers], dim=1)
    monkeypatch.setattr(trainer.generator, "rollout", lambda prompts, mask: Rollout(fixed.clone(), None))
    assert torch.equal(trainer._generate_sequence(PROMPTS, PROMPT_MASK, 1), fixed[:1])
    assert "Dropping too short generated answer: step=1" in capsys.readouterr().out
    fixed[0, PROMPTS.shape[1]:] = answers[1]
    assert trainer._generate_sequence(PROMPTS, PROMPT_MASK, 2) is None
