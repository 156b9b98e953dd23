"""Freezing a model's lower layers (``--freeze_layers``, a dschat flag of step 2).

Freezing the token and position embeddings and the ``n`` lowest transformer blocks leaves them
without gradients or optimizer state, and the backward pass stops at block ``n``: no input below it
requires a gradient. On the CPU demo's SmolLM2-135M reward model (30 blocks), step 2 in a whole demo
run (seed 1234, alone on 2 cores) took 4:53 for 130 steps with 15 blocks frozen where it had taken
5:27 for 80 steps with none, and the steps that bought made a better reward model
(docs/demo_experiments.md).

Only the parameters of the blocks and of the modules that run before the first block are touched:
the final norm, anything after the blocks and the value head still train. The modules that run
before the first block are found by name, since module registration order does not follow the
forward (OPT registers ``project_out`` before its blocks): the input embeddings, every module whose
name holds ``embed`` (learned positions, BLOOM's embedding norm), GPT-2's ``wpe`` and OPT's
``project_in``.
"""
from __future__ import annotations

from torch import nn

from dschat.errors import UserError
from dschat.models.families import family_of

__all__ = ["transformer_blocks", "freeze_lower_layers", "release_input_gradients"]

# Names of modules that run between the token embeddings and the first block.
_BELOW_BLOCKS = ("wpe", "project_in")


def transformer_blocks(body: nn.Module) -> tuple[str, nn.ModuleList]:
    """The name and the ``nn.ModuleList`` of ``body``'s transformer blocks, found by the family's
    block path (``layers``, ``decoder.layers``, ``h``)."""
    path = family_of(body).lora_module_name.rstrip(".")
    for name, module in body.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and (name == path or name.endswith("." + path)):
            return name, module
    model_type = getattr(getattr(body, "config", None), "model_type", type(body).__name__)
    raise UserError(f"--freeze_layers: cannot find the transformer blocks of this {model_type} model "
                    f"(no module list named {path!r}); pass --freeze_layers 0")


def _below_blocks(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return "embed" in last or last in _BELOW_BLOCKS


def freeze_lower_layers(body: nn.Module, num_layers: int) -> list[str]:
    """Freeze ``body``'s embeddings and its ``num_layers`` lowest blocks; return the names of the
    parameters frozen (relative to ``body``). ``0`` freezes nothing."""
    if num_layers < 0:
        raise UserError(f"--freeze_layers must be 0 or more, got {num_layers}")
    if num_layers == 0:
        return []
    blocks_name, blocks = transformer_blocks(body)
    if num_layers > len(blocks):
        raise UserError(f"--freeze_layers {num_layers} is more than this model's {len(blocks)} transformer blocks; "
                        f"pass at most {len(blocks)}")
    frozen_modules: list[nn.Module] = [blocks[i] for i in range(num_layers)]
    embeddings = body.get_input_embeddings() if hasattr(body, "get_input_embeddings") else None
    if embeddings is not None:
        frozen_modules.append(embeddings)
    frozen_modules += [module for name, module in body.named_modules()
                       if _below_blocks(name) and not name.startswith(blocks_name + ".")]
    frozen_ids = {id(p) for module in frozen_modules for p in module.parameters()}
    names = []
    for name, param in body.named_parameters():
        if id(param) in frozen_ids:
            param.requires_grad_(False)
            names.append(name)
    return names


def release_input_gradients(body: nn.Module) -> None:
    """Undo transformers' ``enable_input_require_grads``, which turning activation checkpointing on
    calls for every model that reads ``input_ids``: it marks the embeddings' output as needing a
    gradient, so the backward pass would run through every frozen block again. Transformers'
    checkpointing is non-reentrant by default, and trains the blocks above without that mark."""
    if hasattr(body, "disable_input_require_grads"):
        body.disable_input_require_grads()
