"""Command-line flag groups more than one step script adds, defined once with upstream's names.

Each ``add_*_args(parser, ...)`` adds one argument group; per-step defaults are passed in. Names,
defaults and help follow upstream's ``main.py`` files (``training/step*/main.py``); flags that are
ours say so in their help. Step 2's own groups are in :mod:`dschat.cli.step2`, step 3's in
:mod:`dschat.cli.step3`; step 1 has none of its own.
"""
from __future__ import annotations

import argparse
import os

from dschat.errors import UserError
from dschat.multinode import DEFAULT_DIST_TIMEOUT_MINUTES
from dschat.paths import SAVE_FORMATS, data_cache_dir
from dschat.runtime.fs import resolve_output_dir


SCHEDULER_TYPES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")

DTYPE_CHOICES = ("fp16", "bf16", "fp32")


def check_seed(seed: int) -> None:
    """``--seed`` must be one NumPy (and so every generator) takes: 0 to 2**32 - 1."""
    if not 0 <= seed < 2**32:
        raise UserError(f"--seed must be from 0 to 4294967295 (2**32 - 1), got {seed}")


def user_path(value: str) -> str:
    """A path flag's value with a leading ``~`` (``~`` or ``~user``) expanded, once, at parsing: bash
    leaves ``--data_output_path=~/dc`` as it is, and a literal ``~`` would be a folder named ``~`` in
    the working directory for one reader and the home folder for another. Hub ids, dataset names and
    dschat's short names never start with ``~``, so flags that also take those use it too."""
    return os.path.expanduser(value)


def output_dir(value: str) -> str:
    """``--output_dir``: :func:`user_path`, then :func:`~dschat.runtime.fs.resolve_output_dir`."""
    return resolve_output_dir(user_path(value))


def add_data_args(parser: argparse.ArgumentParser, *, phase: int) -> argparse._ArgumentGroup:
    """Add the data flags of step ``phase`` (1 = SFT, 2 = reward model / DPO, 3 = PPO).

    ``--sft_only_data_path`` exists only in step 1, as upstream. ``--data_output_path`` defaults to
    a private folder of the user's (:func:`~dschat.paths.data_cache_dir`; docs/upstream.md#data-cache-default).
    ``--rebuild_data_cache`` is ours: it sets upstream's ``reload`` argument, which no upstream flag
    reaches.
    """
    if phase not in (1, 2, 3):
        raise ValueError(f"phase must be 1, 2 or 3, got {phase}")
    group = parser.add_argument_group("data")
    group.add_argument(
        "--data_path", nargs="*", type=user_path, default=["Dahoas/rm-static"],
        help="Path to the training dataset. Accepted format: 1) a single data path, 2) multiple "
             "datasets in the form: dataset1-path dataset2-path ... Besides the hub datasets "
             "upstream supports: dschat/builtin, local/jsonfile, a .json/.jsonl/.parquet file or "
             "folder with prompt/chosen[/rejected] columns, or a save_to_disk folder.",
    )
    group.add_argument(
        "--data_split", type=str, default="2,4,4",
        help="Comma-separated list of proportions for training phase 1, 2, and 3 data. For example "
             "the split `6,2,2` will use 60%% of data for phase 1, 20%% for phase 2 and 20%% for "
             "phase 3.",
    )
    if phase == 1:
        group.add_argument("--sft_only_data_path", nargs="*", type=user_path, default=[],
                           help="Path to the dataset for only using in SFT phase.")
    group.add_argument(
        "--data_output_path", type=user_path, default=str(data_cache_dir()),
        help="Where to store the data-related files such as the tokenised-dataset cache. May be "
             "shared by all ranks and nodes if the filesystem supports file locks: the cache is "
             "built once under a lock and written atomically. (dschat) Default: data_files in "
             "dschat's per-user cache ($DSCHAT_CACHE_DIR, else $XDG_CACHE_HOME/dschat or "
             "~/.cache/dschat), created 0700; "
             "upstream's /tmp/data_files was shared by every user of the machine. A folder or "
             "cache file that is not yours, or that others can write to, is refused.",
    )
    group.add_argument("--rebuild_data_cache", action="store_true",
                       help="(dschat) Rebuild the tokenised-dataset cache even if a matching one exists. The "
                            "cache key already covers file contents, tokenizer, split, lengths and eot token.")
    return group


def add_model_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model_name_or_path", type=user_path, required=True,
        help="Path to pretrained model or model identifier from huggingface.co/models. Also a "
             "dschat short name: smollm2-135m (embedded SmolLM2-135M-Instruct), tiny-llama, "
             "tiny-opt, tiny-opt-quirk (tiny random models for tests), or a PEFT LoRA adapter folder "
             "(its base model, the adapter merged).",
    )
    group.add_argument("--dropout", type=float, default=None,
                       help="If dropout configured, use it. Otherwise, keep the default dropout configuration of the model.")
    return group


def add_training_args(
    parser: argparse.ArgumentParser, *, learning_rate: float, max_seq_len: int = 512
) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("training")
    group.add_argument("--per_device_train_batch_size", type=int, default=16,
                       help="Batch size (per device) for the training dataloader.")
    group.add_argument("--per_device_eval_batch_size", type=int, default=16,
                       help="Batch size (per device) for the evaluation dataloader.")
    group.add_argument("--max_seq_len", type=int, default=max_seq_len, help="The maximum sequence length.")
    group.add_argument("--learning_rate", type=float, default=learning_rate,
                       help="Initial learning rate (after the potential warmup period) to use.")
    group.add_argument("--weight_decay", type=float, default=0.0, help="Weight decay to use.")
    group.add_argument("--num_train_epochs", type=int, default=1, help="Total number of training epochs to perform.")
    group.add_argument("--gradient_accumulation_steps", type=int, default=1,
                       help="Number of updates steps to accumulate before performing a backward/update pass.")
    group.add_argument("--lr_scheduler_type", type=str, default="cosine", choices=SCHEDULER_TYPES,
                       help="The scheduler type to use.")
    group.add_argument("--num_warmup_steps", type=int, default=0,
                       help="Number of steps for the warmup in the lr scheduler.")
    group.add_argument("--gradient_checkpointing", action="store_true", help="Enable HF gradient checkpointing for model.")
    group.add_argument("--max_train_steps", type=int, default=0,
                       help="(dschat) Stop after this many optimizer steps (0: no limit). The LR "
                            "schedule is laid out over the steps actually taken.")
    return group


def add_runtime_args(parser: argparse.ArgumentParser, *, seed: int | None = 1234) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("runtime")
    group.add_argument("--output_dir", type=output_dir, default=None,
                       help="Where to store the model. A symlink is followed: the output lands where it points "
                            "and the link stays. On many nodes, a folder every node shares (docs/checkpoints.md).")
    group.add_argument("--save_format", choices=SAVE_FORMATS, default="safetensors",
                       help="(dschat) Weight files of the saved model: safetensors (model.safetensors; a reward "
                            "model's value head in v_head.safetensors), bin (upstream's layout: pytorch_model.bin, a "
                            "plain tensor state dict; a reward model's body and value head in one file), or both. "
                            "Every dschat reader takes either.")
    group.add_argument("--seed", type=int, default=seed, help="A seed for reproducible training.")
    group.add_argument("--local_rank", type=int, default=-1,
                       help="local_rank for distributed training on gpus (set by the deepspeed launcher).")
    group.add_argument("--debug", action="store_true", help="(dschat) Show full tracebacks for input errors instead of one line.")
    group.add_argument("--dist_timeout", type=float, default=DEFAULT_DIST_TIMEOUT_MINUTES, metavar="MINUTES",
                       help="(dschat) How long the ranks wait for each other at start-up (the rendezvous at "
                            "MASTER_ADDR:MASTER_PORT); a rank whose peers never come stops with one line naming "
                            "them. Collectives later wait this long or DeepSpeed's DEEPSPEED_TIMEOUT (default "
                            "10 minutes), whichever is longer; step 3's collectives with --env, --reward_fn, --reward_url "
                            "or a function --eval_judge wait at least that code's longest stretch plus 5 minutes, so "
                            "that a rank whose call times out stops the run with its own line. Under an MPI launch (no RANK "
                            "set before start-up), start-up waits that collective time too. Fractions allowed.")
    return group


def add_checkpoint_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """(dschat) Checkpoints and resume; see :mod:`dschat.training.checkpoint`."""
    group = parser.add_argument_group("checkpoints and resume (dschat)")
    group.add_argument("--save_interval", type=int, default=0,
                       help="(dschat) Save a resumable checkpoint to <output_dir>/checkpoints every N optimizer "
                            "steps (step 3: PPO iterations; 0: none; upstream saved nothing resumable).")
    group.add_argument("--keep_checkpoints", type=int, default=2, help="(dschat) Keep the K last written checkpoints, delete older ones.")
    group.add_argument("--resume", action="store_true",
                       help="(dschat) Continue from the last written complete checkpoint in <output_dir>/checkpoints "
                            "(start from scratch, with a notice, when there is none).")
    group.add_argument("--resume_from", type=user_path, default=None,
                       help="(dschat) Continue from this checkpoint folder (<output_dir>/checkpoints/step_<N>, N "
                            "zero-padded to 8 digits, such as step_00000050).")
    group.add_argument("--max_nonfinite_steps", type=int, default=10,
                       help="(dschat) A micro-step whose loss is NaN/inf on any rank, or an optimizer step with "
                            "NaN/inf gradients, is skipped and logged; stop with an error naming the last good "
                            "checkpoint after this many in a row (0: never stop). fp16 loss-scale overflows "
                            "stay DeepSpeed's and do not count. Weights that an update turned NaN/inf stop the "
                            "run at the next checkpoint whatever this is: they are never checkpointed.")
    return group


def add_precision_args(parser: argparse.ArgumentParser, *, zero_stage: bool = True) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("precision and ZeRO")
    group.add_argument("--offload", action="store_true", help="Enable ZeRO Offload techniques.")
    group.add_argument("--dtype", type=str, default="fp16", choices=DTYPE_CHOICES,
                       help="Training data type. fp32 is dschat's addition; on a CPU, fp16 falls back "
                            "to fp32 with one warning.")
    if zero_stage:
        group.add_argument("--zero_stage", type=int, default=0, help="ZeRO optimization stage for Actor model (and clones).")
    group.add_argument("--compute_fp32_loss", action="store_true",
                       help="Relevant for low precision dtypes (fp16, bf16, etc.). If specified, loss is "
                            "calculated in fp32.")
    return group


def add_lora_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("LoRA")
    group.add_argument("--lora_dim", type=int, default=0,
                       help="If > 0, use LoRA for efficient training. (dschat) The output folder then also "
                            "holds the LoRA as a PEFT adapter, in lora_adapter/.")
    group.add_argument("--lora_module_name", type=str, default="decoder.layers.",
                       help="The scope of LoRA (substring of Linear module names; OPT: "
                            "'decoder.layers.', LLaMA-style models: 'layers.').")
    group.add_argument("--only_optimize_lora", action="store_true",
                       help="Only optimize the LoRA parameters. (dschat) Without it the other parameters train "
                            "too and the PEFT adapter carries them (modules_to_save), which LoRA servers such "
                            "as vLLM do not load.")
    group.add_argument("--lora_learning_rate", type=float, default=5e-4,
                       help="Initial LoRA learning rate (after the potential warmup period) to use.")
    return group


REPORT_TO_CHOICES = ("tensorboard", "wandb", "mlflow")


def parse_report_to(value: str) -> tuple[str, ...]:
    """``--report_to``'s comma list: tracker names from :data:`REPORT_TO_CHOICES`, each once, in the
    order given; ``none`` (alone) is the empty tuple."""
    names = [name.strip() for name in value.split(",") if name.strip()]
    if names == ["none"]:
        return ()
    wrong = [name for name in names if name not in REPORT_TO_CHOICES]
    if not names or wrong:
        raise argparse.ArgumentTypeError(
            f"{value!r}: give a comma list of {', '.join(REPORT_TO_CHOICES)}, or none")
    return tuple(dict.fromkeys(names))


class _ReportTo(argparse.Action):
    """Stores ``--report_to``'s tuple; ``tensorboard`` in it also sets ``enable_tensorboard`` (the same
    switch: DeepSpeed's monitor and the ``--tensorboard_path`` check follow it)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        if "tensorboard" in values:  # type: ignore[operator]
            namespace.enable_tensorboard = True


def add_tracker_args(group: argparse._ArgumentGroup, *, tensorboard_path: str) -> None:
    """``--enable_tensorboard``, ``--tensorboard_path`` (upstream's) and ``--report_to`` (ours), for
    every step: the experiment trackers (:mod:`dschat.training.trackers`, docs/metrics.md)."""
    group.add_argument("--enable_tensorboard", action="store_true", help="Enable tensorboard logging")
    group.add_argument("--tensorboard_path", type=user_path, default=tensorboard_path, help="Path to tensorboard logs")
    group.add_argument("--report_to", type=parse_report_to, action=_ReportTo, default=None, metavar="LIST",
                       help="(dschat) Experiment trackers that get the run's scalars and its flags (rank 0): a "
                            "comma list of tensorboard, wandb, mlflow, or none. Default: tensorboard with "
                            "--enable_tensorboard (upstream's spelling of it, which adds tensorboard to any list), "
                            "else none. W&B runs offline unless WANDB_MODE says otherwise and MLflow writes a "
                            "file: store, both under --output_dir (else --tensorboard_path) unless WANDB_DIR / "
                            "MLFLOW_TRACKING_URI are set; each needs its extra (pip install 'dschat[wandb]', "
                            "'dschat[mlflow]'). A tracker whose logging fails mid-run is dropped with one warning.")


def add_logging_args(
    parser: argparse.ArgumentParser, *, tensorboard_path: str, print_loss: bool = False
) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("logging")
    add_tracker_args(group, tensorboard_path=tensorboard_path)
    if print_loss:
        group.add_argument("--print_loss", action="store_true", help="Prints loss at each step.")
    return group


def add_eot_args(parser: argparse.ArgumentParser, *, eot_token_flag: bool) -> argparse._ArgumentGroup:
    """``--add_eot_token`` (all steps) and ``--eot_token`` (step 1 only, as upstream).

    ``--end_of_conversation_token`` is ours: the text appended to every training conversation.
    dschat's default is the tokenizer's EOS in every step, so the reward model scores the same
    token the PPO actor ends its answers with (docs/upstream.md#flags-and-defaults; pass
    ``<|endoftext|>`` to reproduce upstream's steps 2 and DPO).
    """
    group = parser.add_argument_group("end of conversation")
    group.add_argument("--add_eot_token", action="store_true",
                       help="Add <|endoftext|> as additional special token to tokenizer")
    if eot_token_flag:
        group.add_argument("--eot_token", type=str, default="<|endoftext|>",
                           help="Specify the format of the `eot_token`")
    group.add_argument("--end_of_conversation_token", type=str, default=None,
                       help="(dschat) Text appended to each training conversation. Default: the "
                            "tokenizer's EOS. Upstream steps 2-3 used '<|endoftext|>'.")
    return group


def add_sequence_packing_arg(group: argparse._ArgumentGroup, passes: str, rows: str) -> None:
    """``--sequence_packing`` (steps 2 and 3): ``passes`` run on packed rows of ``rows`` end to end."""
    group.add_argument("--sequence_packing", type=str, default="auto", choices=("auto", "on", "off"),
                       help=f"(dschat) Run {passes} on packed rows: {rows}; sequences kept apart by the "
                            "attention mask (dschat/models/packing.py); the same results up to floating-point "
                            "reordering; a batch with no cheaper layout stays padded. 'auto' (default): every model "
                            "whose family and attention (SDPA, eager) support it, the rest padded, named once in the "
                            "log; 'on': refuse a model that cannot; 'off': padded rows, as upstream.")


def add_deepspeed_args(parser: argparse.ArgumentParser) -> None:
    """``--deepspeed`` / ``--deepspeed_config`` as every upstream main.py (they are not used to build
    the config: dschat builds it from the flags, so passing ``--deepspeed_config`` is an error)."""
    # lazy: deepspeed (with torch) costs 1.6 s CPU at import (python -X importtime), and e2e_rlhf.py
    # --help imports this module without needing it.
    import deepspeed

    deepspeed.add_config_arguments(parser)


def add_step1_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every flag of step 1 (SFT), in ``--help``'s order: step 1's ``main.py`` and the memory planner
    (``python -m dschat.plan --step 1``) build their parsers with it."""
    add_data_args(parser, phase=1)
    add_model_args(parser)
    add_training_args(parser, learning_rate=1e-3)
    add_runtime_args(parser)
    add_precision_args(parser)
    add_lora_args(parser)
    add_logging_args(parser, tensorboard_path="step1_tensorboard", print_loss=True)
    add_eot_args(parser, eot_token_flag=True)
    add_checkpoint_args(parser)
    add_deepspeed_args(parser)
    return parser
