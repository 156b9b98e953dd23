"""Rollout generation: one object the trainer calls, asking each decoding path in a fixed order.

:class:`RolloutGenerator` holds one :class:`~dschat.rlhf.rollout.path.DecodingPath` per way of
decoding and, for every rollout, asks them in this order whether they can serve; the first that can
decodes:

1. ``dschat-he-tp`` -- dschat's Hybrid Engine over a tensor-parallel group
   (:mod:`dschat.rlhf.rollout.tensor_parallel`, ``--inference_tp_size`` > 1);
2. ``dschat-he`` -- dschat's Hybrid Engine (:mod:`dschat.rlhf.rollout.dschat_engine`;
   ``--enable_hybrid_engine`` for a family its decode model covers, on any accelerator);
3. ``hybrid-engine`` -- DeepSpeed's Hybrid Engine (:mod:`dschat.rlhf.rollout.deepspeed_engine`; other
   families with an inference container, on CUDA);
4. ``graphs`` -- Hugging Face ``generate`` with a static KV cache and CUDA graphs
   (:mod:`dschat.rlhf.rollout.graphs`; ``--generation_loop auto`` on CUDA, or ``graphs``);
5. ``dschat`` -- dschat's sampling loop (:mod:`dschat.rlhf.rollout.sample_loop`; ``auto`` elsewhere);
6. ``hf`` -- Hugging Face ``generate`` (:mod:`dschat.rlhf.rollout.hf_generate`), which always serves.

Paths 4-6 decode with the training module: before the first of them is asked, the generator
materialises its weights once for the rollout and puts them back after it:

* **ZeRO-3**: when the full model fits in free memory (full parameter bytes <= half of the free
  accelerator / host memory; ``--zero3_gather_for_generation on|off`` overrides), all parameters are
  gathered once per rollout with DeepSpeed's fetch/release hooks detached, then restored. Otherwise
  every layer is fetched for every token and every rank steps until all have finished
  (``synced_gpus``).
* **LoRA** layers are fused into their base weights and unfused after, bit for bit
  (:meth:`~dschat.models.lora.LinearLayer_LoRA.fuse_lora_weight`). Not fused: 4-bit (QLoRA) layers,
  and every layer when ZeRO-3 weights are fetched layer by layer.

dschat's Hybrid Engine does the same gather and fusion while it copies the weights
(:mod:`dschat.rlhf.rollout.weights`).

**Where an answer ends.** Every path stops a row at any id of :attr:`RolloutGenerator.end_ids`: the
tokenizer's EOS and each id of the model's generation config ``eos_token_id``
(:func:`dschat.models.tokenizer.end_token_ids`), what upstream's ``generate`` stopped on. Multi-turn
episodes (``chat_turn_end``, ``--env``) also end a turn at the special token the chat template closes
an assistant turn with (:func:`dschat.models.tokenizer.template_turn_end_id`; a base model's tokenizer
with ChatML's ``<|im_end|>``), since their observations continue the conversation through the template.

**Fallbacks.** A path a flag asked for that cannot serve, or one that fails at run time for a reason
other than out of memory or bad input, says why in one line, once, and is off for the rest of the
run; the generator keeps one record of the latest (:attr:`RolloutGenerator.fallback`: which path,
why). The first rollout prints one summary line: the path that served, the reason each path before it
gave, the dtype and the inference tensor-parallel degree (:meth:`RolloutGenerator.summary_line`).

**Multi-turn episodes** (:class:`~dschat.rlhf.episodes.EpisodePlayer`) pass a
:class:`~dschat.rlhf.rollout.conversation.Conversation` with each turn: where a path that
``continues`` serves (the ``dschat`` loop, dschat's Hybrid Engine ``dschat-he``, ``graphs``), it
continues the conversations' KV cache and feeds only each row's new tokens; every other path
prefills the whole conversations again and the cache is dropped. One line says once which is
used (and, for a re-prefill, why).

The module paths keep the **log-probs of the generated tokens** (the raw logits divided by the
sampling temperature), so the trainer need not run the actor over the rollout again for its old
log-probs (:class:`~dschat.rlhf.rollout.sampling.Rollout`); DeepSpeed's Hybrid Engine keeps none.

Each fast path is an attribute (``keep_logprobs``, ``fuse_lora``, ``generation_loop``,
``cpu_decode_linear``, ``use_dschat_engine``) so ``benchmarks/step3.py`` can turn it off for its
baseline.
"""
from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
from deepspeed import DeepSpeedEngine
from torch import nn
from transformers import PreTrainedTokenizerBase

from dschat.errors import UserError
from dschat.models.tokenizer import end_token_ids, template_turn_end_id
from dschat.rlhf.rollout.conversation import Conversation
from dschat.rlhf.rollout.deepspeed_engine import NO_CONTAINER, DeepSpeedHybridEnginePath, HybridEngineDecision
from dschat.rlhf.rollout.dschat_engine import DschatEnginePath, DschatHybridEngine
from dschat.rlhf.rollout.graphs import GraphsPath
from dschat.rlhf.rollout.hf_generate import HfGeneratePath
from dschat.rlhf.rollout.path import DecodingPath, Fallback, RolloutRequest, fall_back, say_once
from dschat.rlhf.rollout.sample_loop import SampleLoopPath
from dschat.rlhf.rollout.sampling import DecodingSettings, Rollout
from dschat.rlhf.rollout.tensor_parallel import TensorParallelEnginePath
from dschat.rlhf.rollout.weights import module_weights
from dschat.runtime.dist import (TensorParallelGroup, gather_ints, get_world_size, print_rank_0,
                                    tensor_parallel_group)

__all__ = ["RolloutGenerator", "PATH_ORDER", "KV_REUSE", "rollout_summary_line"]

KV_REUSE = "Multi-turn episodes"  # how the notice on KV cache reuse between turns begins

# The fixed order in which the paths are asked (the first that can serve decodes).
PATH_ORDER: tuple[type[DecodingPath], ...] = (TensorParallelEnginePath, DschatEnginePath, DeepSpeedHybridEnginePath,
                                              GraphsPath, SampleLoopPath, HfGeneratePath)

_LABELS = {path.loop: path.label for path in PATH_ORDER}


def rollout_summary_line(loop: str | None, engine: DschatHybridEngine | None, module: nn.Module,
                         why: str | None = None) -> str:
    """One line naming what decoded a rollout (``loop``: ``RolloutGenerator.last_loop``): the engine,
    the layout, ``why`` (in brackets), the dtype and the inference tensor-parallel degree (1: each
    rank decodes its own prompts; N: groups of N ranks decode their prompts together, each holding
    1/N of the weights). It ends with ``inference TP degree N``."""
    param = next(module.parameters())
    degree = 1
    if loop == "dschat-he" and engine is not None:
        what, degree = engine.summary(param.device), engine.tp_size
    else:
        what = (f"{_LABELS.get(loop or '', str(loop))}, layout {getattr(module.config, 'model_type', '?')} "
                "(the training module's)")
    because = f" [{why}]" if why else ""
    return f"Rollouts: {what}{because}, dtype {str(param.dtype).replace('torch.', '')}, inference TP degree {degree}"


class RolloutGenerator:
    """Generates answers for a batch of left-padded prompts with the actor engine (see the module docstring).

    ``zero3_gather`` is ``"auto"`` (gather when the estimate says it fits), ``"on"`` or ``"off"``;
    it matters only for an actor under ZeRO-3 without DeepSpeed's Hybrid Engine. ``chat_turn_end``:
    answers also end at the chat template's end of turn (multi-turn episodes).
    """

    def __init__(
        self,
        actor: DeepSpeedEngine,
        tokenizer: PreTrainedTokenizerBase,
        *,
        decision: HybridEngineDecision,
        decoding: DecodingSettings,
        max_answer_seq_len: int,
        zero_stage: int,
        zero3_gather: str = "auto",
        generation_loop: str = "auto",
        cpu_decode_linear: str = "onednn",
        release_inference_cache: bool = False,
        inference_tp_size: int = 1,
        tp_gather_partition_size: int = 8,
        chat_turn_end: bool = False,
    ) -> None:
        self.actor = actor
        self.tokenizer = tokenizer
        # What a rollout stops on: the tokenizer's EOS and the model's generation-config EOS ids
        # (upstream's generate stops on the latter); with chat_turn_end, the template's end of turn too.
        self.end_ids: tuple[int, ...] = end_token_ids(actor.module, tokenizer)
        self.chat_turn_end = chat_turn_end
        turn_end = template_turn_end_id(tokenizer) if chat_turn_end else None
        if turn_end is not None and turn_end not in self.end_ids:
            self.end_ids += (turn_end,)
        self.decision = decision
        self.decoding = decoding
        self.max_answer_seq_len = max_answer_seq_len
        self.zero_stage = zero_stage
        self.zero3_gather = zero3_gather
        self.synced_gpus = zero_stage == 3  # upstream: every rank steps until all have finished
        self.fallback: Fallback | None = None  # the latest path that stopped serving, and why
        self._said: set[str] = set()  # the notices said so far (dschat.rlhf.rollout.path.say_once)
        self.hybrid_engine_active = decision.enabled and bool(getattr(actor, "_inference_containers", None))
        if decision.reason:
            fall_back(self, DeepSpeedHybridEnginePath.name, decision.reason)
        elif decision.enabled and not self.hybrid_engine_active:
            fall_back(self, DeepSpeedHybridEnginePath.name, NO_CONTAINER)
        self._gather_decided: bool | None = None  # ZeRO-3: gather once per rollout (dschat.rlhf.rollout.weights)
        # Fast paths, on by default (benchmarks/step3.py turns them off for its baseline).
        self.keep_logprobs = True  # return the generated tokens' log-probs (module paths only)
        self.fuse_lora = True  # fuse LoRA into the base weights for generation
        # "auto" ("graphs" where it applies, else "dschat") | "dschat" | "hf" | "graphs"
        self.generation_loop = generation_loop
        self.last_loop: str | None = None  # what the last rollout decoded with: a path's ``loop``
        self.graph_devices: tuple[str, ...] = ("cuda",)  # where "graphs" applies (tests add "cpu")
        self.graph_prompt_multiple = 64  # prompts are left-padded to a multiple of this for "graphs"
        self.cpu_decode_linear = cpu_decode_linear  # "onednn" | "off": decode-sized linears on a CPU
        self.extra_generate_kwargs: dict[str, Any] = {}  # e.g. min_new_tokens for a fixed-length benchmark
        # dschat's Hybrid Engine: --enable_hybrid_engine for a family its decode model covers
        # (benchmarks/step3.py's ours-he mode sets it too) ...
        self.use_dschat_engine = decision.dschat_engine
        # ... and --generation_loop auto on these devices: none. The published CPU figures
        # (benchmarks/results.md) are the eager loop's, and a sampled token can differ at a rounding
        # boundary; on CUDA "auto" keeps "graphs" until the engine's GPU tier passes on a GPU
        # (docs/launching.md: its figures, and what that tier found).
        self.auto_engine_devices: tuple[str, ...] = ()
        self.release_inference_cache = release_inference_cache  # free its KV cache and weight buffers after each rollout
        self.engine: DschatHybridEngine | None = None
        self._summary_said = False
        self._why: str | None = None  # why the last rollout's path served (the refusals before it)
        # --inference_tp_size N: dschat's Hybrid Engine decodes over groups of N ranks, gathering
        # --tp_gather_partition_size ZeRO-3 layers at a time. The groups are made here (collective).
        self.inference_tp_size = inference_tp_size
        self.tp_gather_partition_size = tp_gather_partition_size
        self.tp_group: TensorParallelGroup | None = (tensor_parallel_group(inference_tp_size)
                                                     if inference_tp_size > 1 else None)
        self.paths: tuple[DecodingPath, ...] = tuple(path(self) for path in PATH_ORDER)

    def path(self, name: str) -> DecodingPath:
        """The path called ``name`` (``DecodingPath.name``)."""
        return next(path for path in self.paths if path.name == name)

    @property
    def fallback_reason(self) -> str | None:
        """The line of the latest fallback (:attr:`fallback`), or None."""
        return self.fallback.reason if self.fallback is not None else None

    # ------------------------------------------------------------------ mode switches
    def eval(self) -> None:
        """Put the actor in inference mode (the Hybrid Engine swaps in its kernels here)."""
        if self.hybrid_engine_active:
            self.actor.eval()
        else:
            # A plain ``nn.Module.eval``: no dropout. (After a Hybrid Engine failure, ``actor.eval()``
            # would swap the inference kernels back in.)
            self.actor.module.eval()

    def scoring_mode(self) -> None:
        """After generation: the training-mode forwards (what the PPO update will run), dropout off.

        The Hybrid Engine swaps its inference kernels in on ``eval()``; scoring the rollout with them
        would give old log-probs from different kernels than the update's (docs/upstream.md#step-3-ppo:
        eval mode). ``engine.train()`` restores the training forwards,
        ``module.eval()`` turns dropout off without swapping kernels back.
        """
        if self.hybrid_engine_active:
            self.actor.train(True)
        self.actor.module.eval()

    def tensor_parallel(self) -> bool:
        """Whether a rollout now decodes over the tensor-parallel group (``inference_tp_size`` > 1)."""
        return self.tp_group is not None and self.inference_tp_size > 1

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``(B, P)`` left-padded prompts -> ``(B, P + A')`` sequences, ``A' <= max_answer_seq_len``."""
        return self.rollout(prompts, mask).sequences

    @torch.no_grad()
    def rollout(self, prompts: torch.Tensor, mask: torch.Tensor, conversation: Conversation | None = None) -> Rollout:
        """Generate answers for ``(B, P)`` left-padded prompts; see :class:`Rollout`.

        With ``conversation`` (multi-turn episodes: ``prompts`` are the live conversations so far), a
        path that ``continues``, where it serves, continues the conversation's KV cache instead (its
        rollout then has a row per conversation:
        :class:`~dschat.rlhf.rollout.conversation.Conversation`); any other path decodes ``prompts``
        and the cache is dropped. Which of the two is used is said once (and why not, once per
        reason)."""
        rollout = self._rollout(prompts, mask, conversation)
        if not self._summary_said:
            self._summary_said = True
            print_rank_0(self.summary_line())
        return rollout

    def summary_line(self) -> str:
        """One line naming what decoded the last rollout and why (:func:`rollout_summary_line`)."""
        return rollout_summary_line(self.last_loop, self.engine, self.actor.module, self._why)

    def _rollout(self, prompts: torch.Tensor, mask: torch.Tensor, conversation: Conversation | None = None) -> Rollout:
        """Ask the paths in order; the first that can serve decodes. One that fails in a way it falls
        back from is recorded (:func:`~dschat.rlhf.rollout.path.fall_back`) and the next is asked."""
        refused: list[str] = []
        with ExitStack() as stack:
            materialised: bool | None = None  # entered before the first module path is asked
            for path in self.paths:
                if path.on_module and materialised is None:
                    materialised = stack.enter_context(module_weights(self))
                request = RolloutRequest(prompts, mask, True if materialised is None else materialised,
                                         tensor_parallel=self.tensor_parallel(), conversation=conversation)
                reason = path.can_serve(request)
                if reason is None:
                    self.last_loop = path.loop
                    rollout, failure = _decode(path, request)
                    if failure is not None:
                        reason, err = failure
                        fall_back(self, path.name, reason)
                        reason = f"failed ({type(err).__name__}), off for the rest of the run"
                    else:
                        self._why = "after " + "; ".join(refused) if refused else "the first path asked"
                        if conversation is not None:
                            self._say_kv_reuse(conversation, path, refused)
                        return rollout
                refused.append(f"{path.name}: {reason}")  # the reason, not the notice: said once
        raise AssertionError(f"no decoding path served: {refused}")  # the last path always serves

    def _say_kv_reuse(self, conversation: Conversation, served: DecodingPath, refused: list[str]) -> None:
        """Say once whether multi-turn episodes keep their KV cache between turns; drop it if not."""
        if conversation.reused:
            say_once(self, f"{KV_REUSE}: the conversation's KV cache is kept between turns ({served.name} loop)")
            return
        conversation.drop()
        loop = SampleLoopPath.name
        why = conversation.why_not or next((r[len(loop) + 2:] for r in refused if r.startswith(f"{loop}: ")), None)
        if why is None:
            able = ", ".join(path.name for path in self.paths if path.continues)
            why = f"{served.name} decodes the turns; only {able} continue a KV cache"
        say_once(self, f"{KV_REUSE}: each turn prefills the whole conversation again ({why})")


def _decode(path: DecodingPath, request: RolloutRequest) -> tuple[Rollout | None, tuple[str, Exception] | None]:
    """``path.generate(request)`` and None, or None and ``(reason, error)`` when the path falls back
    (:meth:`DecodingPath.fall_back`'s line); an error it does not fall back from is raised. A path
    that ``falls_back`` does so on every rank or none (collective with more than one rank: one
    all-reduce): after another rank's fallback this rank drops its rollout and falls back too; after
    another rank's error, it raises a :class:`UserError` line saying so. A multi-turn turn that falls
    back leaves its conversation's cache dropped and not ``reused``."""
    rollout: Rollout | None = None
    err: Exception | None = None
    reason: str | None = None
    try:
        rollout = path.generate(request)
    except Exception as failure:  # noqa: BLE001 -- the path says whether it falls back
        err, reason = failure, path.fall_back(failure, request)
    if path.falls_back and get_world_size() > 1:
        worst = max(row[0] for row in gather_ints([0 if err is None else 1 if reason is not None else 2]))
        if worst == 2 and (err is None or reason is not None):
            raise UserError(f"decoding with {path.name} failed on another rank (its error is in that rank's log)")
        if worst == 1 and err is None:
            err = RuntimeError(f"{path.name} failed on another rank")
            reason = path.fall_back(err, request)
            if reason is None:
                raise UserError(f"{path.name} fell back on another rank but cannot here; its line is in that "
                                "rank's log")
    if err is None:
        return rollout, None
    if reason is None:
        raise err
    if request.conversation is not None:  # the turn is not used (a dropped rollout's continued cache
        request.conversation.reused = False  # too): the next path prefills every conversation again
        request.conversation.drop()
    return None, (reason, err)
