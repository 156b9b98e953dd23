#!/usr/bin/env python
"""Step 3: RLHF with PPO (actor from step 1, critic and reward model from step 2), optionally PPO-ptx;
or a critic-free algorithm (``--algorithm grpo|rloo|reinforce_pp|remax``), with reward functions
(``--reward_fn``) beside or instead of the reward model.

Runs under the DeepSpeed launcher (``deepspeed main.py ...``, any number of ranks), as a plain
``python main.py ...`` (one process), and in-process as ``main(argv_list)``. Reads top to bottom:
parse -> checks -> tokenizers -> distributed + seed -> memory preflight (docs/memory-plan.md#preflight) -> data
-> the engines -> PPO loop (with the held-out evaluation of ``--eval_interval``, dschat/rlhf/heldout/evaluation.py) -> save.
See docs/flags.md for the flags, docs/algorithms.md#decoding-why-sampling-is-the-default for the decoding
default and docs/algorithms.md#the-on-policy-rule for the on-policy rule.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from dschat.cli.step3 import add_step3_args
from dschat.errors import UserError, cli_main
from dschat.runtime.run_lock import hold_run_lock, releasing_run_locks
from dschat.remote_reward import plain_http_warning, remote_reward_function
from dschat.rewards import RewardFunction, RewardMix, check_weight, load_reward_functions, reward_model_weight
from dschat.runtime.dist import get_rank, print_rank_0
from dschat.runtime.import_guards import freeze_imported

if TYPE_CHECKING:  # imported inside main (--help stays light)
    from torch.utils.data import DataLoader
    from transformers import PreTrainedTokenizerBase

    from dschat.rlhf.config import AlgorithmSettings, BatchPlan
    from dschat.rlhf.experience_maker import RewardFn
    from dschat.rlhf.ppo_trainer import DeepSpeedPPOTrainer
    from dschat.rlhf.rlhf_engine import DeepSpeedRLHFEngine, ModelSources
    from dschat.training.run_setup import ModelOutputs


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="(Step 3) RLHF training with PPO")
    add_step3_args(parser)
    return parser.parse_args(argv)


@dataclass
class Step3Result:
    """What ``main`` returns in-process: one dict per PPO iteration (see docs/metrics.md for the
    keys), the micro-step ratio statistics, the saved folder and the engines."""

    output_dir: Path | None = None
    history: list[dict] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)
    skipped_nonfinite: int = 0  # rollouts and micro-steps the non-finite guard skipped
    on_policy: bool = True
    rlhf_engine: DeepSpeedRLHFEngine | None = None
    trainer: DeepSpeedPPOTrainer | None = None
    tokenizer: PreTrainedTokenizerBase | None = None
    evaluations: list[dict] = field(default_factory=list)  # held-out evaluation records (--eval_interval)


def reward_mix(args: argparse.Namespace, reward_fn: RewardFn | None = None) -> RewardMix:
    """The reward: ``--reward_fn`` functions (and ``main``'s Python ``reward_fn``) with their weights,
    ``--reward_url``'s server (dschat/remote_reward.py), the reward model's weight (default 1 without
    functions, server or ``--env``, 0 -- not loaded -- with them), and ``--env``'s turn rewards."""
    functions = load_reward_functions(args.reward_fn or [], args.reward_fn_weight, args.reward_fn_timeout)
    if args.reward_url is not None:
        functions.append(remote_reward_function(args.reward_url, args.reward_url_weight, args.reward_url_timeout,
                                                args.reward_url_retries))
    if reward_fn is not None:
        functions.append(RewardFunction("reward_fn", reward_fn, require_finite=False, timeout=args.reward_fn_timeout))
    env = getattr(args, "env", None) or None
    weight = check_weight(reward_model_weight(args.reward_model_weight, other_terms=bool(functions or env)),
                          "--reward_model_weight")
    if not functions and weight == 0.0 and env is None:
        raise UserError("--reward_model_weight 0 without --reward_fn leaves nothing to score the answers; give a "
                        "--reward_fn, a --reward_url or a non-zero --reward_model_weight")
    if weight == 0.0 and env is None and all(f.weight == 0.0 for f in functions):
        raise UserError(f"every reward term has weight 0 ({', '.join(f'{f.name} 0' for f in functions)}, the reward "
                        "model 0): every reward would be 0; give one of --reward_fn_weight, --reward_url_weight or "
                        "--reward_model_weight a non-zero value")
    return RewardMix(tuple(functions), weight, env)


def check_paths(args: argparse.Namespace, settings: AlgorithmSettings | None = None,
                mix: RewardMix | None = None) -> ModelOutputs:
    """Bad model, data and output paths fail here, before anything is loaded or written (the folders
    the run saves into in ``--output_dir`` too: ``actor/``, ``critic/``, ``actor_ema/``, ``best/``, each
    refused if it is a file, cannot be written or is a symbolic link another account made); returns the
    models the run saves, for :func:`~dschat.training.run_setup.setup_run`'s check. On the launcher's
    rank 0 the model folders (``actor/``, ``critic/``, ``actor_ema/``) are created and their run locks
    held while ``args`` lives (:func:`~dschat.runtime.run_lock.hold_run_lock`): another run using one
    of them is one line. The critic
    and reward-model folders may be dschat's step-2 output (``v_head.safetensors``), upstream
    DeepSpeed-Chat's (``pytorch_model.bin`` with the value head inside; its keys are checked,
    memory-mapped) or a one-label sequence classifier. PPO's critic needs ``--critic_model_name_or_path``
    or ``--reward_model_name_or_path`` (then it starts from the actor); the reward model needs one of
    them (``--reward_model_name_or_path`` defaults to the critic's); a critic-free run scored by
    functions alone needs none."""
    from dschat.models.registry import resolve_model_path
    from dschat.models.reward_model import check_critic_folder
    from dschat.models.save import is_model_artifact
    from dschat.paths import BEST_DIR, EARLIER_BEST_DIR
    from dschat.rlhf.heldout.best import earlier_best_in_the_way
    from dschat.runtime.fs import check_writable_dir, refuse_foreign_links
    from dschat.training import run_setup
    from dschat.training.step_data import check_seq_len_fits_positions

    run_setup.check_paths(args, ("actor_model_name_or_path",), outputs={})  # its outputs: below
    needs_critic = settings is None or settings.critic
    needs_reward_model = mix is None or mix.uses_model
    critic, reward = args.critic_model_name_or_path, getattr(args, "reward_model_name_or_path", None)
    if critic is None and reward is None and (needs_critic or needs_reward_model):
        if needs_critic:
            role = f"--algorithm {settings.algorithm if settings else 'ppo'}'s critic"
            also = "or --reward_model_name_or_path: the critic then starts from the actor"
        else:
            role, also = "the reward model (--reward_model_weight is not 0)", "or --reward_model_name_or_path"
        raise UserError(f"--critic_model_name_or_path is required for {role}: give the step-2 output folder "
                        f"({also})")
    for flag, name in (("--critic_model_name_or_path", critic), ("--reward_model_name_or_path", reward)):
        if name is not None:
            check_critic_folder(resolve_model_path(name), name, flag)
    # The actor reads whole rollouts: prompt and answer (the critic and the reward model: check_readers).
    check_seq_len_fits_positions(args.actor_model_name_or_path, args.max_prompt_seq_len + args.max_answer_seq_len,
                                 "--max_prompt_seq_len + --max_answer_seq_len")
    saved: ModelOutputs = {}
    if args.output_dir:
        out = Path(args.output_dir)
        saved = {"the actor": (out / "actor", is_model_artifact),
                 **({"the critic": (out / "critic", is_model_artifact)} if needs_critic else {}),
                 **({"the EMA actor": (out / "actor_ema", is_model_artifact)} if args.enable_ema else {}),
                 **({"the best models": (out / BEST_DIR, None), "the earlier best models": (out / EARLIER_BEST_DIR, None)}
                    if args.eval_interval and args.save_best_by != "none" else {})}
        refuse_foreign_links(out, [Path(folder).name for folder, _ in saved.values()])  # another account's link
        run_setup.refuse_saving_over_inputs({"--actor_model_name_or_path": args.actor_model_name_or_path,
                                             "--critic_model_name_or_path": critic,
                                             "--reward_model_name_or_path": reward}, saved)
    run_setup.check_output_paths(args)
    if "the best models" in saved and not (args.resume or args.resume_from):  # a fresh run sets best/ aside
        problem = earlier_best_in_the_way(Path(args.output_dir))
        if problem is not None:
            raise UserError(problem)
    for what, (folder, _) in saved.items():  # the sub-folders the final save writes, checked now
        if Path(folder).exists() and not Path(folder).is_dir():
            raise UserError(f"{folder} is a file, and this run saves {what} into a folder of that name; move the "
                            "file away or give another --output_dir")
        check_writable_dir(folder, f"the folder for {what}")
    if get_rank() == 0:  # one run per model folder it saves into (actor/, critic/, actor_ema/), as per --output_dir
        for what, (folder, owns) in saved.items():
            if owns is not None:
                hold_run_lock(folder, args, f"the folder for {what}",
                              fix="wait for it to end or pick another --output_dir")
    return saved


def check_readers(args: argparse.Namespace, sources: ModelSources, *, critic: bool, reward_model: bool) -> None:
    """The models that read the actor's token ids take a whole rollout (prompt + answer) within their
    position tables (one line, before any weight loads): the critic unless it starts from the actor
    (checked as the actor, in :func:`check_paths`), and the reward model, PPO's or a critic-free run's,
    unless it has another tokenizer (then it reads its own tokens of the text, cut to its length)."""
    from dschat.training.step_data import check_seq_len_fits_positions

    readers = [sources.critic if critic and not sources.critic_from_actor else None,
               sources.reward if reward_model and sources.reward_tokenizer is None else None]
    for name in dict.fromkeys(r for r in readers if r is not None):
        check_seq_len_fits_positions(name, args.max_prompt_seq_len + args.max_answer_seq_len,
                                     "--max_prompt_seq_len + --max_answer_seq_len")


def starting_models(args: argparse.Namespace, sources: ModelSources, *, critic: bool,
                    reward_model: bool) -> dict[str, tuple[str, str | None]]:
    """The models step 3 starts from, by role, with the flag that names each: a checkpoint records their
    weights, and a resume from other ones is refused (the reference and reward models are not in it)."""
    reward_flag = "--reward_model_name_or_path" if args.reward_model_name_or_path else "--critic_model_name_or_path"
    critic_flag = "--actor_model_name_or_path" if sources.critic_from_actor else "--critic_model_name_or_path"
    return {"actor": ("--actor_model_name_or_path", args.actor_model_name_or_path),
            "critic": (critic_flag, sources.critic if critic else None),
            "reward model": (reward_flag, sources.reward if reward_model else None)}


def create_datasets(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase, plan: BatchPlan, local_rank: int,
                    num_generations: int = 1) -> tuple[DataLoader, DataLoader | None, int]:
    """Prompt loader (phase-3 chunk, left-padded prompts; ``per_device_generation_batch_size /
    num_generations`` prompts a batch, each repeated by the trainer), optional ptx loader, total
    optimizer steps."""
    from transformers import default_data_collator

    from dschat.data.collators import DataCollatorRLHF
    from dschat.data.unsupervised import get_unsupervised_data, unsupervised_training_enabled
    from dschat.rlhf.config import num_total_iters
    from dschat.rlhf.ppo_loop import batches_per_epoch
    from dschat.training.loaders import make_train_loader
    from dschat.training.step_data import prompt_datasets

    # PPO-ptx data first: a bad --unsupervised_dataset_name fails before the prompt cache is written.
    unsup_dataset = get_unsupervised_data(args, tokenizer) if unsupervised_training_enabled(args) else None
    prompt_train_dataset, _ = prompt_datasets(args, tokenizer, local_rank, 3,
                                              args.end_of_conversation_token or tokenizer.eos_token,
                                              args.max_prompt_seq_len)
    if len(prompt_train_dataset) == 0:
        raise UserError(
            f"the phase-3 prompt split of {' '.join(args.data_path)} is empty (data_split {args.data_split}, "
            f"max_prompt_seq_len {args.max_prompt_seq_len}); give phase 3 a share in --data_split or "
            "raise --max_prompt_seq_len"
        )
    collator = DataCollatorRLHF(args.max_prompt_seq_len, args.inference_tp_size)
    drop_last = plan.drop_short_batches  # a short rollout would shift every later optimizer step
    prompt_loader = make_train_loader(prompt_train_dataset, args.per_device_generation_batch_size // num_generations,
                                      collator, args.seed, drop_last=drop_last)
    unsup_loader = None
    if unsup_dataset is not None:
        unsup_loader = make_train_loader(unsup_dataset, args.per_device_generation_batch_size,
                                         default_data_collator, args.seed, drop_last=drop_last)
    for name, loader, per_batch in (("phase-3 prompt", prompt_loader, args.per_device_generation_batch_size // num_generations),
                                    ("PPO-ptx", unsup_loader, args.per_device_generation_batch_size)):
        if loader is not None and len(loader) == 0:
            rows = (f"{per_batch} (per_device_generation_batch_size {args.per_device_generation_batch_size} / "
                    f"num_generations {num_generations})" if per_batch != args.per_device_generation_batch_size
                    else f"per_device_generation_batch_size {per_batch}")
            raise UserError(
                f"the {name} data has fewer than {rows} rows per rank, and a short batch is dropped when "
                f"it splits into several micro-batches of {args.per_device_training_batch_size}; use more "
                "data or smaller batch sizes"
            )
    batches = batches_per_epoch(prompt_loader, unsup_loader)
    if batches * args.num_train_epochs < args.generation_batches:  # a rollout is never complete: nothing trains
        raise UserError(f"--generation_batches {args.generation_batches} makes a rollout of more generation batches "
                        f"than the run has ({batches} per epoch x --num_train_epochs {args.num_train_epochs}), so it "
                        "would never train; lower --generation_batches or the batch sizes, or use more data")
    total_iters = num_total_iters(plan, batches, args.num_train_epochs)
    return prompt_loader, unsup_loader, total_iters


@releasing_run_locks  # a run's --output_dir is free again when main ends, in-process too
def main(argv: Sequence[str] | None = None, *, reward_fn: RewardFn | None = None) -> Step3Result:
    """Run step 3. ``reward_fn(prompts, answers) -> scores`` (decoded strings) is a reward function
    like ``--reward_fn``'s: it replaces the reward model unless ``--reward_model_weight`` is given."""
    from deepspeed.accelerator import get_accelerator

    from dschat.data.prompt_columns import load_prompt_columns
    from dschat.data.unsupervised import unsupervised_training_enabled
    from dschat.envs import load_environment
    from dschat.models.save import save_hf_model, saving_together
    from dschat.plan.preflight import step3_preflight
    from dschat.rlhf.heldout.evaluation import StepThreeEvaluation
    from dschat.rlhf.heldout.setup import check_eval_args, heldout_prompt_items
    from dschat.rlhf.config import num_total_iters as count_iters, resolve_algorithm, step3_config
    from dschat.rlhf.guards import validate_step3_args
    from dschat.rlhf.ppo_loop import METRICS_FILE, batches_per_epoch, resume_metrics, run_ppo
    from dschat.rlhf.ppo_trainer import DeepSpeedPPOTrainer, DeepSpeedPPOTrainerUnsupervised
    from dschat.rlhf.rlhf_engine import DeepSpeedRLHFEngine, resolve_model_sources
    from dschat.runtime.ds_config import resolve_dtype
    from dschat.runtime.optim import FlagSchedule, resume_schedule
    from dschat.training.checkpoint import Checkpointer, check_checkpoint_args, refuse_past_the_end
    from dschat.training.progress import Trackers
    from dschat.training.run_setup import quiet_transformers, set_unsaved_models_aside, setup_run
    from dschat.training.step_data import load_tokenizer
    from dschat.training.ppo_counters import PPOCounters

    # ---------------------------------------------------------------- parse and check
    args = parse_args(argv)
    warnings = validate_step3_args(args, accelerator=get_accelerator().device_name(), dtype=resolve_dtype(args.dtype),
                                   python_reward_fn=reward_fn is not None)
    check_checkpoint_args(args)
    settings = resolve_algorithm(args)
    mix = reward_mix(args, reward_fn)
    if args.env:
        load_environment(args.env, args.env_timeout)  # a bad spec is one line now, before anything loads
    judges = check_eval_args(args)  # resolves --eval_interval and --save_best_by, which check_paths reads
    outputs = check_paths(args, settings, mix)
    quiet_transformers()  # before the tokenizers load on every rank (setup_run quiets them too)
    tokenizer = load_tokenizer(args.actor_model_name_or_path, args.add_eot_token)
    # The critic reads the actor's token ids (else it starts from the actor); a reward model of another
    # tokenizer reads re-tokenised text. Their positions are checked before start-up, as check_paths'.
    sources = resolve_model_sources(args.actor_model_name_or_path, args.critic_model_name_or_path,
                                    args.reward_model_name_or_path, tokenizer, needs_critic=settings.critic,
                                    needs_reward=mix.uses_model)
    check_readers(args, sources, critic=settings.critic, reward_model=mix.uses_model)
    ptx = unsupervised_training_enabled(args)
    ctx = setup_run(args, outputs)
    config = step3_config(args, ctx.world_size, mix, algorithm=settings)  # every part of step 3, once
    plan = config.batches
    if args.reward_url is not None and plain_http_warning(args.reward_url):
        warnings.append(plain_http_warning(args.reward_url))
    for line in warnings:
        print_rank_0(line, ctx.rank)
    print_rank_0(settings.describe(), ctx.rank)
    print_rank_0(mix.describe(), ctx.rank)
    for line in sources.notes:  # where the critic and the reward model come from, before their plan
        print_rank_0(line, ctx.rank)
    step3_preflight(args, argv, ctx, four_models=settings.critic and mix.uses_model,  # memory, before any model
                    reward_model=mix.uses_model, critic_from_actor=sources.critic_from_actor)
    # After every check that can refuse the run (no tracker run is left behind by one), before any
    # model (a missing extra: exit 2).
    tb = Trackers.from_args(args, "step3_tensorboard_logs", run_name="step3")

    # ---------------------------------------------------------------- data
    prompt_loader, unsup_loader, num_total_iters = create_datasets(args, tokenizer, plan, ctx.local_rank,
                                                                   settings.num_generations)
    if args.shared_prompt_fields is not None:
        print_rank_0("note: --shared_prompt_fields is no longer needed and is ignored: every prompt carries its dataset "
                     "row, so reward functions, judges and --env get their own row's fields", ctx.rank)
    readers = [*mix.functions, *(judge.fn for judge in judges if judge.fn is not None)]  # of the dataset's columns
    columns = (load_prompt_columns(args.data_path, args.data_split, args.seed, args.data_output_path, ctx.local_rank,
                                   tokenizer) if readers or args.env else None)
    eval_items = heldout_prompt_items(args, tokenizer, ctx.local_rank, columns) if args.eval_interval else []

    # ---------------------------------------------------------------- engines and trainer
    rlhf_engine = DeepSpeedRLHFEngine(args.actor_model_name_or_path, args.critic_model_name_or_path, tokenizer,
                                      args, num_total_iters, with_reward_model=mix.uses_model,
                                      with_critic=settings.critic, config=config, sources=sources)
    trainer_class = DeepSpeedPPOTrainerUnsupervised if ptx else DeepSpeedPPOTrainer
    trainer = trainer_class(rlhf_engine, args, prompt_columns=columns, config=config)
    evaluation = StepThreeEvaluation(config.evaluation, trainer, eval_items, judges, tb=tb, rank=ctx.rank,
                                     world_size=ctx.world_size)
    result = Step3Result(on_policy=plan.on_policy, rlhf_engine=rlhf_engine, trainer=trainer, tokenizer=tokenizer,
                         evaluations=evaluation.records)

    print_rank_0(f"***** Running training (total_iters={num_total_iters}) *****", ctx.rank)
    print_rank_0(plan.describe(settings.num_generations), ctx.rank)
    if not plan.on_policy:
        print_rank_0(plan.off_policy_warning(config.ppo.cliprange, settings.cliprange_high), ctx.rank)

    # ---------------------------------------------------------------- resume
    # A checkpoint is written after a trained PPO iteration (--save_interval counts iterations), when
    # no rollout is half collected: the trainable engines (actor, critic unless critic-free, EMA), the
    # random states, the prompt position and the PPO counters.
    trainable = {"actor": rlhf_engine.actor, "critic": rlhf_engine.critic}
    checkpointer = Checkpointer(config.checkpoint, {k: v for k, v in trainable.items() if v is not None}, ctx.rank,
                                weights_only={} if rlhf_engine.actor_ema is None else {"actor_ema": rlhf_engine.actor_ema},
                                loaders=[loader for loader in (prompt_loader, unsup_loader) if loader is not None],
                                models=starting_models(args, sources, critic=settings.critic,
                                                       reward_model=mix.uses_model), step="step3")
    trainer.nonfinite.last_checkpoint = checkpointer.latest
    wanted = {name: FlagSchedule.of(engine.lr_scheduler) for name, engine in trainable.items() if engine is not None}
    resumed = checkpointer.resume()
    counters = PPOCounters() if resumed is None else PPOCounters.restore(resumed, trainer.nonfinite)
    if resumed is not None:  # the checkpoint's LR schedules go on, laid anew over another plan (batches, ranks, epochs)
        batches = batches_per_epoch(prompt_loader, unsup_loader)
        refuse_past_the_end(checkpointer, batches, args.num_train_epochs,
                            (counters.non_overflow_step_count, args.test_stop_step if args.enable_test_mode else 0,
                             "generation batches done, past --test_stop_step"))
        epoch = checkpointer.first_epoch()
        left = count_iters(plan, batches, args.num_train_epochs, epoch=epoch,
                           batches_done=checkpointer.batches_done(epoch))
        for name, flag_schedule in wanted.items():
            scheduler = trainable[name].lr_scheduler
            for line in resume_schedule(flag_schedule, scheduler, num_total_iters, left):
                print_rank_0(f"[checkpoint] {name}: {line}", ctx.rank)
    if args.output_dir is not None and ctx.rank == 0:  # a fresh run sets an earlier run's file aside
        resume_metrics(Path(args.output_dir) / METRICS_FILE, counters.global_step,
                       checkpointer.resumed if resumed is not None else None)
    if resumed is not None:  # TensorBoard hides what the killed attempt logged after the checkpoint
        tb.resume_at(counters.global_step)
    evaluation.restore(resumed, at_step=counters.global_step)  # its series, best checkpoint and alarm go on
    if evaluation.should_stop:  # the resumed series' alarm fired (also in an attempt without the flag)
        print_rank_0(f"[eval] --stop_on_overoptimization: the resumed evaluation series raised the over-optimization "
                     f"alarm at step {evaluation.alarms[-1]['step']}, so the run ends without training; resume "
                     "without the flag to train on", ctx.rank)

    # ---------------------------------------------------------------- PPO loop
    run = run_ppo(args, ctx, trainer, prompt_loader, unsup_loader, checkpointer=checkpointer, counters=counters,
                  evaluation=evaluation, tb=tb, resumed=resumed is not None)
    result.history, result.skipped_steps = run.history, run.skipped_steps
    evaluation.finish()
    tb.close()
    result.skipped_nonfinite = trainer.nonfinite.skipped
    rlhf_engine.release_prefetch()  # nothing in flight at exit, saved or not

    # ---------------------------------------------------------------- save
    if args.output_dir is not None:
        print_rank_0("saving model ...", ctx.rank)
        # Collective (ZeRO-3 gathers); LoRA fused in the saved copy; each folder written atomically, in
        # --save_format (upstream's test looks for pytorch_model.bin in actor/ and critic/), and the
        # folders as one set (a kill between them leaves them refused as models, not mixed unseen).
        models = {"actor": rlhf_engine.actor, "critic": rlhf_engine.critic, "actor_ema": rlhf_engine.actor_ema}
        with saving_together(args.output_dir, list(models), ctx.rank):
            for name, engine in models.items():
                if engine is not None:  # critic-free algorithms have no critic to save
                    save_hf_model(engine, tokenizer, Path(args.output_dir) / name, args.save_format)
        if ctx.rank == 0:  # an earlier run's critic/ or actor_ema/ would pass for this run's
            unsaved = [name for name, engine in models.items() if engine is None]
            inputs = (args.actor_model_name_or_path, args.critic_model_name_or_path, args.reward_model_name_or_path)
            for notice in set_unsaved_models_aside(args.output_dir, unsaved, inputs):
                print(notice, flush=True)
        result.output_dir = Path(args.output_dir)
    return result


if __name__ == "__main__":
    freeze_imported()  # what the imports made lives as long as the run: out of full garbage collections
    sys.exit(cli_main(main))
