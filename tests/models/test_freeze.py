"""--freeze_layers (dschat.models.freeze): on tiny random bodies of several families, the frozen
parameters get no gradient, every parameter left trainable gets one, and the backward pass stops at
the first trainable block (its input needs no gradient); bad counts are one line."""
from __future__ import annotations

import pytest
import torch
from transformers import (
    BloomConfig,
    BloomModel,
    GPT2Config,
    GPT2Model,
    GPTNeoXConfig,
    GPTNeoXModel,
    LlamaConfig,
    LlamaModel,
    OPTConfig,
    OPTModel,
    Qwen2Config,
    Qwen2Model,
)

from dschat.errors import UserError
from dschat.models.freeze import freeze_lower_layers, release_input_gradients, transformer_blocks

LAYERS = 3


def _bodies() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    small = dict(vocab_size=64)
    return {
        "llama": LlamaModel(LlamaConfig(**small, hidden_size=16, intermediate_size=32, num_hidden_layers=LAYERS,
                                        num_attention_heads=2)),
        "qwen2": Qwen2Model(Qwen2Config(**small, hidden_size=16, intermediate_size=32, num_hidden_layers=LAYERS,
                                        num_attention_heads=2, num_key_value_heads=1)),
        # word_embed_proj_dim != hidden_size: OPT's project_in runs below the blocks, project_out above
        "opt": OPTModel(OPTConfig(**small, hidden_size=16, ffn_dim=32, num_hidden_layers=LAYERS, num_attention_heads=2,
                                  word_embed_proj_dim=8, max_position_embeddings=64)),
        "gpt2": GPT2Model(GPT2Config(**small, n_embd=16, n_layer=LAYERS, n_head=2, n_positions=64)),
        "bloom": BloomModel(BloomConfig(**small, hidden_size=16, n_layer=LAYERS, n_head=2)),
        "gpt_neox": GPTNeoXModel(GPTNeoXConfig(**small, hidden_size=16, intermediate_size=32,
                                               num_hidden_layers=LAYERS, num_attention_heads=2)),
    }


BODIES = _bodies()


@pytest.mark.parametrize("family", list(BODIES))
@pytest.mark.parametrize("frozen", [1, LAYERS])
def test_the_backward_pass_stops_at_the_first_trainable_block(family, frozen):
    body = _bodies()[family]  # fresh: freezing changes requires_grad
    names = freeze_lower_layers(body, frozen)
    _, blocks = transformer_blocks(body)
    assert len(blocks) == LAYERS
    block_params = {id(p) for i in range(frozen) for p in blocks[i].parameters()}
    embedding_params = {id(p) for p in body.get_input_embeddings().parameters()}
    params = dict(body.named_parameters())
    assert block_params | embedding_params <= {id(params[n]) for n in names}
    assert all(not p.requires_grad for n, p in params.items() if n in names)
    assert all(p.requires_grad for n, p in params.items() if n not in names)
    assert {id(p) for i in range(frozen, LAYERS) for p in blocks[i].parameters()}.isdisjoint(id(params[n]) for n in names)

    seen = []
    if frozen < LAYERS:
        blocks[frozen].register_forward_pre_hook(
            lambda module, args, kwargs: seen.append((args[0] if args else kwargs["hidden_states"]).requires_grad),
            with_kwargs=True)
    body.train()
    out = body(input_ids=torch.tensor([[5, 9, 11, 3, 7]]), attention_mask=torch.ones(1, 5, dtype=torch.long))
    out.last_hidden_state.pow(2).sum().backward()
    assert seen == ([False] if frozen < LAYERS else [])  # nothing below block `frozen` needs a gradient
    for name, param in params.items():
        if name in names:
            assert param.grad is None, name
        else:
            assert param.grad is not None and torch.count_nonzero(param.grad) > 0, name


@pytest.mark.parametrize("release", [False, True])
def test_with_gradient_checkpointing_the_backward_still_stops_at_the_first_trainable_block(release):
    """Turning checkpointing on makes transformers mark the embeddings' output as needing a gradient,
    which sends the backward through the frozen blocks; release_input_gradients takes the mark off, and
    the blocks above still train."""
    body = _bodies()["llama"]
    freeze_lower_layers(body, 1)
    body.gradient_checkpointing_enable()
    if release:
        release_input_gradients(body)
    _, blocks = transformer_blocks(body)
    seen = []
    blocks[1].register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((args[0] if args else kwargs["hidden_states"]).requires_grad),
        with_kwargs=True)
    body.train()
    body(input_ids=torch.tensor([[5, 9, 11, 3]])).last_hidden_state.sum().backward()
    assert seen == [not release]
    assert all(p.grad is not None for i in (1, 2) for p in blocks[i].parameters())
    assert all(p.grad is None for p in blocks[0].parameters())


def test_zero_freezes_nothing_and_bad_counts_are_one_line():
    body = _bodies()["llama"]
    assert freeze_lower_layers(body, 0) == [] and all(p.requires_grad for p in body.parameters())
    with pytest.raises(UserError, match=r"--freeze_layers 4 is more than this model's 3 transformer blocks; pass at most 3"):
        freeze_lower_layers(body, LAYERS + 1)
    with pytest.raises(UserError, match="--freeze_layers must be 0 or more"):
        freeze_lower_layers(body, -1)
    assert all(p.requires_grad for p in body.parameters())  # refused before anything was frozen


def test_the_blocks_are_the_family_path_not_any_list_ending_like_it():
    """GPT-2's blocks are ``h``: a module list named ``branch`` (ends in "h") registered before them is
    not taken for them."""
    body = _bodies()["gpt2"]
    body.branch = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    body._modules = {"branch": body._modules.pop("branch"), **body._modules}  # first in named_modules()
    assert next(name for name, m in body.named_modules() if isinstance(m, torch.nn.ModuleList)) == "branch"
    name, blocks = transformer_blocks(body)
    assert name == "h" and blocks is body.h


def test_a_model_without_the_family_block_list_is_one_line():
    class Odd(torch.nn.Module):
        config = type("Config", (), {"model_type": "odd"})()

        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)])

    with pytest.raises(UserError, match=r"cannot find the transformer blocks of this odd model \(no module list "
                                        r"named 'layers'\); pass --freeze_layers 0"):
        freeze_lower_layers(Odd(), 1)
