"""Step 3's forward passes over a rollout batch -- the scoring passes (reference, reward model,
critic, and the actor where generation kept no log-probs) and the PPO update's actor and critic
passes: :class:`ScoringPasses`, the one object the experience maker and the PPO update both run
their passes through. It holds what every pass of a run shares: which models pack, the sampling
temperature, and the ZeRO-3 gathers.

**Packing** (``--sequence_packing``, :mod:`dschat.models.packing`). A pass runs on packed rows or on
the padded batch; both layouts give the same per-token results in the padded ``(B, L)`` /
``(B, L - 1)`` layout that :class:`~dschat.rlhf.experience.Experience` keeps, at every real token,
including the log-prob of the first pad after a finished answer (the KL term of upstream's
``reward_at="after_last"`` slot). Padding columns hold 0 on the packed path (the padded pass computes
values there that nothing reads: every consumer masks them).

**ZeRO-3 passes on whole models**: the scoring passes (``--zero3_gather_for_scoring``) and the
training passes (``--zero3_gather_for_training``). Under ZeRO-3 each module's parameters are fetched
as the module runs and released after it, by hooks on every module, in the forward and again in the
backward. On one GPU the fetch moves nothing (each partition is the whole parameter), but the hooks'
bookkeeping stays, and a GPU waits for its host: with 24-layer models of little compute per layer
the hooks' bookkeeping is a large share of ZeRO-3's scoring and training time
(``benchmarks/results.md``). A :class:`WholeModelGather` runs a
model's pass inside :func:`~dschat.runtime.zero3.gathered_without_hooks`, as the rollout runs the
actor: all its parameters gathered at once, the module hooks set aside (the same ones put back, so
its prefetch trace and module ids survive), then released. Decided once per model and the same on
every rank; ``on`` gathers every ZeRO-3 model, ``off`` none, and ``auto`` never a model whose
parameters ZeRO-3 offloads (``--offload``, ``--offload_reference_model`` and the like: the user keeps
them off the accelerator).

* :class:`ScoringGather`: the reference's, the reward model's and the critic's scoring passes over a
  rollout (and the actor's where generation kept no log-probs). ``auto`` gathers a model that fits in
  half of the free memory (:func:`~dschat.runtime.zero3.fits_gathered`). The numbers are the same:
  the same weights enter the same forward.
* :class:`TrainingGather`: the actor's and the critic's forward and backward of a micro-step, released
  before the optimizer step. Gradients still reach ZeRO-3 through its per-parameter hooks, which
  reduce and partition them as in a hooked pass. ``auto`` gathers where it costs no memory: one
  data-parallel rank (:func:`~dschat.runtime.zero3.whole_partitions`: a gathered parameter is a view
  of its partition) and no partition stored quantized; ``on`` also across ranks, each then holding
  the whole model through the backward. The forward is the same, to the bit; ZeRO-3's hooks wrap each
  module's inputs and outputs in identity autograd nodes, which groups some sums of gradient
  contributions differently, so gradients agree with the hooked passes' to fp32 rounding, not to the
  bit (``tests/rlhf/test_training_gather.py``).

A pass that bypasses the root module's call (``forward_value``) is bracketed for ZeRO-3's prefetch
trace by :func:`~dschat.runtime.zero3.zero3_pass`.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from deepspeed import DeepSpeedEngine

from dschat.rl_math.logprobs import gather_log_probs
from dschat.models.packing import (PackedRows, attention_span, pack_rows, packed_model_inputs,
                                   resolve_sequence_packing)
from dschat.models.reward_inputs import CrossTokenizerInputs
from dschat.models.reward_model import last_token_index, positions_from_mask
from dschat.runtime.dist import print_rank_0
from dschat.runtime.zero3 import (
    fits_gathered,
    gathered_without_hooks,
    mark_trained_whole,
    params_offloaded,
    quantized_partitions,
    whole_partitions,
    zero3_offload,
    zero3_pass,
)

__all__ = ["resolve_sequence_packing", "pack_batch", "shifted_log_probs", "token_log_probs", "token_values",
           "reward_end_scores", "WholeModelGather", "ScoringGather", "TrainingGather", "ScoringPasses"]


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
    return gather_log_probs(logits, seq[:, 1:], fp32=fp32)


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
    return packed.unpack(gather_log_probs(logits, targets, fp32=fp32))[:, :-1]


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


# ---------------------------------------------------------------------- ZeRO-3 passes on whole models
class WholeModelGather:
    """``gather(name, engine)``: the context a pass of ``engine`` (the model ``name``) runs in, gathered
    whole or through ZeRO-3's hooks by ``setting`` (``auto``, ``on``, ``off``) of the flag :attr:`flag`.
    A subclass says what ``auto`` decides for a model it may gather (:meth:`auto_gathers`). Collective
    where it gathers: every rank must run the same passes."""

    flag = ""  # the flag, without its dashes
    passes = ""  # the passes it gathers for, as the log line names them
    gathered = ""  # the log line's words for a model gathered

    def __init__(self, setting: str = "auto") -> None:
        if setting not in ("auto", "on", "off"):
            raise ValueError(f"--{self.flag} must be auto, on or off, got {setting!r}")
        self.setting = setting
        self.decided: dict[str, bool] = {}

    def auto_gathers(self, engine: DeepSpeedEngine) -> tuple[bool, str]:
        """``auto``'s decision for a ZeRO-3 ``engine`` whose parameters are not offloaded, and the reason
        given when it does not gather."""
        raise NotImplementedError

    def decide(self, name: str, engine: DeepSpeedEngine) -> bool:
        """Whether the passes of ``engine`` (the model ``name``) run gathered; said once per model
        (nothing is said for ``off``: the user chose the hooks)."""
        if self.setting == "off":
            return False
        if self.setting == "on":
            gather, why_not = True, ""
        elif params_offloaded(engine):
            gather, why_not = False, f"its parameters are offloaded; --{self.flag} on gathers them"
        else:
            gather, why_not = self.auto_gathers(engine)
        print_rank_0(f"ZeRO-3 {self.passes}: the {name}'s parameters "
                     + (self.gathered if gather else f"fetched module by module ({why_not})"))
        return gather

    def __call__(self, name: str, engine: DeepSpeedEngine | None) -> AbstractContextManager[None]:
        if engine is None or zero3_offload(engine) is None:
            return nullcontext()
        if name not in self.decided:
            self.decided[name] = self.decide(name, engine)
        return gathered_without_hooks(engine) if self.decided[name] else nullcontext()


class ScoringGather(WholeModelGather):
    """A model's scoring pass over a rollout (``--zero3_gather_for_scoring``); ``auto``: where the
    whole model fits in half of the free memory (one all-reduce: the same answer on every rank)."""

    flag = "zero3_gather_for_scoring"
    passes = "scoring"
    gathered = "gathered once per scoring pass"

    def auto_gathers(self, engine: DeepSpeedEngine) -> tuple[bool, str]:
        return fits_gathered(engine.module), "the full model does not fit in half the free memory"


class TrainingGather(WholeModelGather):
    """The actor's or the critic's forward and backward of a micro-step (``--zero3_gather_for_training``);
    ``auto``: one data-parallel rank, and no partition stored quantized (MixZ++'s frozen weights, which a
    gather would dequantize all at once). ``models`` (name -> engine) are decided at once, as the trainer
    is built: a model it gathers is marked (:func:`~dschat.runtime.zero3.mark_trained_whole`), so
    ZeRO-3's trace rules its hooked passes (a rollout's, before any training) as a frozen model's; one
    it leaves to the hooks is unmarked. Deciding needs no collective."""

    flag = "zero3_gather_for_training"
    passes = "training"
    gathered = "gathered once per forward and backward"

    def __init__(self, setting: str = "auto", models: dict[str, DeepSpeedEngine | None] | None = None) -> None:
        super().__init__(setting)
        for name, engine in (models or {}).items():
            if engine is not None and zero3_offload(engine) is not None:
                self.decided[name] = self.decide(name, engine)

    def auto_gathers(self, engine: DeepSpeedEngine) -> tuple[bool, str]:
        if quantized_partitions(engine):
            return False, (f"its frozen weights are stored quantized; --{self.flag} on dequantizes them all "
                           "at once")
        return whole_partitions(engine), (f"it is partitioned over more than one rank; --{self.flag} on gathers "
                                          "it whole, at the memory of a full copy")

    def decide(self, name: str, engine: DeepSpeedEngine) -> bool:
        gather = super().decide(name, engine)
        mark_trained_whole(engine, gather)
        return gather


# ------------------------------------------------------------------------------- the passes of a run
class ScoringPasses:
    """The passes of one run over rollout batches, on the engines ``models`` (``actor``,
    ``reference``, ``critic``, ``reward``; None where a run has none).

    ``packing`` (``--sequence_packing`` resolved per model: name -> packs), ``temperature`` (the
    sampling temperature the log-probs are taken at), ``fp32`` (log-probs of half-precision logits in
    fp32), ``scoring_gather`` / ``training_gather`` (``--zero3_gather_for_scoring`` /
    ``--zero3_gather_for_training``). One packing of a batch serves every model's pass.
    ``reward_inputs``: the re-tokenisation for a reward model of another tokenizer (None: it reads the
    actor's token ids)."""

    def __init__(self, models: dict[str, DeepSpeedEngine | None], *, packing: str, temperature: float, fp32: bool,
                 scoring_gather: str, training_gather: str,
                 reward_inputs: CrossTokenizerInputs | None = None) -> None:
        self.models = models
        self.reward_inputs = reward_inputs
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
        """(B,) the reward model's end scores, gathered whole for the pass where the scoring gather says.
        A reward model of another tokenizer scores the rows re-tokenised by :attr:`reward_inputs`
        (padded, right-aligned: its value at each row's last token)."""
        model = self.models["reward"]
        if self.reward_inputs is not None:
            ids, mask = self.reward_inputs(seq, attention_mask, prompt_length)
            with self.scoring_gather("reward model", model):
                values = token_values(model, ids, mask, positions_from_mask(mask), None)
            return values.gather(1, last_token_index(mask).unsqueeze(1)).squeeze(1)
        with self.scoring_gather("reward model", model):
            return reward_end_scores(model, seq, attention_mask, position_ids, self.layout_for("reward", packed),
                                     prompt_length)
