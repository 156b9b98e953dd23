"""The README.md dschat writes into every ``lora_adapter/`` folder: what the adapter holds and code
that loads it as the trained model (PEFT on its base; a resize first when the run grew the
vocabulary; dschat's loader for a base in upstream's step-2 layout, which AutoModel does not read)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from dschat.models.reward_model import critic_format
from dschat.paths import is_adapter_folder

if TYPE_CHECKING:  # the export's type, from the module that writes the card
    from dschat.models.peft_adapter import AdapterExport

__all__ = ["adapter_card"]


_CARD = """# LoRA adapter ({task})

Written by dschat beside the merged model in `..` (same weights as base + this adapter).

- base model: `{base}`{base_note}
- rank {r}, lora_alpha {alpha} (scaling {scaling}), target modules: {targets}
- also saved: {extra}

```python
{code}
```
"""

_CAUSAL_CODE = """from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

base = AutoModelForCausalLM.from_pretrained("{base}"){resize}
model = PeftModel.from_pretrained(base, "{folder}")  # .merge_and_unload() for a plain model
tokenizer = AutoTokenizer.from_pretrained("{folder}")"""

_REWARD_CODE = """from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModel

base = AutoModel.from_pretrained("{base}"){resize}
body = PeftModel.from_pretrained(base, "{folder}")
v_head = load_file("{folder}/v_head.safetensors")["v_head.weight"]  # (1, hidden)
# score of a sequence: the value at its last token
values = body(input_ids=ids, attention_mask=mask).last_hidden_state @ v_head.T  # (batch, len, 1)
# or, with dschat: create_critic_model("{folder}", tokenizer, None, rlhf_training=True)"""

# The base is an upstream DeepSpeed-Chat step-2 output: its pytorch_model.bin holds rwtransformer.*
# keys, which AutoModel does not read (it would draw the body at random).
_UPSTREAM_REWARD_CODE = """# {base} is an upstream DeepSpeed-Chat step-2 output (pytorch_model.bin with rwtransformer.*
# keys), which transformers' AutoModel does not read: load the adapter with dschat.
from transformers import AutoTokenizer

from dschat.utils.model.model_utils import create_critic_model

tokenizer = AutoTokenizer.from_pretrained("{folder}")
critic = create_critic_model("{folder}", tokenizer, None, rlhf_training=True)"""


def _base_rows(base: str | None) -> int | None:
    """``vocab_size`` of the local base folder's ``config.json`` (None: not a local folder, or none)."""
    try:
        data = json.loads((Path(base) / "config.json").read_text(encoding="utf-8")) if base else None
    except (OSError, ValueError):
        return None
    rows = data.get("vocab_size") if isinstance(data, dict) else None
    return rows if isinstance(rows, int) and not isinstance(rows, bool) else None


def _resize_line(export: AdapterExport, base_rows: int | None) -> str:
    """The README's lines resizing the base's embeddings to the trained model's rows when the run
    resized them (grown by ``--add_eot_token`` or rounded up to a multiple of 8; step 3 may also cut a
    larger table to its tokenizer's length): PEFT refuses saved embeddings of another size, and an
    adapter without them (``--only_optimize_lora``) lacks grown rows, which only the merged model has.
    ``base_rows`` None (a hub id: its config is not read here): the code checks the base it loaded."""
    rows = export.vocab_rows
    if rows is None or rows == base_rows:
        return ""
    saved = any(".modules_to_save." in key and "embed" in key for key in export.tensors)
    lacks = "" if saved else "base + adapter is not the trained model; load the merged model in `..`"
    if base_rows is None:
        note = (f"\n# If the run grew them, this adapter lacks the new rows (--only_optimize_lora): {lacks}."
                if lacks else "")
        return (f"{note}\nif base.get_input_embeddings().weight.shape[0] != {rows}:  # the run resized the "
                f"embeddings\n    base.resize_token_embeddings({rows})")
    if lacks and rows > base_rows:
        return (f"\n# The run grew the embeddings ({base_rows} -> {rows} rows: --add_eot_token, or rounded up to a "
                f"multiple of 8),\n# and this adapter does not hold them (--only_optimize_lora): {lacks}."
                f"\nbase.resize_token_embeddings({rows})")
    return (f"\nbase.resize_token_embeddings({rows})  # the run resized the embeddings: {base_rows} -> {rows} "
            "rows")


def _upstream_layout(base: str) -> bool:
    """Whether the local folder ``base`` holds its weights only as upstream's step-2 ``pytorch_model.bin``
    (``rwtransformer.*``): no ``model.safetensors`` for AutoModel to read instead."""
    folder = Path(base)
    return (critic_format(folder) == "upstream" and not (folder / "model.safetensors").is_file()
            and not (folder / "model.safetensors.index.json").is_file())


def adapter_card(export: AdapterExport) -> str:
    """The adapter folder's README.md: what it holds and how to load it."""
    s = export.settings
    extra = ", ".join(filter(None, [
        f"modules {s['modules_to_save']}" if s["modules_to_save"] else "",
        "the LoRA layers' biases" if s["bias"] == "lora_only" else "",
        "the value head (v_head.safetensors)" if export.value_head is not None else "",
    ])) or "nothing else (LoRA factors only: the form LoRA servers such as vLLM load)"
    base = s["base_model_name_or_path"]
    # A LoRA trained on a merged adapter: that adapter is the base, to merge into its own base first.
    base_note = (" (itself a LoRA adapter: load it merged, PeftModel.from_pretrained(its base, it)"
                 ".merge_and_unload(), as its README shows)" if base and is_adapter_folder(base) else "")
    template = _REWARD_CODE if export.value_head is not None else _CAUSAL_CODE
    if export.value_head is not None and base and _upstream_layout(base):
        template = _UPSTREAM_REWARD_CODE
    code = template.format(base=base, folder="path/to/lora_adapter",
                           resize=_resize_line(export, _base_rows(base)))
    return _CARD.format(task="reward model body" if export.value_head is not None else "causal LM",
                        base=base, base_note=base_note, r=s["r"], alpha=s["lora_alpha"],
                        scaling=s["lora_alpha"] / s["r"], targets=", ".join(s["target_modules"]),
                        extra=extra, code=code)
