#!/usr/bin/env python
"""Step 1: supervised fine-tuning (SFT) of a causal LM on the prompt + chosen answers.

Runs under the DeepSpeed launcher (``deepspeed main.py ...``, any number of ranks) and as a plain
``python main.py ...`` (one process). Reads top to bottom: parse -> distributed + seed ->
tokenizer -> data -> model (dropout, LoRA) -> engine -> eval -> train -> save. See README.md.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from dschat.cli.shared import add_step1_args
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
from dschat.training.eval_loops import evaluate_perplexity
from dschat.training.progress import OptimizerStepCounter, RunResult, Trackers
from dschat.training.run_setup import check_common_args, check_paths, setup_run
from dschat.models.registry import check_sft_seq_len
from dschat.training.step_data import build_step_data, check_seq_len_fits_positions
from dschat.runtime.dist import print_rank_0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    description = "Finetune a transformers model on a causal language modeling task"
    parser = add_step1_args(argparse.ArgumentParser(description=description))
    args = parser.parse_args(argv)
    check_common_args(args)
    check_sft_seq_len(args.max_seq_len)
    return args


def build_model(args: argparse.Namespace, tokenizer: Any, ds_config: dict, rank: int) -> Any:
    """The SFT model before DeepSpeed takes it: dropout override, fp32 loss, LoRA (the memory
    planner's step-1 inventory follows this; tests/plan/test_training_steps.py counts it)."""
    from transformers import AutoModelForCausalLM

    from dschat.models.build import causal_lm_model_to_fp32_loss, create_hf_model

    model = create_hf_model(AutoModelForCausalLM, args.model_name_or_path, tokenizer, ds_config, dropout=args.dropout)
    if args.compute_fp32_loss:
        print_rank_0(f"Using model {model.__class__.__name__} with loss in fp32", rank)
        causal_lm_model_to_fp32_loss(model)
    return apply_lora(model, args.lora_dim, args.lora_module_name, args.only_optimize_lora)


@releasing_run_locks  # a run's --output_dir is free again when main ends, in-process too
def main(argv: Sequence[str] | None = None) -> RunResult:
    from transformers import default_data_collator

    from dschat.training.loop import finish_run, train_epochs

    args = parse_args(argv)
    check_paths(args)  # before distributed start-up: bad paths fail in seconds
    check_seq_len_fits_positions(args.model_name_or_path, args.max_seq_len)  # from the config, before any weight
    ctx = setup_run(args)
    tb = Trackers.from_args(args, "step1_model_dschat", run_name="step1")  # before any model (a missing extra: exit 2)

    # Data: phase-1 chunk of every dataset (+ the SFT-only ones), cached once for all ranks.
    data = build_step_data(args, ctx.local_rank, phase=1, collator=default_data_collator,
                           eot_special_token=args.eot_token)
    tokenizer, train_loader, eval_loader = data.tokenizer, data.train_loader, data.eval_loader

    # Model: dropout override, fp32 loss, LoRA.
    ds_config = train_ds_config(args, ctx, tb_name="step1_model")
    model = build_model(args, tokenizer, ds_config, ctx.rank)

    num_training_steps = plan_optimizer_steps(
        len(train_loader), args.num_train_epochs, args.gradient_accumulation_steps, args.max_train_steps)
    engine = initialize_engine(model, ds_config, optim_settings(args, num_training_steps))
    if args.gradient_checkpointing:
        engine.gradient_checkpointing_enable()

    counter = OptimizerStepCounter(args.gradient_accumulation_steps, args.max_train_steps)
    result = RunResult(output_dir=None, tokenizer=tokenizer)

    def evaluate(epoch: int) -> None:
        print_rank_0(f"***** Evaluating perplexity, Epoch {epoch}/{args.num_train_epochs} *****", ctx.rank)
        perplexity, eval_loss = evaluate_perplexity(engine, eval_loader, ctx.device)
        print_rank_0(f"ppl: {perplexity}, loss: {eval_loss}", ctx.rank)
        result.evals.append({"epoch": epoch, "step": counter.optimizer_steps, "ppl": perplexity, "loss": eval_loss})
        tb.scalars(counter.optimizer_steps, **{"eval/ppl": perplexity, "eval/loss": eval_loss})

    train_epochs(args, ctx, engine, train_loader, result=result, tb=tb, counter=counter,
                 loss_fn=lambda batch: engine(**batch, use_cache=False).loss, evaluate=evaluate,
                 print_loss=args.print_loss, step="step1")
    return finish_run(args, ctx, engine, tokenizer, result, "step1")


if __name__ == "__main__":
    freeze_imported()  # what the imports made lives as long as the run: out of full garbage collections
    sys.exit(cli_main(main))
