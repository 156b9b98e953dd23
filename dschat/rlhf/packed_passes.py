"""Step 3's forward passes over a rollout batch -- the scoring passes (reference, reward model,
critic, and the actor where generation kept no log-probs) and the PPO update's actor and critic
passes -- on packed rows or on the padded batch (``--sequence_packing``, :mod:`dschat.models.packing`).
:class:`ScoringPasses` holds what every pass of a run shares: which models pack, the sampling
temperature, and the ZeRO-3 gathers of :mod:`dschat.rlhf.zero3_gathers`; the experience maker and
the PPO update hold the same one.

Both layouts give the same per-token results in the padded ``(B, L)`` / ``(B, L - 1)`` layout that
:class:`~dschat.rlhf.experience.Experience` keeps, at every real token, including the log-prob of
the first pad after a finished answer (the KL term of upstream's ``reward_at="after_last"`` slot).
Padding columns hold 0 on the packed path (the padded pass computes values there that nothing
reads: every consumer masks them).
"""
from __future__ import annotations

import torch
from deepspeed import DeepSpeedEngine

from dschat.rl_math import logprobs as rl_math
from dschat.models.packing import (PackedRows, attention_span, pack_rows, packed_model_inputs,
                                   resolve_sequence_packing)
from dschat.models.reward_model import last_token_index
from dschat.rlhf.zero3_gathers import ScoringGather, TrainingGather
from dschat.runtime.zero3_trace import zero3_pass

__all__ = ["resolve_sequence_packing", "pack_batch", "shifted_log_probs", "token_log_probs", "token_values",
           "reward_end_scores", "ScoringPasses"]


def pack_batch(seq: torch.Tensor, attention_mask: torch.Tensor, enabled: bool,
               span: int | None = None) -> PackedRows | None:
    """The packed rows of a rollout batch (B, L), or None for the padded layout (not ``enabled``, or
    no packed layout cheaper for a model of :func:`~dschat.models.packing.attention_span` ``span``)."""
    return pack_rows(seq, attention_mask, span=span) if enabled else None


def shifted_log_probs(logits: torch.Tensor, seq: torch.Tensor, *, temperature: float = 1.0,
                      fp32: bool = False) -> torch.Tensor:
    """(B, L, V) logits of a padded batch -> (B, L - 1) log-probs of ``seq[:, 1:]`` at ``temperature``."""
    logits = logits[:, :-1]
    if temperature != 1.0:
        logits = logits / temperature
    return rl_math.gather_log_probs(logits, seq[:, 1:], fp32=fp32)


def token_log_probs(model: DeepSpeedEngine, seq: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                    packed: PackedRows | None, *, temperature: float = 1.0, fp32: bool = False) -> torch.Tensor:
    """(B, L - 1) log-probs of ``seq[:, 1:]`` under ``model``'s logits divided by ``temperature``
    (column ``t`` scores token ``t + 1``); packed when ``packed`` is given, with gradients."""
    if packed is None:
        logits = model(seq, attention_mask=attention_mask, position_ids=position_ids, use_cache=False).logits
        return shifted_log_probs(logits, seq, temperature=temperature, fp32=fp32)
    logits = model(**packed_model_inputs(packed, model)).logits  # (R, W, V)
    if temperature != 1.0:
        logits = logits / temperature
    # Each slot's target is the padded batch's next token (a pad after a finished answer); the last
    # column's wraps around, and is dropped below.
    targets = packed.gather(torch.roll(seq, -1, dims=1))
    return packed.unpack(rl_math.gather_log_probs(logits, targets, fp32=fp32))[:, :-1]


def token_values(model: DeepSpeedEngine, seq: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 packed: PackedRows | None) -> torch.Tensor:
    """(B, L) per-token values of a ``RewardModel`` (critic or reward model), with gradients."""
    with zero3_pass(model):  # forward_value is no call of the root module: one ZeRO-3 pass here
        if packed is None:
            return model.forward_value(seq, attention_mask, position_ids=position_ids, return_value_only=True,
                                       use_cache=False)
        values = model.forward_value(**packed_model_inputs(packed, model), return_value_only=True)
    return packed.unpack(values)


def reward_end_scores(model: DeepSpeedEngine, seq: torch.Tensor, attention_mask: torch.Tensor,
                      position_ids: torch.Tensor, packed: PackedRows | None, prompt_length: int) -> torch.Tensor:
    """(B,) the reward model's score of each answer: its value at the row's last real token."""
    if packed is None:
        with zero3_pass(model):
            out = model.forward_value(seq, attention_mask, position_ids=position_ids, prompt_length=prompt_length)
        return out["chosen_end_scores"]
    values = token_values(model, seq, attention_mask, position_ids, packed)
    return values.gather(1, last_token_index(attention_mask).unsqueeze(1)).squeeze(1)


class ScoringPasses:
    """The passes of one run over rollout batches, on the engines ``models`` (``actor``,
    ``reference``, ``critic``, ``reward``; None where a run has none).

    ``packing`` (``--sequence_packing`` resolved per model: name -> packs), ``temperature`` (the
    sampling temperature the log-probs are taken at), ``fp32`` (log-probs of half-precision logits in
    fp32), ``scoring_gather`` / ``training_gather`` (``--zero3_gather_for_scoring`` /
    ``--zero3_gather_for_training``). One packing of a batch serves every model's pass."""

    def __init__(self, models: dict[str, DeepSpeedEngine | None], *, packing: str, temperature: float, fp32: bool,
                 scoring_gather: str, training_gather: str) -> None:
        self.models = models
        self.packing = resolve_sequence_packing(packing, models)
        # The actor's shape weighs a packed layout's attention against the padding it saves (every
        # model scores the same packed rows).
        self.packing_span = attention_span(models["actor"])
        self.temperature = temperature
        self.fp32 = fp32
        # A ZeRO-3 model's scoring pass, and the actor's and critic's training passes, on its whole
        # parameters without hooks (decided once per model).
        self.scoring_gather = ScoringGather(scoring_gather)
        self.training_gather = TrainingGather(training_gather, {"actor": models["actor"], "critic": models["critic"]})

    @property
    def device(self) -> torch.device:
        """Where the actor's parameters are (a collective's tensors go there)."""
        return next(self.models["actor"].module.parameters()).device

    def packed(self, seq: torch.Tensor, attention_mask: torch.Tensor, *names: str) -> PackedRows | None:
        """The packed rows of a batch for the passes of the models ``names`` (default: every model's),
        or None where none of them packs."""
        enabled = any(self.packing.get(name, False) for name in names or tuple(self.packing))
        return pack_batch(seq, attention_mask, enabled, self.packing_span)

    def layout_for(self, name: str, packed: PackedRows | None) -> PackedRows | None:
        """``packed`` for the model ``name`` if it packs, else None (its pass runs padded)."""
        return packed if self.packing.get(name) else None

    def log_probs(self, logits: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
        """(B, L, V) logits -> (B, L - 1) log-probs of ``seq[:, 1:]`` under the sampling distribution."""
        return shifted_log_probs(logits, seq, temperature=self.temperature, fp32=self.fp32)

    def token_log_probs(self, name: str, model: DeepSpeedEngine, seq: torch.Tensor, attention_mask: torch.Tensor,
                        position_ids: torch.Tensor, packed: PackedRows | None) -> torch.Tensor:
        """(B, L - 1) log-probs of ``seq[:, 1:]`` under ``model`` at the sampling temperature, on the
        batch's packed rows where the model ``name`` packs."""
        return token_log_probs(model, seq, attention_mask, position_ids, self.layout_for(name, packed),
                               temperature=self.temperature, fp32=self.fp32)

    def token_values(self, seq: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                     packed: PackedRows | None) -> torch.Tensor:
        """(B, L) the critic's per-token values, on packed rows where the critic packs."""
        return token_values(self.models["critic"], seq, attention_mask, position_ids,
                            self.layout_for("critic", packed))

    def reward_scores(self, seq: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                      packed: PackedRows | None, prompt_length: int) -> torch.Tensor:
        """(B,) the reward model's end scores, gathered whole for the pass where the scoring gather says."""
        model = self.models["reward"]
        with self.scoring_gather("reward model", model):
            return reward_end_scores(model, seq, attention_mask, position_ids, self.layout_for("reward", packed),
                                     prompt_length)
