"""The tensor-parallel variant of dschat's Hybrid Engine path (``--inference_tp_size N``).

Upstream's Hybrid Engine generated with tensor parallelism inside groups of ``--inference_tp_size``
ranks; so does :class:`TensorParallelHybridEngine`:

* **Placement.** The world is split into groups of ``N`` contiguous ranks, each within one node
  (:func:`dschat.runtime.dist.tensor_parallel_group`, torch.distributed process groups).
* **Sharding.** Each member keeps ``1/N`` of the inference layout
  (:mod:`dschat.models.decoder.tensor_parallel`): column-parallel q/k/v and gate/up, row-parallel
  output projections with an all-reduce, a vocabulary-parallel embedding and LM head. Under ZeRO-3 the
  weights are gathered ``--tp_gather_partition_size`` decoder layers at a time, LoRA fused in each
  gathered piece, and only this member's slices are copied out of it.
* **Batching.** The group all-gathers its members' prompts (padded to a common width and row count),
  decodes them as one batch, and gives each member back its own rows, cut to its own prompt width and
  to the answer length its own rows needed, with their per-token log-probs: what the member would
  have decoded alone (:class:`GroupBatch`).
* **Sampling.** Greedy: each member reduces its logits to ``(best, id, logsumexp, ...)`` and one
  all-gather of ``(B, 5)`` picks the global argmax and its log-prob
  (:func:`~dschat.models.decoder.tensor_parallel.combine_greedy_stats`). Sampling (temperature, top-k,
  top-p): the row is gathered and processed as on one rank, member 0 draws and broadcasts its draw,
  so a group never disagrees on a token whatever each member's random state.
* **Memory.** ``--release_inference_cache`` frees the shards and the KV cache after each rollout.

At ``--inference_tp_size 1`` none of this runs: :class:`~dschat.rlhf.rollout.dschat_engine.DschatHybridEngine`
decodes each rank's prompts on that rank alone (no group, no collective, no copy).

:class:`TensorParallelEnginePath` serves where :class:`~dschat.rlhf.rollout.dschat_engine.DschatEnginePath`
would, but over the generator's tensor-parallel group; it is asked first. Its decode step is eager,
so a failure is never fallen back from.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from dschat.errors import UserError
from dschat.models.decoder.layouts import unsupported_reason
from dschat.models.decoder.tensor_parallel import (
    Collectives,
    ShardedDecodeModel,
    combine_greedy_stats,
    greedy_shard_stats,
    tp_unsupported_reason,
)
from dschat.models.lora import LinearLayer_LoRA
from dschat.models.tokenizer import end_id_tuple
from dschat.rlhf.rollout.dschat_engine import ENGINE_NAME, DschatEnginePath, DschatHybridEngine
from dschat.rlhf.rollout.path import RolloutRequest
from dschat.rlhf.rollout.sampling import EndIds, Rollout, check_probability_sums, draw, is_end
from dschat.runtime.zero3 import gathered, release_zero3_prefetch

__all__ = ["check_inference_tp", "GroupBatch", "group_batch", "own_answer_length", "materialised_part",
           "TensorParallelHybridEngine", "TensorParallelEnginePath"]


def check_inference_tp(size: int, config: Any, world_size: int, enable_hybrid_engine: bool) -> None:
    """``--inference_tp_size`` > 1 against the world and the actor (one :class:`UserError` line): the
    degree divides the world size, the Hybrid Engine is on and dschat's covers the model, and the
    model's heads and MLP width divide by it (a vocabulary that does not is padded)."""
    if size <= 1:
        return
    if world_size % size:
        raise UserError(f"--inference_tp_size {size} does not divide the world size {world_size}: launch a multiple "
                        f"of {size} ranks or use an --inference_tp_size that divides {world_size}")
    if not enable_hybrid_engine:
        raise UserError(f"--inference_tp_size {size} shards generation inside the Hybrid Engine: add "
                        "--enable_hybrid_engine, or use --inference_tp_size 1")
    why_not = unsupported_reason(config)
    if why_not is not None:
        raise UserError(f"--inference_tp_size {size} needs dschat's Hybrid Engine, which does not cover this actor "
                        f"({why_not}); use --inference_tp_size 1")
    reason = tp_unsupported_reason(config, size)
    if reason is not None:
        raise UserError(reason)


# ------------------------------------------------------------------------------------------------
# The group's batch
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupBatch:
    """The group's prompts as one batch: ``rows`` rows per member (a member with fewer repeats its
    first row), ``width`` columns (narrower prompts left-padded); ``own`` rows of ``own_width`` are this
    member's, from row ``start``."""

    prompts: torch.Tensor  # (n * rows, width)
    mask: torch.Tensor  # (n * rows, width)
    start: int
    own: int
    own_width: int
    width: int


def own_answer_length(answer: torch.Tensor, eos_token_id: EndIds) -> int:
    """Columns of ``answer`` (B, A) that one rank decoding these rows alone would have produced: up to
    the step after which every row has met an end id (:data:`~dschat.rlhf.rollout.sampling.EndIds`;
    the loop's early stop), else all of them."""
    if answer.shape[1] == 0:
        return 0
    ended = is_end(answer, eos_token_id).cumsum(dim=1) > 0  # (B, A): the row has ended at or before this column
    done = ended.all(dim=0).nonzero()
    return int(done[0]) + 1 if len(done) else answer.shape[1]


def group_batch(group: Collectives, prompts: torch.Tensor, mask: torch.Tensor, pad_token_id: int) -> GroupBatch:
    """All-gather the members' ``(B_i, P_i)`` left-padded prompts and masks into one ``GroupBatch``."""
    B, P = prompts.shape
    sizes = torch.stack(group.all_gather(torch.tensor([B, P], device=prompts.device)))  # (n, 2)
    rows, width = int(sizes[:, 0].max()), int(sizes[:, 1].max())
    mask = mask.to(prompts.device, prompts.dtype)
    if rows > B:  # a short last batch: repeat a row, decoded and dropped
        prompts = torch.cat([prompts, prompts[:1].expand(rows - B, -1)])
        mask = torch.cat([mask, mask[:1].expand(rows - B, -1)])
    if width > P:  # left padding keeps the answers where they were (positions come from the mask)
        prompts = torch.cat([prompts.new_full((rows, width - P), pad_token_id), prompts], dim=1)
        mask = torch.cat([mask.new_zeros((rows, width - P)), mask], dim=1)
    return GroupBatch(torch.cat(group.all_gather(prompts)), torch.cat(group.all_gather(mask)),
                      start=group.index * rows, own=B, own_width=P, width=width)


def _own_rollout(batch: GroupBatch, rollout: Rollout, eos_token_id: EndIds) -> Rollout:
    """This member's rows of the group's rollout, as it would have decoded them alone."""
    rows = slice(batch.start, batch.start + batch.own)
    answer = rollout.sequences[rows, batch.width:]
    length = own_answer_length(answer, eos_token_id)
    sequences = rollout.sequences[rows, batch.width - batch.own_width:batch.width + length]
    logprobs = None if rollout.logprobs is None else rollout.logprobs[rows, :length]
    return Rollout(sequences, logprobs)


# ------------------------------------------------------------------------------------------------
# Gathering the training module piece by piece
# ------------------------------------------------------------------------------------------------
@contextmanager
def materialised_part(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Inside, the weights of ``modules`` are whole (ZeRO-3: gathered, read-only; collective) with
    their LoRA layers fused (the inference layout has no LoRA branch); on exit they are unfused (bit
    for bit) and released."""
    params = list({id(p): p for m in modules for p in m.parameters()}.values())
    with gathered(params):
        lora = [m for module in modules for m in module.modules() if isinstance(m, LinearLayer_LoRA)]
        for layer in lora:
            layer.fuse_lora_weight()
        try:
            yield
        finally:
            for layer in lora:
                layer.unfuse_lora_weight()


# ------------------------------------------------------------------------------------------------
# The engine
# ------------------------------------------------------------------------------------------------
class TensorParallelHybridEngine(DschatHybridEngine):
    """dschat's Hybrid Engine over a tensor-parallel group (see the module docstring). Eager: the
    CUDA-graph decode step of :class:`DschatHybridEngine` is not used across a group (its collectives
    are not captured)."""

    def __init__(self, config: Any, group: Collectives, *, layers_per_gather: int = 8, **kwargs: Any) -> None:
        self.group = group
        super().__init__(config, **kwargs)
        self.tp_size = group.size
        self.layers_per_gather = layers_per_gather

    def continue_turn(self, *args: Any, **kwargs: Any) -> Rollout:
        """Not over a group: each turn prefills the whole conversations (see the path)."""
        raise NotImplementedError("a tensor-parallel group does not continue a multi-turn KV cache")

    def _decode_model(self, config: Any) -> ShardedDecodeModel:
        return ShardedDecodeModel(config, self.group)

    def _compiled(self, device: torch.device) -> bool:
        return False

    def summary(self, device: torch.device) -> str:
        """What decodes, over which ranks, in which layout, for the rollout summary line."""
        spec = self.model.full_spec
        gqa = f"; GQA {spec.num_heads}/{spec.num_kv_heads}" if spec.num_kv_heads != spec.num_heads else ""
        return (f"{ENGINE_NAME} (eager decode step, tensor-parallel over ranks {self.group.ranks[0]}-"
                f"{self.group.ranks[-1]}: {self.spec.num_heads} heads and 1/{self.tp_size} of the vocabulary a rank), "
                f"layout {spec.family} (fused qkv, {'gate_up' if spec.layout.gated else 'fc1'}{gqa})")

    @torch.no_grad()
    def rollout(self, module: nn.Module, prompts: torch.Tensor, mask: torch.Tensor, *,
                gather: Any = None, min_new_tokens: int = 0, keep_logprobs: bool = True) -> Rollout:
        """Refresh this member's shards from ``module`` (``gather(modules)`` materialises a piece;
        collective), decode the group's prompts together, return this member's rows."""
        param = next(module.parameters())
        batch = group_batch(self.group, prompts, mask, self.pad_token_id)
        try:  # a failed refresh releases the buffers too
            self.model.weights.refresh(module, param.dtype, param.device, gather, self.layers_per_gather)
            rollout = self.decode(batch.prompts, batch.mask, min_new_tokens=min_new_tokens, keep_logprobs=keep_logprobs)
        finally:
            self.rollouts += 1
            if self.release_cache:
                self.release()
        return _own_rollout(batch, rollout, self.eos_token_id)

    def _select(self, logits: torch.Tensor, suppress_eos: bool, unfinished: torch.Tensor, pad: torch.Tensor,
                keep_logprobs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This member's (B, Vs) logits -> the group's tokens and log-probs (the same on every member)."""
        w = self.model.weights
        if self.decoding.sample:
            full = torch.cat(self.group.all_gather(logits), dim=-1)[:, :w.vocab]  # (B, V)
            return super()._select(full, suppress_eos, unfinished, pad, keep_logprobs)
        scores = logits
        local_ends = [i - w.vocab_start for i in end_id_tuple(self.eos_token_id)
                      if 0 <= i - w.vocab_start < w.vocab_rows]
        if suppress_eos and local_ends:
            scores = logits.clone()
            scores[:, local_ends] = -float("inf")
        stats = greedy_shard_stats(scores, logits, w.vocab_start, self.pad_token_id)
        token, logprob = combine_greedy_stats(self.group.all_gather(stats), unfinished, self.pad_token_id)
        return token.to(pad.dtype), (logprob if keep_logprobs else None)

    def _draw(self, scores: torch.Tensor) -> torch.Tensor:
        """Member 0 draws (its random stream, as if it decoded the group's batch alone) and sends its
        tokens to the others, so members with different random states never disagree. ``scores`` are the
        same on every member, so every member refuses non-finite ones together (none is left waiting
        in the broadcast for a member 0 that raised). Only sampling reaches here: greedy decoding combines
        the shards' statistics in :meth:`_select`."""
        probs = torch.softmax(scores, dim=-1)  # once: checked on every member, drawn from on member 0
        check_probability_sums(probs.sum(-1, dtype=torch.float64))
        if self.group.index == 0:
            token = draw(probs)
        else:
            token = torch.empty(scores.shape[0], dtype=torch.long, device=scores.device)
        self.group.broadcast_(token, 0)
        return token


class TensorParallelEnginePath(DschatEnginePath):
    """dschat's Hybrid Engine over the generator's tensor-parallel group (``--inference_tp_size`` > 1)."""

    name = "dschat-he-tp"
    loop = "dschat-he"
    tensor_parallel = True
    continues = False  # each turn prefills the whole conversations over the group

    def generate(self, request: RolloutRequest) -> Rollout:
        gen, module = self.gen, self.gen.actor.module
        if not isinstance(gen.engine, TensorParallelHybridEngine):
            gen.engine = TensorParallelHybridEngine(
                module.config, gen.tp_group, layers_per_gather=gen.tp_gather_partition_size,
                decoding=gen.decoding, max_new_tokens=gen.max_answer_seq_len,
                eos_token_id=gen.end_ids, pad_token_id=gen.tokenizer.pad_token_id,
                release_cache=gen.release_inference_cache, cpu_decode_linear=gen.cpu_decode_linear)
        gen.engine.decoding = gen.decoding  # this rollout's (ReMax's greedy baseline changes it per call)
        gen.engine.max_new_tokens = gen.max_answer_seq_len  # this rollout's (an episode's turn has less room)
        if gen.zero_stage == 3:
            release_zero3_prefetch(gen.actor)  # nothing may be in flight when gathering outside a pass
        return gen.engine.rollout(module, request.prompts, request.mask, gather=materialised_part,
                                  min_new_tokens=int(gen.extra_generate_kwargs.get("min_new_tokens", 0)),
                                  keep_logprobs=gen.keep_logprobs)
