#!/usr/bin/env python
"""Step 2: reward-model training on (prompt, chosen, rejected) pairs with upstream's pairwise loss.

Runs under the DeepSpeed launcher (``deepspeed main.py ...``, any number of ranks) and as a plain
``python main.py ...`` (one process). Reads top to bottom: parse -> distributed + seed ->
tokenizer -> data -> reward model (dropout, final-norm reset, LoRA, frozen layers) -> engine -> packing ->
eval -> train -> save. See README.md.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from dschat.cli.step2 import add_step2_args
from dschat.errors import cli_main
from dschat.runtime.run_lock import releasing_run_locks
from dschat.models.freeze import freeze_lower_layers, release_input_gradients
from dschat.models.packing import attention_window, resolve_sequence_packing
from dschat.runtime.import_guards import freeze_imported
from dschat.training.engine_setup import (
    apply_lora,
    initialize_engine,
    optim_settings,
    plan_optimizer_steps,
    reset_final_norm_for_reward,
    train_ds_config,
)
from dschat.training.eval_loops import evaluate_reward
from dschat.training.progress import OptimizerStepCounter, RunResult, Trackers
from dschat.training.run_setup import check_common_args, check_paths, setup_run
from dschat.training.step_data import build_step_data, check_pair_seq_len, check_seq_len_fits_positions
from dschat.runtime.dist import print_rank_0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    description = "Finetune a transformers model on a causal language modeling task"
    parser = add_step2_args(argparse.ArgumentParser(description=description))
    args = parser.parse_args(argv)
    check_common_args(args)
    check_pair_seq_len(args.max_seq_len)
    return args


def build_model(args: argparse.Namespace, tokenizer: Any, ds_config: dict, rank: int) -> Any:
    """The reward model before DeepSpeed takes it: the pretrained body plus a fresh value head, the
    final norm reset where the family asks, LoRA, the lower layers frozen (the memory planner's
    step-2 inventory follows this; tests/plan/test_training_steps.py counts it)."""
    from dschat.models.build import create_critic_model

    rm_model = create_critic_model(
        args.model_name_or_path, tokenizer, ds_config, args.num_padding_at_beginning, dropout=args.dropout,
        zero_stage=args.zero_stage, compute_fp32_loss=args.compute_fp32_loss,
    )
    force_optimize_params = reset_final_norm_for_reward(rm_model, args.zero_stage)  # BLOOM (DSE #772)
    if args.lora_dim > 0 and args.only_optimize_lora:
        # The value head is new: it must train even when only LoRA factors do (DSE #758).
        force_optimize_params.append("v_head.weight")
    rm_model = apply_lora(rm_model, args.lora_dim, args.lora_module_name, args.only_optimize_lora,
                          force_optimize_params)
    if args.freeze_layers:
        frozen = freeze_lower_layers(rm_model.rwtransformer, args.freeze_layers)
        print_rank_0(f"--freeze_layers {args.freeze_layers}: the embeddings and the {args.freeze_layers} lowest "
                     f"blocks are frozen ({len(frozen)} tensors)", rank)
    return rm_model


@releasing_run_locks  # a run's --output_dir is free again when main ends, in-process too
def main(argv: Sequence[str] | None = None) -> RunResult:
    from dschat.data.collators import DataCollatorReward
    from dschat.training.loop import finish_run, train_epochs

    args = parse_args(argv)
    check_paths(args, causal_lm=False)  # before distributed start-up: bad paths fail in seconds
    check_seq_len_fits_positions(args.model_name_or_path, args.max_seq_len)  # from the config, before any weight
    ctx = setup_run(args)
    tb = Trackers.from_args(args, "step2_model_dschat", run_name="step2")  # before any model (a missing extra: exit 2)

    # Data: phase-2 chunk of every dataset, as (chosen, rejected) pairs.
    data = build_step_data(args, ctx.local_rank, phase=2, collator=DataCollatorReward())
    tokenizer, train_loader, eval_loader = data.tokenizer, data.train_loader, data.eval_loader

    # Reward model: the pretrained body plus a fresh value head.
    ds_config = train_ds_config(args, ctx, tb_name="step2_model")
    rm_model = build_model(args, tokenizer, ds_config, ctx.rank)

    num_training_steps = plan_optimizer_steps(
        len(train_loader), args.num_train_epochs, args.gradient_accumulation_steps, args.max_train_steps)
    engine = initialize_engine(rm_model, ds_config, optim_settings(args, num_training_steps))
    if args.gradient_checkpointing:
        engine.gradient_checkpointing_enable()
        if args.freeze_layers:
            release_input_gradients(rm_model.rwtransformer)

    # --sequence_packing: each batch's real tokens (and the padding the loss reads) end to end.
    packing = resolve_sequence_packing(args.sequence_packing, {"reward": engine})["reward"]
    window = attention_window(rm_model.config)
    if packing and window is not None and window < args.max_seq_len:
        print_rank_0(f"Sequence packing: batches wider than the model's local-attention window ({window} tokens) "
                     "run padded (the packed pass's explicit mask would not apply the window)", ctx.rank)
    counter = OptimizerStepCounter(args.gradient_accumulation_steps, args.max_train_steps)
    result = RunResult(output_dir=None, tokenizer=tokenizer)

    def evaluate(epoch: int | None) -> tuple[float, float, float]:
        scores = evaluate_reward(engine, eval_loader, ctx.device, args.eval_iters)
        result.evals.append({"epoch": epoch, "step": counter.optimizer_steps, "chosen": scores.chosen,
                             "rejected": scores.rejected, "acc": scores.accuracy, "loss": scores.loss,
                             "pairs": scores.pairs})
        tb.scalars(counter.optimizer_steps, **{"eval/chosen_score": scores.chosen,
                                               "eval/rejected_score": scores.rejected,
                                               "eval/acc": scores.accuracy, "eval/loss": scores.loss})
        return scores.chosen, scores.rejected, scores.accuracy

    def evaluate_epoch(epoch: int) -> None:
        print_rank_0(f"***** Evaluating reward, Epoch {epoch}/{args.num_train_epochs} *****", ctx.rank)
        chosen, rejected, acc = evaluate(epoch)
        print_rank_0(
            f"chosen_last_scores (higher is better) : {chosen}, "
            f"rejected_last_scores (lower is better) : {rejected}, "
            f"acc (higher is better) : {acc}", ctx.rank)

    def evaluate_every(total_steps: int) -> None:  # upstream's --eval_interval
        if args.eval_interval and total_steps % args.eval_interval == 0:
            print_rank_0(f"Iter {total_steps}: Evaluating reward", ctx.rank)
            chosen, rejected, acc = evaluate(None)
            print_rank_0(f"Iter {total_steps}: c_scores: {chosen}, r_scores: {rejected}, "
                         f"diff: {chosen - rejected}, acc: {acc}", ctx.rank)

    def epoch_loss(epoch: int, mean_loss: float) -> None:
        print_rank_0(f"Epoch {epoch + 1}/{args.num_train_epochs} with loss {mean_loss}", ctx.rank)

    # No throughput line: upstream's step 2 has none (the step times are in the result).
    train_epochs(args, ctx, engine, train_loader, result=result, tb=tb, counter=counter,
                 loss_fn=lambda batch: engine(**batch, use_cache=False, sequence_packing=packing)["loss"],
                 evaluate=evaluate_epoch,
                 on_optimizer_step=evaluate_every, on_epoch_end=epoch_loss, print_throughput=False, step="step2")
    # The body as an HF folder + v_head.safetensors.
    return finish_run(args, ctx, engine, tokenizer, result, "step2")


if __name__ == "__main__":
    freeze_imported()  # what the imports made lives as long as the run: out of full garbage collections
    sys.exit(cli_main(main))
