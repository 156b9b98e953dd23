"""The data preamble of steps 1, 2 and DPO: the checks of ``--max_seq_len`` against the pairs and the
model, the tokenizer, the phase's (train, eval) datasets (built once and cached for all ranks,
:func:`dschat.data.prompt_dataset.create_prompt_dataset`) and their loaders
(:mod:`dschat.training.loaders`). Step 3 shares the tokenizer's special token and :func:`prompt_datasets`."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

from torch.utils.data import DataLoader

from dschat.data.prompt_dataset import create_prompt_dataset
from dschat.data.token_dataset import PromptDataset
from dschat.models.families import POSITION_TABLE_MODEL_TYPES
from dschat.models.registry import check_pair_seq_len, check_seq_len_fits_positions
from dschat.models.tokenizer import EOT_SPECIAL_TOKEN, end_of_conversation_text, load_hf_tokenizer
from dschat.training.loaders import make_eval_loader, make_train_loader

__all__ = ["POSITION_TABLE_MODEL_TYPES", "StepData", "build_step_data", "check_pair_seq_len",
           "check_seq_len_fits_positions", "load_step_tokenizer", "load_tokenizer", "prompt_datasets"]

@dataclass(frozen=True)
class StepData:
    """A step's tokenizer, the text ending every training sample, and its loaders (a seeded
    ``DistributedSampler`` each: call ``set_epoch`` every epoch)."""

    tokenizer: Any
    end_of_conversation_token: str
    train_loader: DataLoader
    eval_loader: DataLoader


def build_step_data(args: argparse.Namespace, local_rank: int, *, phase: int, collator: Callable | None,
                    eot_special_token: str = EOT_SPECIAL_TOKEN) -> StepData:
    """Tokenizer, the ``phase`` chunk of every ``--data_path`` dataset (and, in step 1, the
    ``--sft_only_data_path`` ones), and the train / eval loaders of ``--per_device_train_batch_size``
    / ``--per_device_eval_batch_size`` rows batched by ``collator``."""
    tokenizer, end_of_conversation_token = load_step_tokenizer(args, eot_special_token)
    train_dataset, eval_dataset = prompt_datasets(args, tokenizer, local_rank, phase, end_of_conversation_token,
                                                  args.max_seq_len)
    return StepData(
        tokenizer, end_of_conversation_token,
        make_train_loader(train_dataset, args.per_device_train_batch_size, collator, args.seed),
        make_eval_loader(eval_dataset, args.per_device_eval_batch_size, collator),
    )


def prompt_datasets(args: argparse.Namespace, tokenizer: Any, local_rank: int, phase: int,
                    end_of_conversation_token: str | None, max_seq_len: int) -> tuple[PromptDataset, PromptDataset]:
    """The (train, eval) datasets of ``phase`` from the data flags (``--data_path``, ``--data_split``,
    ``--data_output_path``, ``--seed``, ``--rebuild_data_cache``; ``--sft_only_data_path`` where the
    step has it)."""
    return create_prompt_dataset(
        local_rank, args.data_path, args.data_split, args.data_output_path, phase, args.seed, tokenizer,
        max_seq_len, end_of_conversation_token=end_of_conversation_token,
        sft_only_data_path=getattr(args, "sft_only_data_path", ()), reload=args.rebuild_data_cache,
    )


def load_tokenizer(model_path: str, add_eot_token: bool, eot_special_token: str = EOT_SPECIAL_TOKEN) -> Any:
    """The fast tokenizer of ``model_path``; ``--add_eot_token`` adds ``eot_special_token`` as an
    additional special token (upstream)."""
    return load_hf_tokenizer(model_path, fast_tokenizer=True,
                             add_special_tokens=eot_special_token if add_eot_token else None)


def load_step_tokenizer(args: argparse.Namespace, eot_special_token: str = EOT_SPECIAL_TOKEN) -> tuple[Any, str]:
    """The tokenizer and the end-of-conversation text appended to every training sample.

    ``--add_eot_token`` adds ``eot_special_token`` as an additional special token (upstream). The
    end-of-conversation text is ``--end_of_conversation_token`` if given, else the tokenizer's EOS,
    in every step: the SFT model learns to stop with the token the reward model scores and the
    PPO actor ends with (docs/upstream.md#flags-and-defaults).
    """
    tokenizer = load_tokenizer(args.model_name_or_path, args.add_eot_token, eot_special_token)
    return tokenizer, end_of_conversation_text(tokenizer, args.end_of_conversation_token, args.model_name_or_path)
