"""``RewardModel``: a transformer body plus a scalar value head, scored at the sequence end.

As upstream: ``v_head`` (hidden -> 1, no bias) reads every position; step 2 trains it with the
pairwise loss from the first token where chosen and rejected differ to the end of the longer
one; the score of a sequence is the value at its last token.

The last token is the right-most position of the attention mask, so an EOS that shares the pad id
is part of the sequence and is the scored token. Without an attention mask the last token is found
by upstream's pad rule: skip ``num_padding_at_beginning`` leading pads, the first pad after them
ends the sequence. Upstream always used the pad rule: docs/upstream.md#pad-and-eos.

Three folder formats are read (``critic_format``): dschat's (a Hugging Face body folder plus
``v_head.safetensors``, what step 2 writes), upstream DeepSpeed-Chat's (one
``pytorch_model.bin`` holding the whole RewardModel state dict: ``rwtransformer.*`` body keys and
``v_head.weight``, LoRA fused) and a Hugging Face sequence classifier with one label
(``*ForSequenceClassification`` in its config's ``architectures``, safetensors weights): its body
(the keys under the class's ``base_model_prefix``) is the body and its ``score`` row (1, H) the value
head, so its end score is the classifier's logit at the last real token.
"""
from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from dschat.rl_math.preference import pairwise_read_ends, pairwise_reward_loss, upstream_end_indices
from dschat.errors import UserError, cannot_read, first_keys, first_line
from dschat.models.families import value_head_dim
from dschat.models.packing import padded_pass_inputs
from dschat.paths import UPSTREAM_WEIGHTS_FILE, VALUE_HEAD_FILE

__all__ = [
    "VALUE_HEAD_FILE",
    "VALUE_HEAD_KEY",
    "BODY_PREFIX",
    "value_head_file",
    "critic_format",
    "not_a_critic_message",
    "load_upstream_state",
    "split_upstream_state",
    "is_reward_model_folder",
    "refuse_reward_model",
    "check_upstream_critic",
    "CLASSIFIER_HEAD_KEY",
    "classifier_labels",
    "check_classifier",
    "load_classifier_state",
    "split_classifier_state",
    "check_critic_folder",
    "positions_from_mask",
    "last_token_index",
    "RewardModel",
    "load_value_head",
    "copy_value_head",
]

VALUE_HEAD_KEY = "v_head.weight"
# Upstream's step-2 output, UPSTREAM_WEIGHTS_FILE: torch.save(RewardModel.state_dict()) (save_hf_format).
BODY_PREFIX = "rwtransformer."


#: The one-row head of a Hugging Face ``*ForSequenceClassification`` model (LLaMA, OPT, Qwen2, ...).
CLASSIFIER_HEAD_KEY = "score.weight"
_CLASSIFIER_SUFFIX = "ForSequenceClassification"


def value_head_file(folder: str | Path) -> Path:
    return Path(folder) / VALUE_HEAD_FILE


def _config_json(folder: str | Path) -> dict[str, Any]:
    try:
        data = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def critic_format(folder: str | Path) -> str | None:
    """``"dschat"`` (``v_head.safetensors`` beside the body), ``"upstream"`` (DeepSpeed-Chat's
    ``pytorch_model.bin`` with the value head inside), ``"classifier"`` (a Hugging Face
    ``*ForSequenceClassification`` folder, any number of labels: :func:`check_classifier` refuses
    more than one) or None (not a reward model)."""
    if value_head_file(folder).is_file():
        return "dschat"
    if (Path(folder) / UPSTREAM_WEIGHTS_FILE).is_file():
        return "upstream"
    architectures = _config_json(folder).get("architectures") or []
    if any(isinstance(a, str) and a.endswith(_CLASSIFIER_SUFFIX) for a in architectures):
        return "classifier"
    return None


def classifier_labels(folder: str | Path) -> int:
    """The number of labels of a sequence-classifier folder, as transformers counts them: the
    ``id2label`` entries its config saves (transformers' default is 2)."""
    config = _config_json(folder)
    if isinstance(config.get("id2label"), dict):
        return len(config["id2label"])
    return int(config.get("num_labels", 2))


def check_classifier(folder: str | Path) -> None:
    """Refuse, in one line naming the folder and the fix, a sequence classifier that is not a reward
    model: more than one label (a reward is one number per answer)."""
    labels = classifier_labels(folder)
    if labels != 1:
        raise UserError(
            f"{folder} is a sequence classifier with num_labels {labels}; a reward model gives one score per "
            "answer: pass a classifier saved with num_labels=1 (a reward model, e.g. "
            "AutoModelForSequenceClassification.from_pretrained(..., num_labels=1) trained on preferences) or "
            "a step-2 output folder"
        )


def load_classifier_state(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sequence-classifier folder's safetensors weights (one file, or the shards its
    ``model.safetensors.index.json`` lists). A folder without them is one :class:`UserError` line."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise UserError(f"sequence classifier {folder} has no model.safetensors (nor an index of shards); save it "
                        "with save_pretrained(..., safe_serialization=True)")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(read_safetensors(folder / name))
    return state


def read_safetensors(file: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors ``file``; a missing, damaged or truncated one is one
    :class:`UserError` line naming it."""
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as err:
        try:  # safetensors reports a file it may not open as missing
            open(file, "rb").close()
        except PermissionError as denied:
            raise cannot_read(file, denied) from None
        except OSError:
            pass
        raise UserError(f"cannot read {file} ({type(err).__name__}: {first_line(err)}): the file is missing, damaged "
                        "or not safetensors; copy or save the model again") from None


def split_classifier_state(state: dict[str, torch.Tensor], prefix: str,
                           where: str | Path) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The body keys (``prefix.`` stripped: the class's ``base_model_prefix``) and the ``score.weight``
    row (1, H) of a one-label sequence classifier's state dict. A bias on the score layer, or a key
    that is neither, is a :class:`UserError` naming the keys (the value head has no bias)."""
    body_prefix = prefix + "."
    stray = sorted(k for k in state if k != CLASSIFIER_HEAD_KEY and not k.startswith(body_prefix))
    head = state.get(CLASSIFIER_HEAD_KEY)
    if stray or head is None or head.dim() != 2 or head.shape[0] != 1:
        problem = (f"keys that are neither {CLASSIFIER_HEAD_KEY} nor {body_prefix}*: {first_keys(stray)}" if stray
                   else f"no one-row {CLASSIFIER_HEAD_KEY}")
        raise UserError(f"sequence classifier {where} cannot be read as a reward model: it has {problem}; pass a "
                        "one-label *ForSequenceClassification folder whose score layer has no bias")
    body = {k[len(body_prefix):]: v for k, v in state.items() if k.startswith(body_prefix)}
    return body, head


def check_critic_folder(folder: str | Path, name: str, flag: str) -> str:
    """The :func:`critic_format` of ``folder`` (``name`` as the user gave it), refusing one that is no
    reward model, an upstream file without a value head, or a multi-label classifier; cheap (upstream
    keys memory-mapped, a classifier's config only)."""
    fmt = critic_format(folder)
    if fmt is None:
        raise UserError(not_a_critic_message(name, flag))
    if fmt == "upstream":
        check_upstream_critic(folder)
    if fmt == "classifier":
        check_classifier(folder)
    return fmt


def not_a_critic_message(name: str, flag: str | None = None) -> str:
    """The one line for a folder that holds neither format."""
    what = f"{flag} {name!r}" if flag else f"critic/reward path {name!r}"
    return (
        f"{what} is not a step-2 reward model output: it has neither {VALUE_HEAD_FILE} (a dschat step-2 "
        f"output) nor {UPSTREAM_WEIGHTS_FILE} (an upstream DeepSpeed-Chat step-2 output), nor is it a "
        "*ForSequenceClassification folder; pass the --output_dir of training/step2_reward_model_finetuning/main.py"
    )


def load_upstream_state(folder: str | Path) -> dict[str, torch.Tensor]:
    """``pytorch_model.bin`` of an upstream step-2 folder, tensors only (``weights_only=True``).

    Memory-mapped when the file is in torch's zip format (every torch >= 1.6 save), so reading
    it on each rank, or only for its keys, costs little.
    """
    file = Path(folder) / UPSTREAM_WEIGHTS_FILE
    mmap = zipfile.is_zipfile(file)
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # noqa: BLE001 - a pickle with objects other than tensors, a damaged file
        reason = first_line(err)
        raise UserError(
            f"cannot read {file} as a tensor state dict ({type(err).__name__}: {reason}); "
            "pass an upstream DeepSpeed-Chat step-2 output (torch.save of the reward model's state_dict)"
        ) from err
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{file} is not a state dict of tensors; pass an upstream DeepSpeed-Chat step-2 output")
    return state


def split_upstream_state(
    state: dict[str, torch.Tensor], where: str | Path
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``rwtransformer.*`` keys (prefix stripped) and ``v_head.weight`` of an upstream state dict.

    Every key must be one of the two; anything else (a step-1 causal LM's ``model.*`` /
    ``lm_head.weight``, left-over LoRA factors) is a :class:`UserError` naming the keys.
    """

    stray = sorted(k for k in state if k != VALUE_HEAD_KEY and not k.startswith(BODY_PREFIX))
    if stray or VALUE_HEAD_KEY not in state:
        problem = (f"keys that are neither {VALUE_HEAD_KEY} nor {BODY_PREFIX}*: {first_keys(stray)}" if stray
                   else f"no {VALUE_HEAD_KEY}")
        hint = " (a step-1 causal LM, not a reward model?)" if "lm_head.weight" in state else ""
        raise UserError(
            f"{Path(where) / UPSTREAM_WEIGHTS_FILE} is not an upstream step-2 reward model{hint}: it has {problem}; "
            "pass the --output_dir of upstream's or dschat's step 2"
        )
    body = {k[len(BODY_PREFIX):]: v for k, v in state.items() if k.startswith(BODY_PREFIX)}
    return body, state[VALUE_HEAD_KEY]


def is_reward_model_folder(folder: str | Path, mapped_only: bool = False) -> bool:
    """Whether ``folder`` is a reward model: a step-2 output, dschat's or upstream's, or a sequence
    classifier (of any number of labels: :func:`check_classifier` refuses more than one). An upstream
    step-1 folder has a ``pytorch_model.bin`` too: its keys (memory-mapped) tell the two apart.
    ``mapped_only``: a ``pytorch_model.bin`` in torch's pre-1.6 format, which loads whole, is not read
    (the answer is then False)."""
    fmt = critic_format(folder)
    if fmt != "upstream":
        return fmt in ("dschat", "classifier")
    if mapped_only and not zipfile.is_zipfile(Path(folder) / UPSTREAM_WEIGHTS_FILE):
        return False
    try:
        return VALUE_HEAD_KEY in load_upstream_state(folder)
    except UserError:
        return False


def refuse_reward_model(folder: str | Path, what: str, instead: str, mapped_only: bool = False) -> None:
    """One :class:`UserError` line when ``folder`` (a resolved path; not a folder: nothing to check)
    is a reward model where a causal LM is wanted: it has no language-model head, and transformers
    would draw one at random. ``what`` names the input (``--flag value`` or the path), ``instead``
    says what to pass; ``mapped_only`` as in :func:`is_reward_model_folder`."""
    if Path(folder).is_dir() and is_reward_model_folder(folder, mapped_only):
        raise UserError(f"{what} is a reward model (a step-2 output or a sequence classifier), which has no "
                        f"language-model head; {instead}")


def check_upstream_critic(folder: str | Path) -> None:
    """Cheap check of an upstream-format critic folder (keys only, the file memory-mapped)."""
    split_upstream_state(load_upstream_state(folder), folder)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count only real tokens, so left padding does not shift positions.

    Shape: (B, T) -> (B, T). Padding positions get 0 (they are masked anyway).
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the right-most real token of each row. Shape: (B, T) -> (B,)."""
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    return (attention_mask.long() * positions).argmax(-1)


class RewardModel(nn.Module):
    def __init__(
        self,
        base_model: nn.Module,
        tokenizer: Any,
        num_padding_at_beginning: int = 0,
        compute_fp32_loss: bool = False,
    ):
        super().__init__()
        self.config = base_model.config
        self.num_padding_at_beginning = num_padding_at_beginning
        # In the body's dtype: a body built under ZeRO-3 (zero.Init) already holds fp16/bf16 weights
        # that DeepSpeed will not cast, and its ZeRO-3 optimizer refuses trainable parameters of
        # mixed dtypes (an AssertionError in ``defragment``, seen at fp16/bf16 on a GPU).
        body_dtype = next(base_model.parameters()).dtype
        self.v_head = nn.Linear(value_head_dim(self.config), 1, bias=False,
                                dtype=body_dtype if body_dtype.is_floating_point else None)
        self.rwtransformer = base_model
        self.PAD_ID = tokenizer.pad_token_id
        self.compute_fp32_loss = compute_fp32_loss
        # A Hugging Face sequence classifier (set by create_critic_model): read through its tokenizer's
        # chat template when it scores another tokenizer's text (dschat.models.reward_inputs); a step-2
        # model was trained on the dataset's text as it is.
        self.reads_chat_template = False

    def gradient_checkpointing_enable(self, **kwargs: Any) -> None:
        self.rwtransformer.gradient_checkpointing_enable(**kwargs)

    def gradient_checkpointing_disable(self) -> None:
        self.rwtransformer.gradient_checkpointing_disable()

    def _values(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        past_key_values: Any,
        inputs_embeds: torch.Tensor | None,
        use_cache: bool,
    ) -> torch.Tensor:
        if position_ids is None and attention_mask is not None:
            position_ids = positions_from_mask(attention_mask)
        kwargs: dict[str, Any] = {"attention_mask": attention_mask, "position_ids": position_ids, "use_cache": use_cache}
        if past_key_values is not None:
            kwargs["past_key_values"] = past_key_values
        if inputs_embeds is not None:
            kwargs["inputs_embeds"] = inputs_embeds
        else:
            kwargs["input_ids"] = input_ids
        hidden = self.rwtransformer(**kwargs)[0]  # (B, T, H)
        return self.v_head(hidden).squeeze(-1)  # (B, T)

    def _ends(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """One past the last scored token of each row (upstream's ``c_ind``)."""
        if attention_mask is not None:
            return last_token_index(attention_mask) + 1
        return upstream_end_indices(input_ids, self.PAD_ID, self.num_padding_at_beginning)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        head_mask: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool = False,
        sequence_packing: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Pairwise loss on a batch ``[chosen_1..B; rejected_1..B]`` (DataCollatorReward's layout).

        Returns ``loss`` and the end scores ``chosen_mean_scores`` / ``rejected_mean_scores``
        (upstream's names: they are the values at the last token, not means). ``sequence_packing``
        (dschat, step 2's ``--sequence_packing``): computed on packed rows where
        :meth:`packed_pair_forward` applies to the batch. Either way the pass runs through this
        forward and the same submodules in the same order, which ZeRO-3 needs of every rank.
        """
        if head_mask is not None:
            raise ValueError("head_mask is not supported by transformers >= 5 models")
        if sequence_packing and attention_mask is not None and input_ids is not None and past_key_values is None \
                and position_ids is None and inputs_embeds is None:
            packed = self.packed_pair_forward(input_ids, attention_mask)
            if packed is not None:
                return packed
        values = self._values(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache)
        return self._pair_loss(values, input_ids, attention_mask)

    def _pair_loss(self, values: torch.Tensor, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
        if self.compute_fp32_loss:
            values = values.float()
        bs = input_ids.shape[0] // 2
        ends = self._ends(input_ids, attention_mask)
        result = pairwise_reward_loss(
            values[:bs], values[bs:], input_ids[:bs], input_ids[bs:], ends[:bs], ends[bs:]
        )
        return {
            "loss": result.loss,
            "chosen_mean_scores": result.chosen_end_scores,
            "rejected_mean_scores": result.rejected_end_scores,
        }

    def packed_pair_forward(self, input_ids: torch.Tensor,
                            attention_mask: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """:meth:`forward`'s loss and scores of a right-padded ``[chosen; rejected]`` batch (2B, L),
        computed on packed rows (``--sequence_packing`` in step 2): each row's real tokens and the
        padding the loss reads (to the end of the longer answer of its pair) end to end,
        with the padded pass's positions and attention (:func:`~dschat.models.packing.padded_pass_inputs`),
        so the results are :meth:`forward`'s up to floating-point reordering. None where packing does
        not apply to this batch (left padding, or no cheaper layout). Training calls it through
        ``forward(..., sequence_packing=True)``, which falls back to the padded pass.
        """
        if not bool(attention_mask[:, 0].all()):
            return None
        bs = input_ids.shape[0] // 2
        ends = self._ends(input_ids, attention_mask)
        pair_end = pairwise_read_ends(input_ids[:bs], input_ids[bs:], ends[:bs], ends[bs:])
        compute = torch.arange(input_ids.shape[1], device=input_ids.device) < pair_end.repeat(2)[:, None]
        found = padded_pass_inputs(input_ids, positions_from_mask(attention_mask), attention_mask, compute, self)
        if found is None:
            return None
        packed, inputs = found
        values = packed.unpack(self.v_head(self.rwtransformer(**inputs)[0]).squeeze(-1))
        return self._pair_loss(values, input_ids, attention_mask)

    def forward_value(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        position_ids: torch.Tensor | None = None,
        head_mask: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        return_value_only: bool = False,
        prompt_length: int = 0,
        use_cache: bool = False,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Per-token values (B, T), and with ``return_value_only=False`` the end scores (B,).

        The end score is the value at the last real token after ``prompt_length`` (with a mask:
        the right-most unmasked position; without: upstream's first-pad rule).
        """
        if head_mask is not None:
            raise ValueError("head_mask is not supported by transformers >= 5 models")
        values = self._values(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache)
        if return_value_only:
            return values
        if prompt_length <= 1:
            raise ValueError(f"prompt_length must be > 1 (got {prompt_length}), as upstream asserts")
        if attention_mask is not None:
            end = last_token_index(attention_mask)
        else:
            # Upstream: the first pad at or after the prompt ends the answer (else the row end).
            answer = input_ids[:, prompt_length:]
            end = prompt_length + upstream_end_indices(answer, self.PAD_ID, 0) - 1
        chosen_end_scores = values.gather(1, end.unsqueeze(1)).squeeze(1)
        return {"values": values, "chosen_end_scores": chosen_end_scores}


def load_value_head(model: RewardModel, folder: str | Path) -> None:
    """Load ``v_head.weight`` from a dschat step-2 folder, refusing a damaged file, any other key or shape."""
    state = read_safetensors(value_head_file(folder))
    if set(state) != {VALUE_HEAD_KEY}:
        raise UserError(
            f"{value_head_file(folder)} holds keys {sorted(state)}, expected ['{VALUE_HEAD_KEY}']; "
            "pass a folder written by step 2"
        )
    copy_value_head(model, state[VALUE_HEAD_KEY], folder)


def copy_value_head(model: RewardModel, weight: torch.Tensor, folder: str | Path) -> None:
    """Copy a saved ``v_head.weight`` into ``model`` (a plain, not yet partitioned, Linear)."""
    if tuple(weight.shape) != tuple(model.v_head.weight.shape):
        raise UserError(
            f"value head in {folder} has shape {tuple(weight.shape)}, the model needs "
            f"{tuple(model.v_head.weight.shape)}; the critic folder belongs to a different model"
        )
    with torch.no_grad():
        model.v_head.weight.copy_(weight.to(model.v_head.weight.dtype))
