"""The plain ``generate`` path: Hugging Face ``generate`` on the training module, the last path asked.

It serves every rollout that reaches it (``--generation_loop hf``, a logits processor or other
``generate`` argument dschat's loop does not take, an encoder-decoder, ZeRO-3 weights fetched layer
by layer with every rank stepping until all are done: ``synced_gpus``).

:func:`hf_generate` is also what the CUDA-graphs path calls, and :func:`generate_kwargs` and
:func:`decoding_only_generation_config` what DeepSpeed's Hybrid Engine path calls:

* ``generate`` fills every knob it is not passed from ``module.generation_config``; for the call, that
  attribute is :meth:`~dschat.rlhf.rollout.sampling.DecodingSettings.generation_config` (the
  rollout settings and the special-token ids only), and the model's own is put back after.
* With ``keep_logprobs`` the log-probs of the generated tokens come from ``generate``'s per-step raw
  logits (fp32, B x A' x V x 4 bytes held until it returns).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

import torch
from transformers import PreTrainedModel

from dschat.models.tokenizer import generate_eos
from dschat.rlhf.rollout.path import DecodingPath, RolloutRequest
from dschat.rlhf.rollout.sample_loop import decode_kernels
from dschat.rlhf.rollout.sampling import DecodingSettings, Rollout, generated_token_logprobs

if TYPE_CHECKING:
    from dschat.rlhf.rollout.generator import RolloutGenerator

__all__ = ["HfGeneratePath", "decoding_only_generation_config", "generate_kwargs", "hf_generate"]


@contextmanager
def decoding_only_generation_config(module: PreTrainedModel, decoding: DecodingSettings) -> Iterator[None]:
    """Inside, ``module.generation_config`` is :meth:`DecodingSettings.generation_config` (the model's
    own is put back after): ``generate`` fills every knob not passed to it from that attribute."""
    original = getattr(module, "generation_config", None)
    module.generation_config = decoding.generation_config(original)
    try:
        yield
    finally:
        module.generation_config = original


def generate_kwargs(gen: RolloutGenerator, mask: torch.Tensor) -> dict[str, Any]:
    """The ``generate`` keyword arguments of one rollout: lengths, special tokens (each of the
    generator's ``end_ids`` stops a row), ``synced_gpus`` (ZeRO-3), the decoding settings, then the
    generator's ``extra_generate_kwargs``."""
    return {
        "attention_mask": mask,
        "max_new_tokens": gen.max_answer_seq_len,
        "pad_token_id": gen.tokenizer.pad_token_id,
        "eos_token_id": generate_eos(gen.end_ids),
        "synced_gpus": gen.synced_gpus,
        "use_cache": True,
        **gen.decoding.generate_kwargs(),
        **gen.extra_generate_kwargs,
    }


def hf_generate(gen: RolloutGenerator, module: PreTrainedModel, prompts: torch.Tensor, mask: torch.Tensor,
                **overrides: Any) -> Rollout:
    """``type(module).generate`` on ``(B, P)`` prompts with :func:`generate_kwargs` and ``overrides``;
    the log-probs of the generated tokens when ``gen.keep_logprobs``."""
    kwargs = {**generate_kwargs(gen, mask), **overrides}
    if gen.keep_logprobs:
        kwargs.update(return_dict_in_generate=True, output_logits=True)
    # The class method, not ``module.generate``: a Hybrid Engine that failed at run time leaves
    # its own generate installed on the instance.
    with decoding_only_generation_config(module, gen.decoding):
        out = type(module).generate(module, prompts, **kwargs)
    if not gen.keep_logprobs:
        return Rollout(out, None)
    seq = out.sequences
    logprobs = generated_token_logprobs(getattr(out, "logits", None), seq[:, prompts.shape[1]:],
                                        gen.decoding.logit_temperature)
    return Rollout(seq, logprobs)


class HfGeneratePath(DecodingPath):
    """Hugging Face ``generate`` on the training module, decode-sized CPU linears where they apply."""

    name = loop = "hf"
    on_module = True
    label = "hf (the training module's generate)"

    def can_serve(self, request: RolloutRequest) -> str | None:
        return None  # the last path: every rollout that reaches it

    def generate(self, request: RolloutRequest) -> Rollout:
        gen, module = self.gen, self.gen.actor.module
        with decode_kernels(gen, module, request.prompts.shape[0], request.materialised):
            return hf_generate(gen, module, request.prompts, request.mask)
