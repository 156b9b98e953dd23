#!/usr/bin/env python
"""Step 2 alternative: Direct Preference Optimization (DPO) of a causal LM against a frozen copy.

Runs under the DeepSpeed launcher (``deepspeed main.py ...``, any number of ranks) and as a plain
``python main.py ...`` (one process). Reads top to bottom: parse -> distributed + seed ->
tokenizer -> data -> policy (dropout, LoRA) and reference -> engines -> eval -> train -> save.
See README.md.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from dschat.cli.step2 import add_dpo_step_args
from dschat.errors import cli_main
from dschat.runtime.run_lock import releasing_run_locks
from dschat.runtime.import_guards import freeze_imported
from dschat.training.engine_setup import (
    apply_lora,
    initialize_engine,
    optim_settings,
    plan_optimizer_steps,
    train_ds_config,
)
from dschat.training.progress import OptimizerStepCounter, RunResult, Trackers
from dschat.training.run_setup import check_common_args, check_paths, setup_run
from dschat.training.step_data import build_step_data, check_pair_seq_len, check_seq_len_fits_positions
from dschat.runtime.dist import print_rank_0
from dschat.training.dpo import check_dpo_args, dpo_batch, evaluate_dpo


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    description = "Finetune a transformers model on a causal language modeling task"
    parser = add_dpo_step_args(argparse.ArgumentParser(description=description))
    args = parser.parse_args(argv)
    check_common_args(args)
    check_pair_seq_len(args.max_seq_len)
    check_dpo_args(args.beta, args.label_smoothing)
    return args


@releasing_run_locks  # a run's --output_dir is free again when main ends, in-process too
def main(argv: Sequence[str] | None = None) -> RunResult:
    from transformers import AutoModelForCausalLM

    from dschat.data.collators import DataCollatorReward
    from dschat.models.build import create_hf_model
    from dschat.runtime.ds_config import get_eval_ds_config
    from dschat.runtime.zero3 import release_zero3_prefetch
    from dschat.training.loop import finish_run, train_epochs

    args = parse_args(argv)
    check_paths(args)  # before distributed start-up: bad paths fail in seconds
    check_seq_len_fits_positions(args.model_name_or_path, args.max_seq_len)  # from the config, before any weight
    ctx = setup_run(args)
    tb = Trackers.from_args(args, "step2_dpo_model_dschat", run_name="step2_dpo")  # before any model (a missing extra: exit 2)

    # Data: the phase-2 chunk, as (chosen, rejected) pairs.
    data = build_step_data(args, ctx.local_rank, phase=2, collator=DataCollatorReward())
    tokenizer, train_loader, eval_loader = data.tokenizer, data.train_loader, data.eval_loader

    # Policy (trained) and reference (frozen). The reference is ZeRO-3 only if the policy is, and is
    # built with the very config it is initialised with (upstream built it without the offload it
    # then initialised with).
    ds_config = train_ds_config(args, ctx, tb_name="step2_model")
    model = create_hf_model(AutoModelForCausalLM, args.model_name_or_path, tokenizer, ds_config, dropout=args.dropout)
    ref_ds_config = get_eval_ds_config(
        args.offload_reference_model, ctx.dtype, 3 if args.zero_stage == 3 else 0,
        micro_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, world_size=ctx.world_size,
    )
    ref_model = create_hf_model(AutoModelForCausalLM, args.model_name_or_path, tokenizer, ref_ds_config,
                                dropout=args.dropout)
    if args.compute_fp32_loss:
        print_rank_0(f"Using model {model.__class__.__name__} with loss in fp32", ctx.rank)
    model = apply_lora(model, args.lora_dim, args.lora_module_name, args.only_optimize_lora)

    num_training_steps = plan_optimizer_steps(
        len(train_loader), args.num_train_epochs, args.gradient_accumulation_steps, args.max_train_steps)
    engine = initialize_engine(model, ds_config, optim_settings(args, num_training_steps))
    ref_engine = initialize_engine(ref_model, ref_ds_config, None)
    ref_engine.eval()
    if args.gradient_checkpointing:
        engine.gradient_checkpointing_enable()

    counter = OptimizerStepCounter(args.gradient_accumulation_steps, args.max_train_steps)
    result = RunResult(output_dir=None, tokenizer=tokenizer)
    loss_options = {"beta": args.beta, "label_smoothing": args.label_smoothing, "fp32": args.compute_fp32_loss}

    def evaluate(epoch: int) -> None:
        print_rank_0(f"***** Evaluating rewards, Epoch {epoch}/{args.num_train_epochs} *****", ctx.rank)
        scores = evaluate_dpo(engine, ref_engine, eval_loader, ctx.device, **loss_options)
        print_rank_0(f"chosen: {scores.chosen}, rejected: {scores.rejected}, loss: {scores.loss}", ctx.rank)
        result.evals.append({"epoch": epoch, "step": counter.optimizer_steps, "chosen": scores.chosen,
                             "rejected": scores.rejected, "loss": scores.loss, "acc": scores.accuracy,
                             "pairs": scores.pairs})
        tb.scalars(counter.optimizer_steps, **{"eval/chosen_reward": scores.chosen,
                                               "eval/rejected_reward": scores.rejected,
                                               "eval/loss": scores.loss, "eval/acc": scores.accuracy})

    # The reference model is frozen: only the policy is checkpointed.
    train_epochs(args, ctx, engine, train_loader, result=result, tb=tb, counter=counter,
                 loss_fn=lambda batch: dpo_batch(engine, ref_engine, batch, **loss_options).loss, evaluate=evaluate,
                 print_loss=args.print_loss, step="dpo")
    release_zero3_prefetch(ref_engine)  # never saved: nothing of its last forward left in flight at exit
    return finish_run(args, ctx, engine, tokenizer, result, "dpo")


if __name__ == "__main__":
    freeze_imported()  # what the imports made lives as long as the run: out of full garbage collections
    sys.exit(cli_main(main))
