"""Step 2's own flag groups: the reward model's evaluation, freezing and packing, and DPO's loss and
reference model; :func:`add_step2_args` and :func:`add_dpo_step_args`, the two step-2 scripts' whole
parsers in their order. The groups steps share
are in :mod:`dschat.cli.shared`."""
from __future__ import annotations

import argparse

from dschat.cli.shared import (add_checkpoint_args, add_data_args, add_deepspeed_args, add_eot_args,
                               add_logging_args, add_lora_args, add_model_args, add_precision_args, add_runtime_args,
                               add_sequence_packing_arg, add_training_args)


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


def add_step2_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every flag of step 2 (reward model), in ``--help``'s order: step 2's ``main.py`` and the memory
    planner (``python -m dschat.plan --step 2``) build their parsers with it."""
    add_data_args(parser, phase=2)
    add_model_args(parser)
    add_reward_eval_args(parser)
    add_training_args(parser, learning_rate=5e-5)
    add_runtime_args(parser)
    add_precision_args(parser)
    add_lora_args(parser)
    add_logging_args(parser, tensorboard_path="step2_tensorboard")
    add_eot_args(parser, eot_token_flag=False)
    add_checkpoint_args(parser)
    add_deepspeed_args(parser)
    return parser


def add_dpo_step_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every flag of step 2's DPO script, in ``--help``'s order (its ``main.py`` builds its parser
    with it)."""
    add_data_args(parser, phase=2)
    add_model_args(parser)
    add_training_args(parser, learning_rate=1e-3)
    add_dpo_args(parser)
    add_runtime_args(parser)
    add_precision_args(parser)
    add_lora_args(parser)
    add_logging_args(parser, tensorboard_path="step2_tensorboard", print_loss=True)
    add_eot_args(parser, eot_token_flag=False)
    add_checkpoint_args(parser)
    add_deepspeed_args(parser)
    return parser
