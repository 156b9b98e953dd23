"""Deliberately hackable proxy rewards, for showing what over-optimization looks like.

Train against one of these (``--reward_fn dschat.eval.proxies:answer_length``) with an independent
judge watching (``--eval_judge gold`` on the embedded data) and the held-out evaluation of step 3
(:mod:`dschat.rlhf.heldout.evaluation`) sees the proxy climb while the judge falls: docs/evaluation.md's
"Did step 3 work?" demo. Never use them to train a model you want.
"""
from __future__ import annotations

__all__ = ["answer_length"]


def answer_length(prompts: list[str], answers: list[str]) -> list[float]:
    """Words in the answer / 10: pays for length and nothing else (the gold judge penalises answers
    above 45 words, repeated 4-grams and answers cut off without a final '.', '!' or '?')."""
    return [len(a.split()) / 10.0 for a in answers]
