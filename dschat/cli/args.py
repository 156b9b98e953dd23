"""Command-line flags shared by the step scripts, defined once per group with upstream's names.

Each ``add_*_args(parser, ...)`` adds one argument group. Names, defaults and help follow upstream's
``main.py`` files (``training/step*/main.py``); flags that are ours say so in their help.
"""
from __future__ import annotations

import argparse
import functools

from dschat.multinode import DEFAULT_DIST_TIMEOUT_MINUTES
from dschat.paths import SAVE_FORMATS, data_cache_dir
from dschat.runtime.fs import resolve_output_dir

__all__ = ["add_data_args", "add_unsupervised_data_args"]

# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


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
        "--data_path", nargs="*", default=["Dahoas/rm-static"],
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
        group.add_argument("--sft_only_data_path", nargs="*", default=[],
                           help="Path to the dataset for only using in SFT phase.")
    group.add_argument(
        "--data_output_path", type=str, default=str(data_cache_dir()),
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


def add_unsupervised_data_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Step 3's PPO-ptx data flags (``--unsup_coef`` belongs to the PPO group)."""
    group = parser.add_argument_group("unsupervised data (PPO-ptx)")
    group.add_argument("--unsupervised_dataset_name", type=str, default=None,
                       help="The name of the dataset to use (via the datasets library). Also: a local "
                            "save_to_disk folder, .json/.jsonl/.parquet/.txt file(s), or dschat/builtin. "
                            "Setting it enables PPO-ptx (upstream also required a config name).")
    group.add_argument("--unsupervised_dataset_config_name", type=str, default=None,
                       help="The configuration name of the dataset to use (via the datasets library).")
    group.add_argument("--preprocessing_num_workers", type=int, default=None,
                       help="The number of processes to use for the preprocessing.")
    return group


# ---------------------------------------------------------------------------------------------
# Shared groups of steps 1, 2 and DPO (upstream's names and defaults; per-step defaults passed in)
# ---------------------------------------------------------------------------------------------

SCHEDULER_TYPES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")
DTYPE_CHOICES = ("fp16", "bf16", "fp32")
# Step 3's algorithms and loss aggregations (dschat.rl_algorithms.ALGORITHMS / LOSS_AGGREGATIONS; a
# test keeps them equal: this module imports nothing of dschat's).
ALGORITHM_CHOICES = ("ppo", "grpo", "rloo", "reinforce_pp", "remax")
LOSS_AGGREGATION_CHOICES = ("token", "sequence", "token_sum")


def add_model_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model_name_or_path", type=str, required=True,
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
    group.add_argument("--output_dir", type=resolve_output_dir, default=None,
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
                            "10 minutes), whichever is longer. Fractions allowed.")
    return group


def add_checkpoint_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """(dschat) Checkpoints and resume; see :mod:`dschat.training.checkpoint`."""
    group = parser.add_argument_group("checkpoints and resume (dschat)")
    group.add_argument("--save_interval", type=int, default=0,
                       help="(dschat) Save a resumable checkpoint to <output_dir>/checkpoints every N optimizer "
                            "steps (0: none; upstream saved nothing resumable).")
    group.add_argument("--keep_checkpoints", type=int, default=2, help="(dschat) Keep the K last written checkpoints, delete older ones.")
    group.add_argument("--resume", action="store_true",
                       help="(dschat) Continue from the last written complete checkpoint in <output_dir>/checkpoints "
                            "(start from scratch, with a notice, when there is none).")
    group.add_argument("--resume_from", type=str, default=None,
                       help="(dschat) Continue from this checkpoint folder (<output_dir>/checkpoints/step_N).")
    group.add_argument("--max_nonfinite_steps", type=int, default=10,
                       help="(dschat) A micro-step whose loss is NaN/inf on any rank, or an optimizer step with "
                            "NaN/inf gradients, is skipped and logged; stop with an error naming the last good "
                            "checkpoint after this many in a row (0: never stop). fp16 loss-scale overflows "
                            "stay DeepSpeed's and do not count.")
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


def add_logging_args(
    parser: argparse.ArgumentParser, *, tensorboard_path: str, print_loss: bool = False
) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("logging")
    group.add_argument("--enable_tensorboard", action="store_true", help="Enable tensorboard logging")
    group.add_argument("--tensorboard_path", type=str, default=tensorboard_path, help="Path to tensorboard logs")
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


def add_deepspeed_args(parser: argparse.ArgumentParser) -> None:
    """``--deepspeed`` / ``--deepspeed_config`` as every upstream main.py (they are not used to build
    the config: dschat builds it from the flags, so passing ``--deepspeed_config`` is an error)."""
    # lazy: deepspeed (with torch) costs 1.6 s CPU at import (python -X importtime), and e2e_rlhf.py
    # --help imports this module without needing it.
    import deepspeed

    deepspeed.add_config_arguments(parser)


# ---------------------------------------------------------------------------------------------
# Step-specific groups
# ---------------------------------------------------------------------------------------------


def add_reward_eval_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("reward model")
    group.add_argument(
        "--num_padding_at_beginning", type=int, default=1,
        help="OPT model has a fixed number (1) of padding tokens at the beginning of the input. We "
             "did not see this in other models but keep it as an option for now. (dschat reads the "
             "sequence end from the attention mask; this count is used only when no mask is given.)",
    )
    group.add_argument("--eval_interval", type=int, default=0, help="If > 0, perform evaluation at this interval")
    group.add_argument("--eval_iters", type=int, default=100,
                       help="Maximum evaluation iterations (0: the whole held-out split)")
    group.add_argument("--freeze_layers", type=int, default=0, metavar="N",
                       help="(dschat) freeze the embeddings and the N lowest transformer blocks (no gradients or "
                            "optimizer state; the backward stops at block N); 0 (default) trains all, as upstream")
    add_sequence_packing_arg(group, "the reward model's training passes",
                             "each row's real tokens and the padding its loss reads, no other padding computed")
    return group


def add_dpo_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("DPO")
    group.add_argument("--beta", type=float, default=0.1,
                       help="Temperature parameter for DPO loss, typically something in the range of 0.1 to 0.5. "
                            "We ignore the reference model as beta -> 0.")
    group.add_argument("--label_smoothing", type=float, default=0.0,
                       help="conservative DPO loss, which assumes that preferences are noisy (flipped) with "
                            "probability label_smoothing")
    group.add_argument("--offload_reference_model", action="store_true",
                       help="Enable ZeRO Offload techniques for reference model.")
    return group


# ---------------------------------------------------------------------------------------------
# Step 3 (PPO)
# ---------------------------------------------------------------------------------------------


def add_step3_model_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("actor and critic")
    group.add_argument("--actor_model_name_or_path", type=str, required=True,
                       help="Path to the step-1 actor (a folder, hub id, dschat short name, or PEFT LoRA "
                            "adapter folder: its base model, the adapter merged).")
    group.add_argument("--critic_model_name_or_path", type=str, default=None,
                       help="Path to the step-2 reward model output (the critic and reward model start from it), "
                            "or its lora_adapter/ folder (the adapter merged into its base, its value head). "
                            "Required for --algorithm ppo and whenever the reward model scores answers; a "
                            "critic-free algorithm scored by --reward_fn alone needs none.")
    group.add_argument("--num_padding_at_beginning", type=int, default=1,
                       help="OPT model has a fixed number (1) of padding tokens at the beginning of the "
                            "input. Not used in step 3 (as upstream).")
    group.add_argument("--actor_dropout", type=float, default=None,
                       help="If actor dropout configured, use it. Otherwise, keep the default dropout "
                            "configuration of the actor model.")
    group.add_argument("--critic_dropout", type=float, default=None,
                       help="If critic dropout configured, use it. Otherwise, keep the default dropout "
                            "configuration of the critic model.")
    group.add_argument("--actor_gradient_checkpointing", action="store_true",
                       help="Enable HF gradient checkpointing for Actor model.")
    group.add_argument("--critic_gradient_checkpointing", action="store_true",
                       help="Enable HF gradient checkpointing for Critic model.")
    return group


def add_step3_training_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("PPO training")
    group.add_argument("--per_device_generation_batch_size", type=int, default=16,
                       help="Batch size (per device) for the training dataloader and generation purpose.")
    group.add_argument("--per_device_training_batch_size", type=int, default=16,
                       help="Mini Batch size (per device) for the training dataloader and training purpose.")
    group.add_argument("--generation_batches", type=int, default=1,
                       help="Generate x batches to go to training mode.")
    group.add_argument("--ppo_epochs", type=int, default=1,
                       help="For generated data, how many ppo training epochs to run.")
    group.add_argument("--max_prompt_seq_len", type=int, default=256, help="The maximum sequence length.")
    group.add_argument("--max_answer_seq_len", type=int, default=256, help="The maximum sequence length.")
    group.add_argument("--actor_learning_rate", type=float, default=9.65e-6,
                       help="Initial learning rate (after the potential warmup period) to use.")
    group.add_argument("--critic_learning_rate", type=float, default=5e-6,
                       help="Initial learning rate (after the potential warmup period) to use.")
    group.add_argument("--actor_weight_decay", type=float, default=0.0, help="Weight decay to use.")
    group.add_argument("--critic_weight_decay", type=float, default=0.0, help="Weight decay to use.")
    group.add_argument("--num_train_epochs", type=int, default=1,
                       help="Total number of training epochs to perform.")
    group.add_argument("--lr_scheduler_type", type=str, default="cosine", choices=SCHEDULER_TYPES,
                       help="The scheduler type to use.")
    group.add_argument("--gradient_accumulation_steps", type=int, default=1,
                       help="Number of updates steps to accumulate before performing a backward/update pass.")
    group.add_argument("--num_warmup_steps", type=int, default=100,
                       help="Number of steps for the warmup in the lr scheduler.")
    add_sequence_packing_arg(group, "step 3's scoring passes and PPO update",
                             "each rollout row's real tokens, no padding computed")
    return group


def add_sequence_packing_arg(group: argparse._ArgumentGroup, passes: str, rows: str) -> None:
    """``--sequence_packing`` (steps 2 and 3): ``passes`` run on packed rows of ``rows`` end to end."""
    group.add_argument("--sequence_packing", type=str, default="auto", choices=("auto", "on", "off"),
                       help=f"(dschat) Run {passes} on packed rows: {rows}; sequences kept apart by the "
                            "attention mask (dschat/models/packing.py); the same results up to floating-point "
                            "reordering; a batch with no cheaper layout stays padded. 'auto' (default): every model "
                            "whose family and attention (SDPA, eager) support it, the rest padded, named once in the "
                            "log; 'on': refuse a model that cannot; 'off': padded rows, as upstream.")


def add_ppo_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """PPO hyperparameters: upstream hard-coded them in ppo_trainer.py; here each is a flag with
    upstream's value as default. The opt-in extras beyond upstream say so."""
    group = parser.add_argument_group("PPO")
    group.add_argument("--kl_ctl", type=float, default=0.1,
                       help="(dschat flag, upstream constant) Per-token KL penalty coefficient.")
    group.add_argument("--clip_reward_value", type=float, default=5.0,
                       help="(dschat flag, upstream constant) Reward-model scores are clipped to +-this.")
    group.add_argument("--missing_eos_penalty", type=float, default=0.0,
                       help="(dschat) Subtract this from the reward-model score of an answer that ends without "
                            "EOS (cut at --max_answer_seq_len), as TRL's missing_eos_penalty; 0 (upstream): off. "
                            "Stops an actor from learning to run on past the point the reward model was trained on.")
    group.add_argument("--cliprange", type=float, default=0.2,
                       help="(dschat flag, upstream constant) PPO ratio clip range.")
    group.add_argument("--cliprange_value", type=float, default=0.2,
                       help="(dschat flag, upstream constant) Value clip range of the critic loss.")
    group.add_argument("--gamma", type=float, default=1.0,
                       help="(dschat flag, upstream constant) GAE discount.")
    group.add_argument("--lam", type=float, default=0.95,
                       help="(dschat flag, upstream constant) GAE lambda.")
    group.add_argument("--whiten_advantages", action="store_true",
                       help="(dschat, opt-in) Whiten advantages over the rollout's action tokens.")
    group.add_argument("--kl_estimator", type=str, default="auto", choices=("auto", "k1", "k2", "k3"),
                       help="(dschat) Per-token KL estimator (docs/algorithms.md). 'auto': k1 (upstream's) when "
                            "the KL is in the reward, k3 when it is a loss term (GRPO).")
    group.add_argument("--reward_at", type=str, default="after_last", choices=("after_last", "last"),
                       help="(dschat, opt-in) Where the reward-model score is added: upstream's slot "
                            "after the last answer token ('after_last', DSE #672) or the last real "
                            "answer token ('last').")
    group.add_argument("--decoding", type=str, default="sample", choices=("sample", "greedy"),
                       help="(dschat) Rollout decoding. 'sample' (default) draws answers from the "
                            "policy, which is what the PPO ratio assumes; 'greedy' reproduces "
                            "upstream's default for OPT and its saved checkpoints.")
    group.add_argument("--temperature", type=float, default=1.0, help="(dschat) Sampling temperature.")
    group.add_argument("--top_k", type=int, default=0, help="(dschat) Top-k sampling (0: off).")
    group.add_argument("--top_p", type=float, default=1.0, help="(dschat) Nucleus sampling (1.0: off).")
    group.add_argument("--unsup_coef", type=float, default=27.8,
                       help="gamma in Equation 2 from InstructGPT paper")
    group.add_argument("--align_overflow", action="store_true",
                       help="Align loss scale overflow between actor and critic (fp16 only).")
    group.add_argument("--enable_ema", action="store_true", help="Enable EMA checkpoint for the model.")
    return group


def add_algorithm_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """(dschat) Step 3's algorithm and reward sources beyond upstream's PPO; docs/algorithms.md has
    each formula with its paper. Every default keeps upstream's PPO."""
    group = parser.add_argument_group("algorithm and rewards (dschat)")
    group.add_argument("--algorithm", type=str, default="ppo", choices=ALGORITHM_CHOICES,
                       help="(dschat) ppo (default, upstream's: actor + critic, GAE); the critic-free grpo (group-"
                            "normalised advantages), rloo (leave-one-out baseline), reinforce_pp (REINFORCE++: KL "
                            "in per-token rewards, batch-whitened returns) and remax (greedy answer as baseline) "
                            "build, load and save no critic.")
    group.add_argument("--num_generations", type=int, default=1,
                       help="(dschat) Answers sampled per prompt (the group, K). A generation batch of "
                            "--per_device_generation_batch_size rows holds that many / K prompts, each K times; "
                            "K must divide it. grpo and rloo need K >= 2.")
    group.add_argument("--dr_grpo", action="store_true",
                       help="(dschat) With --algorithm grpo: Dr.GRPO (no division by the group's std; token_sum loss).")
    group.add_argument("--loss_aggregation", type=str, default="auto", choices=("auto",) + LOSS_AGGREGATION_CHOICES,
                       help="(dschat) How token losses make the step's loss: 'token' (mean over every token of the "
                            "step: PPO's), 'sequence' (mean over answers of each answer's token mean: GRPO's paper), "
                            "'token_sum' (each answer's token sum / --max_answer_seq_len, mean over answers: "
                            "Dr.GRPO). 'auto': sequence for grpo, token_sum for --dr_grpo, token otherwise.")
    group.add_argument("--kl_in_reward", type=str, default="auto", choices=("auto", "on", "off"),
                       help="(dschat) 'on': -kl_ctl x KL in the reward (PPO, RLOO, REINFORCE++, ReMax); 'off': kl_ctl x "
                            "KL a loss term on the actor's log-probs (GRPO); 'auto': off for grpo, else on. 0 kl_ctl: no KL.")
    group.add_argument("--tis_cap", type=float, default=0.0,
                       help="(dschat) Truncated importance sampling: each token's loss times min(pi_train / "
                            "pi_rollout, tis_cap), for the rollout decoder's gap to training. 0 (default): off.")
    group.add_argument("--reward_fn", type=str, action="append", default=None, metavar="MODULE:FUNCTION",
                       help="(dschat) A reward function fn(prompts, answers, **columns) -> list[float] (columns: "
                            "the prompt's other dataset fields). Repeatable; built-ins dschat.rewards:gold (the "
                            "embedded data's gold judge) and dschat.rewards:math_exact_match (column 'answer').")
    group.add_argument("--reward_fn_weight", type=float, action="append", default=None,
                       help="(dschat) Weight of each --reward_fn, in order (default 1.0 each).")
    group.add_argument("--reward_fn_timeout", type=float, default=600.0, metavar="SECONDS",
                       help="(dschat) Longest one call of a --reward_fn or --eval_judge function may take before the "
                            "run stops with an error naming it (default 600; 0: no limit).")
    group.add_argument("--reward_model_weight", type=float, default=None,
                       help="(dschat) Reward model's weight in the reward. Default: 1.0 without --reward_fn, 0 (not "
                            "loaded) with it; give it to combine both.")
    return group


#: ``--eval_interval auto``: the interval is chosen from the measured cost (dschat.rlhf.eval_cost).
EVAL_INTERVAL_AUTO = "auto"


def eval_interval(value: str) -> int | str:
    """``--eval_interval``'s type: an integer or ``auto``."""
    return EVAL_INTERVAL_AUTO if value == EVAL_INTERVAL_AUTO else int(value)


def add_step3_eval_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """(dschat) Step 3's held-out evaluation, over-optimization alarm and best checkpoint
    (:mod:`dschat.rlhf.evaluation`); docs/evaluation.md "Did step 3 work?"."""
    group = parser.add_argument_group("held-out evaluation (dschat)")
    group.add_argument("--eval_interval", type=eval_interval, default=None, metavar="N|auto",
                       help="If > 0, evaluate the actor on held-out prompts before the first PPO step and every this "
                            "many PPO steps (0: off, as upstream). Uses the phase-3 eval split of --data_path, never "
                            "trained on; evaluation changes nothing in training. (dschat) 'auto': N is chosen after "
                            "the first PPO step, from the measured cost of an evaluation and of a PPO step, so that "
                            "evaluation takes at most 10%% of the step-3 wall time; the log states the measured share. "
                            "Default: auto when --eval_judge, --save_best_by or --stop_on_overoptimization is given, "
                            "else 0 (off, upstream's default).")
    group.add_argument("--eval_prompts", type=int, default=16,
                       help="(dschat) Held-out prompts per evaluation (default 16: the first K distinct prompts of the "
                            "eval split, the same every time), answered with the rollout's decoding from a fixed seed.")
    group.add_argument("--eval_judge", type=str, action="append", default=None, metavar="JUDGE",
                       help="(dschat) An independent judge of the held-out answers, never trained on (repeatable): "
                            "'gold' (the embedded data's gold judge, --data_path dschat/builtin only), a "
                            "module.path:function reward function, or a step-2 reward-model folder.")
    group.add_argument("--eval_alarm_sigmas", type=float, default=2.0,
                       help="(dschat) Over-optimization alarm: the proxy rose while a judge fell by more than this "
                            "many paired standard errors (over the same prompts) since two evaluations before.")
    group.add_argument("--stop_on_overoptimization", action="store_true",
                       help="(dschat) End the run cleanly when the over-optimization alarm fires (default: warn only).")
    group.add_argument("--save_best_by", type=str, default=None, choices=("judge", "proxy", "none"),
                       help="(dschat) Keep the actor (and critic, EMA) of the best evaluation in <output_dir>/best, by "
                            "the first --eval_judge or by the proxy. Default: judge when a judge is given, else none.")
    return group


def add_step3_lora_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("LoRA (actor and critic)")
    group.add_argument("--actor_lora_dim", type=int, default=0,
                       help="If > 0, use LoRA for efficient training. (dschat) actor/ and actor_ema/ then also "
                            "hold the LoRA as a PEFT adapter, in lora_adapter/.")
    group.add_argument("--actor_lora_module_name", type=str, default="decoder.layers.", help="The scope of LoRA.")
    group.add_argument("--critic_lora_dim", type=int, default=0,
                       help="If > 0, use LoRA for efficient training. (dschat) critic/lora_adapter/ then holds "
                            "the LoRA as a PEFT adapter, the value head beside it.")
    group.add_argument("--critic_lora_module_name", type=str, default="decoder.layers.", help="The scope of LoRA.")
    group.add_argument("--only_optimize_lora", action="store_true", help="Only optimize the LoRA parameters.")
    group.add_argument("--actor_lora_learning_rate", type=float, default=5e-4,
                       help="Initial actor LoRA learning rate (after the potential warmup period) to use.")
    group.add_argument("--critic_lora_learning_rate", type=float, default=5e-4,
                       help="Initial critic LoRA learning rate (after the potential warmup period) to use.")
    group.add_argument("--enable_mixed_precision_lora", action="store_true",
                       help="Enable Mixed Precision ZeRO++ for training and generation (needs actor LoRA "
                            "and actor ZeRO-3).")
    return group


def add_step3_deepspeed_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("DeepSpeed (step 3)")
    group.add_argument("--enable_hybrid_engine", action="store_true",
                       help="Enable hybrid engine for actor model to optimize both inference and training "
                            "(dschat: its own Hybrid Engine, dschat/rlhf/rollout_engine.py, for Llama, Mistral, Qwen2/3, "
                            "Phi-3, Gemma, OPT, GPT-NeoX; other models fall back to the module, saying why once).")
    group.add_argument("--unpin_actor_parameters", action="store_true",
                       help="Unpin actor's parameters during generation. This makes generation slower "
                            "but requires less memory.")
    group.add_argument("--release_inference_cache", action="store_true",
                       help="Release the memory cache used for inference. This makes generation "
                            "preparation slower but might increase e2e throughput by using larger batch size.")
    group.add_argument("--inference_tp_size", type=int, default=1,
                       help="Tensor-parallelism degree used for the inference-optimization. Please note "
                            "hybrid-engine need to be enabled when using this feature. dschat: its Hybrid Engine "
                            "decodes over groups of this many contiguous ranks of one node (actor ZeRO-3), each "
                            "holding 1/N of the weights; docs/inference_tensor_parallel.md.")
    group.add_argument("--tp_gather_partition_size", type=int, default=8,
                       help="Granularity to bring in layers for TP sharding inside the hybrid engine. Please "
                            "note hybrid-engine and tp_inference_size > 1 need to be true when using this feature. "
                            "dschat: ZeRO-3 layers gathered at a time while each rank copies out its shard.")
    group.add_argument("--zero3_gather_for_generation", type=str, default="auto", choices=("auto", "on", "off"),
                       help="(dschat) Actor under ZeRO-3 without the Hybrid Engine: gather all its parameters "
                            "once per rollout instead of layer by layer for every generated token. 'auto' "
                            "does it when the full model fits in half of the free memory; 'off' saves "
                            "memory at the cost of speed.")
    group.add_argument("--zero3_gather_for_scoring", type=str, default="auto", choices=("auto", "on", "off"),
                       help="(dschat) Models under ZeRO-3 (reference, reward model, critic, and the actor where "
                            "generation kept no log-probs): gather each one's parameters once for its scoring pass "
                            "over a rollout, without ZeRO-3's per-module hooks. 'auto': where the full model fits "
                            "in half of the free memory and its parameters are not offloaded; 'off' saves memory.")
    group.add_argument("--zero3_gather_for_training", type=str, default="auto", choices=("auto", "on", "off"),
                       help="(dschat) Actor and critic under ZeRO-3: each micro-step's forward and backward on the "
                            "whole model gathered once, without ZeRO-3's per-module hooks. 'auto': one data-parallel "
                            "rank, parameters neither offloaded nor quantized (no extra memory); 'on': also across "
                            "ranks (a full copy through the backward); 'off': ZeRO-3's hooks, DeepSpeed's gradients.")
    group.add_argument("--generation_loop", type=str, default="auto", choices=("auto", "dschat", "hf", "graphs"),
                       help="(dschat) Without the Hybrid Engine: 'dschat' decodes rollouts with dschat's own "
                            "sampling loop (dschat/rlhf/decoding.py: the same tokens for a seed as Hugging Face "
                            "generate, without its per-token bookkeeping); 'hf' calls the module's generate(); "
                            "'graphs' (CUDA) calls generate() with a static KV cache and CUDA graphs "
                            "(torch.compile mode reduce-overhead; prompts left-padded to a multiple of 64 so "
                            "one graph serves the rollouts of a prompt width; the first rollout compiles; measured in "
                            "benchmarks/results.md); where it does not apply (a CPU, ZeRO-3 weights not "
                            "gathered, encoder-decoders), or if it fails, it says so once and uses 'dschat'. "
                            "'auto' (default): 'graphs' where it applies, else 'dschat' without a word. "
                            "generate() is used anyway for an actor under ZeRO-3 whose weights are not gathered.")
    group.add_argument("--cpu_decode_linear", type=str, default="onednn", choices=("onednn", "off"),
                       help="(dschat) fp32 actor on a CPU, without the Hybrid Engine: 'onednn' runs the decode "
                            "steps' linear layers with oneDNN on weights repacked once per rollout (MKL's GEMM "
                            "is several times slower for a few rows; benchmarks/results.md); costs one extra copy "
                            "of the actor's weights during generation. 'off': the stock kernels.")
    group.add_argument("--offload", action="store_true", help="Enable ZeRO Offload techniques.")
    group.add_argument("--dtype", type=str, default="fp16", choices=DTYPE_CHOICES,
                       help="Training data type. fp32 is dschat's addition; on a CPU, fp16 falls back "
                            "to fp32 with one warning.")
    group.add_argument("--offload_reference_model", action="store_true",
                       help="Enable ZeRO Offload techniques for reference model")
    group.add_argument("--offload_reward_model", action="store_true",
                       help="Enable ZeRO Offload techniques for reward model")
    group.add_argument("--actor_zero_stage", type=int, default=0, help="ZeRO optimization stage for Actor model (and clones).")
    group.add_argument("--critic_zero_stage", type=int, default=0, help="ZeRO optimization stage for Critic model (and reward).")
    group.add_argument("--compute_fp32_loss", action="store_true",
                       help="Relevant for low precision dtypes (fp16, bf16, etc.). If specified, loss is "
                            "calculated in fp32. This applies for both actor and critic models.")
    return group


def add_step3_logging_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("logging and testing")
    group.add_argument("--enable_tensorboard", action="store_true", help="Enable tensorboard logging")
    group.add_argument("--tensorboard_path", type=str, default="step3_tensorboard", help="Path to tensorboard logs")
    group.add_argument("--print_answers", action="store_true", help="Print prompt and answers during training")
    group.add_argument("--print_answers_interval", type=int, default=1,
                       help="If --print_answers enabled, controls the printing interval.")
    group.add_argument("--enable_test_mode", action="store_true",
                       help="Enable a testing mode that terminates training based on args.test_stop_step")
    group.add_argument("--test_stop_step", type=int, default=0,
                       help="Training non-overflow step at which to terminate training during testing.")
    return group


# ---------------------------------------------------------------------------------------------
# Upstream-style callers
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _step3_defaults() -> dict[str, object]:
    parser = argparse.ArgumentParser(add_help=False)
    for add in (add_step3_model_args, add_step3_training_args, add_ppo_args, add_algorithm_args, add_step3_lora_args,
                add_step3_deepspeed_args, add_step3_logging_args, add_checkpoint_args):
        add(parser)
    return {action.dest: action.default for action in parser._actions}


def step3_flag(args: argparse.Namespace, name: str) -> object:
    """``args.<name>``, or the step-3 default of that flag when ``args`` lacks it: code written
    against upstream parses upstream's flags only, and hands that Namespace to
    ``DeepSpeedRLHFEngine`` / ``DeepSpeedPPOTrainer``; dschat's own flags then take their defaults."""
    if hasattr(args, name):
        return getattr(args, name)
    return _step3_defaults()[name]
