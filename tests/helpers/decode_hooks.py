"""Edit the next-token logits of dschat's decode model (the Hybrid Engine's ``DecodeModel``), for
tests that need turns to end at chosen positions: a random tiny model rarely ends one by itself.

:func:`edit_decode_logits` wraps ``DecodeModel.prefill`` and ``DecodeModel.step`` once, in one place,
so the tests that use it follow their signatures together."""
from __future__ import annotations

from typing import Callable

import torch

#: ``edit(logits, positions)``: (B, V) next-token logits after the (B,) positions, edited in place
LogitsEdit = Callable[[torch.Tensor, torch.Tensor], None]


def edit_decode_logits(edit: LogitsEdit, *,
                       on_prefill: Callable[[torch.Tensor], None] | None = None) -> Callable[[], None]:
    """Make every ``DecodeModel.prefill`` and ``DecodeModel.step`` pass its next-token logits through
    ``edit`` before returning them; ``on_prefill(tokens)`` sees each prefill's (B, T) input tokens.
    Returns the function that puts the two methods back."""
    from dschat.models.decoder.forward import DecodeModel

    prefill, step = DecodeModel.prefill, DecodeModel.step

    def edited_prefill(self, tokens, positions, cache, start=0):  # noqa: ANN001 -- DecodeModel.prefill's
        if on_prefill is not None:
            on_prefill(tokens)
        logits = prefill(self, tokens, positions, cache, start)
        edit(logits, positions[:, -1])
        return logits

    def edited_step(self, token, position, index, cache, kv_len):  # noqa: ANN001 -- DecodeModel.step's
        logits = step(self, token, position, index, cache, kv_len)
        edit(logits, position)
        return logits

    DecodeModel.prefill, DecodeModel.step = edited_prefill, edited_step

    def undo() -> None:
        DecodeModel.prefill, DecodeModel.step = prefill, step

    return undo
