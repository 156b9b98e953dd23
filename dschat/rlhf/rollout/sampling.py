"""What a rollout is decoded with and what it gives back, and the sampling every decoding path shares.

* :class:`DecodingSettings` (``--decoding``, ``--temperature``, ``--top_k``, ``--top_p``) and
  :class:`Rollout` (sequences and the generated tokens' log-probs).
* :func:`next_token_scores`: ``generate``'s logits processing for those settings; :func:`draw`: an
  inverse-CDF draw (one uniform number per row) instead of ``torch.multinomial``.
* :func:`generated_token_logprobs` (from ``generate``'s per-step logits) and :func:`loop_rollout`
  (from a decoding loop's per-step tokens and log-probs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import torch
from transformers import GenerationConfig

__all__ = ["DecodingSettings", "Rollout", "StepCallback", "EndIds", "is_end",
           "generated_token_logprobs", "loop_rollout", "check_probability_sums", "draw", "end_rows", "next_token_scores"]

# ------------------------------------------------------------------------------------------------
# What a rollout is decoded with, and what it gives back
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodingSettings:
    """Rollout decoding (``--decoding``, ``--temperature``, ``--top_k``, ``--top_p``)."""

    decoding: str = "sample"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def sample(self) -> bool:
        return self.decoding == "sample"

    def generate_kwargs(self) -> dict[str, Any]:
        """These settings as ``generate`` keyword arguments. They override only the knobs they name:
        ``generate`` still fills every other one (``repetition_penalty``, ``no_repeat_ngram_size``,
        ``min_p``, ``typical_p``, ``bad_words_ids``, ...) from the model's ``generation_config``, so
        :class:`RolloutGenerator` also swaps that for :meth:`generation_config` during the call."""
        if not self.sample:
            return {"do_sample": False, "num_beams": 1}
        return {"do_sample": True, "num_beams": 1, "temperature": self.temperature, "top_k": self.top_k,
                "top_p": self.top_p, "repetition_penalty": 1.0}

    def generation_config(self, model_config: Any = None) -> Any:
        """A fresh ``GenerationConfig`` with these decoding settings and nothing else but the special-token
        ids (pad / bos / eos / decoder start) of ``model_config``, the model's own generation config.

        A checkpoint's ``generation_config.json`` (``temperature 0.6``, ``repetition_penalty``,
        ``no_repeat_ngram_size``, ``min_p``, ...) must not shape the rollouts: the PPO ratio assumes the
        answers were drawn from ``softmax(logits / temperature)`` with top-k / top-p only, which is what
        dschat's own loop (:func:`dschat.rlhf.rollout.sample_loop.sample_loop`) draws from and what the log-probs
        are computed under."""
        ids = {name: getattr(model_config, name, None)
               for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")}
        return GenerationConfig(**{k: v for k, v in ids.items() if v is not None}, **self.generate_kwargs())

    @property
    def logit_temperature(self) -> float:
        """Divide logits by this when scoring rollouts, so log-probs are those of the sampling
        distribution (TRL's convention); 1 for greedy decoding."""
        return self.temperature if self.sample else 1.0


class Rollout(NamedTuple):
    """One generated batch."""

    sequences: torch.Tensor  # (B, P + A') left-padded prompts, answers, padding after EOS
    # (B, A') fp32 log-probs of sequences[:, P:] under logits / temperature, as sampled; None when
    # the generator could not keep them (Hybrid Engine, or turned off).
    logprobs: torch.Tensor | None



def generated_token_logprobs(step_logits: Sequence[torch.Tensor] | None, answer: torch.Tensor,
                             temperature: float) -> torch.Tensor | None:
    """Log-probs of ``answer`` (B, A') from ``generate``'s per-step raw logits (A' tensors of (B, V)).

    The same numbers the trainer would get from a forward pass over the sequence (up to the
    rounding of a KV-cached forward), computed once per step so no (B, A', V) tensor is built.
    ``None`` when the logits do not cover the answer (then the trainer recomputes them).
    """
    if step_logits is None or len(step_logits) != answer.shape[1]:
        return None
    columns = []
    for j, logits in enumerate(step_logits):
        logits = logits.float()
        if temperature != 1.0:
            logits = logits / temperature
        columns.append(torch.log_softmax(logits, dim=-1).gather(-1, answer[:, j:j + 1]).squeeze(-1))
    if not columns:
        return answer.new_zeros((answer.shape[0], 0), dtype=torch.float32)
    return torch.stack(columns, dim=1)



# ------------------------------------------------------------------------------------------------
# Following rows step by step
# ------------------------------------------------------------------------------------------------
EndIds = int | Sequence[int]
"""The ids that end an answer, as every decoding path and mask takes them: one id, or several (the
generator's ``end_ids``: the tokenizer's EOS and the model's generation-config EOS ids,
:func:`dschat.models.tokenizer.end_token_ids`)."""


def _listed(eos_token_id: EndIds | None) -> list[int]:
    return [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)


def is_end(tokens: torch.Tensor, eos_token_id: EndIds | None) -> torch.Tensor:
    """Where ``tokens`` (any shape) hold one of the end ids (:data:`EndIds`): a bool tensor of that shape."""
    ended = torch.zeros_like(tokens, dtype=torch.bool)
    for end in _listed(eos_token_id):
        ended |= tokens == end
    return ended


StepCallback = Callable[[torch.Tensor], "torch.Tensor | None"]
"""A decoding loop's ``on_step``: called once per step, after the step's tokens are drawn, with those
``(B,)`` tokens (``pad_token_id`` on rows that had already ended); returns ``None`` or a ``(B,)`` bool
tensor of rows to end now. A row ended so is treated as one that drew EOS at this step: its token is
kept and every later token of it is ``pad_token_id``; decoding stops when no row goes on."""


def end_rows(unfinished: torch.Tensor, token: torch.Tensor, eos_token_id: EndIds, on_step: StepCallback | None) -> None:
    """A decoding step's row bookkeeping, in place on the ``(B,)`` bool ``unfinished``: rows that drew
    an id of ``eos_token_id`` (:data:`EndIds`) end, then the rows ``on_step(token)`` names (see
    :data:`StepCallback`)."""
    unfinished &= ~is_end(token, eos_token_id)
    if on_step is not None:
        stop = on_step(token)
        if stop is not None:
            unfinished &= ~stop.to(device=unfinished.device, dtype=torch.bool)


# ------------------------------------------------------------------------------------------------
# Sampling
# ------------------------------------------------------------------------------------------------
def next_token_scores(logits: torch.Tensor, decoding: DecodingSettings, eos_token_id: EndIds,
                      suppress_eos: bool) -> torch.Tensor:
    """``generate``'s logits processing for ``decoding`` (B, V) fp32 -> (B, V): every end id
    (:data:`EndIds`) masked while the answer is shorter than ``min_new_tokens``, then temperature,
    top-k, top-p -- the same order and
    formulas as ``MinNewTokensLengthLogitsProcessor``, ``TemperatureLogitsWarper``,
    ``TopKLogitsWarper`` and ``TopPLogitsWarper`` (transformers 5.23), so a seed draws the same tokens."""
    scores = logits
    if suppress_eos:
        scores = scores.clone()
        scores[:, _listed(eos_token_id)] = -float("inf")
    if not decoding.sample:
        return scores
    if decoding.temperature != 1.0:
        scores = scores / decoding.temperature
    if decoding.top_k:
        k = min(decoding.top_k, scores.shape[-1])
        scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], -float("inf"))
    if decoding.top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - decoding.top_p)
        remove[..., -1:] = 0  # keep at least one token
        scores = scores.masked_fill(remove.scatter(1, sorted_indices, remove), -float("inf"))
    return scores


def check_probability_sums(total: torch.Tensor) -> None:
    """Refuse rows whose probabilities do not sum to a finite positive number (non-finite logits)."""
    if not bool(torch.isfinite(total).all() and (total > 0).all()):
        raise ValueError("probability tensor contains inf, nan or sums to 0 (the actor's logits are not finite)")


def draw(probs: torch.Tensor, sampler: str = "inverse_cdf") -> torch.Tensor:
    """One token per row from ``probs`` (B, V) -> (B,).

    ``"inverse_cdf"``: one uniform number per row against the fp64 running sum of the row (exact up
    to fp64 rounding; a zero-probability token is never drawn). ``"multinomial"``:
    ``torch.multinomial``, what ``generate`` calls; it draws an exponential variate for every
    vocabulary entry (O(V) random numbers per row against one).
    """
    if sampler == "multinomial":
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    if sampler != "inverse_cdf":
        raise ValueError(f"sampler must be 'inverse_cdf' or 'multinomial', got {sampler!r}")
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)  # (B, V)
    total = cdf[:, -1:]  # (B, 1)
    check_probability_sums(total)
    u = torch.rand(total.shape, dtype=torch.float64, device=probs.device) * total
    # Strictly below the total, so the first entry of the running sum above u is a token with p > 0.
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(1)


@torch.no_grad()
def loop_rollout(prompts: torch.Tensor, tokens: Sequence[torch.Tensor],
                 logprobs: Sequence[torch.Tensor] | None) -> Rollout:
    """The :class:`Rollout` of a decoding loop: the ``(B, P)`` prompts followed by the A' sampled
    columns ``tokens`` (each ``(B,)``), with their per-token log-probs (each ``(B,)``) unless ``None``."""
    rows = prompts.shape[0]
    answer = torch.stack(list(tokens), dim=1) if tokens else prompts.new_zeros((rows, 0))
    seq = torch.cat([prompts, answer], dim=1)  # (B, P + A')
    if logprobs is None:
        return Rollout(seq, None)
    kept = torch.stack(list(logprobs), dim=1) if logprobs else torch.zeros((rows, 0), device=prompts.device)
    return Rollout(seq, kept)


