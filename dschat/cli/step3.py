"""Step 3's flag groups (PPO and the critic-free algorithms): actor and critic, PPO training and
hyperparameters, algorithm and rewards, environments, held-out evaluation, LoRA, DeepSpeed, logging, PPO-ptx data;
and :func:`add_step3_args`, step 3's whole parser in its order (the groups steps share are in
:mod:`dschat.cli.shared`); :func:`complete_step3_args` fills an upstream-style Namespace in at its defaults and
:func:`flags_off_default` names the flags given at other than them."""
from __future__ import annotations

import argparse
import functools
from typing import Iterable

from dschat.cli.shared import (DTYPE_CHOICES, SCHEDULER_TYPES, add_checkpoint_args, add_data_args, add_deepspeed_args,
                               add_eot_args, add_runtime_args, add_sequence_packing_arg, add_tracker_args,
                               user_path)


# Step 3's algorithms and loss aggregations (dschat.rl_math.critic_free.ALGORITHMS / LOSS_AGGREGATIONS; a
# test keeps them equal: cli sits on a lower floor and cannot import them).
ALGORITHM_CHOICES = ("ppo", "grpo", "rloo", "reinforce_pp", "remax")

LOSS_AGGREGATION_CHOICES = ("token", "sequence", "token_sum")

#: ``--eval_interval auto``: the interval is chosen from the measured cost (dschat.rlhf.heldout.cost).
EVAL_INTERVAL_AUTO = "auto"


def add_unsupervised_data_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Step 3's PPO-ptx data flags (``--unsup_coef`` belongs to the PPO group)."""
    group = parser.add_argument_group("unsupervised data (PPO-ptx)")
    group.add_argument("--unsupervised_dataset_name", type=user_path, default=None,
                       help="The name of the dataset to use (via the datasets library). Also: a local "
                            "save_to_disk folder, .json/.jsonl/.parquet/.txt file(s), or dschat/builtin. "
                            "Setting it enables PPO-ptx (upstream also required a config name).")
    group.add_argument("--unsupervised_dataset_config_name", type=str, default=None,
                       help="The configuration name of the dataset to use (via the datasets library).")
    group.add_argument("--preprocessing_num_workers", type=int, default=None,
                       help="The number of processes to use for the preprocessing. (dschat) A positive "
                            "number, at most this machine's CPUs (more are lowered to them, with a notice); unset: one.")
    return group


def add_step3_model_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("actor and critic")
    group.add_argument("--actor_model_name_or_path", type=user_path, required=True,
                       help="Path to the step-1 actor (a folder, hub id, dschat short name, or PEFT LoRA "
                            "adapter folder: its base model, the adapter merged).")
    group.add_argument("--critic_model_name_or_path", type=user_path, default=None,
                       help="Path to the step-2 reward model output (the critic and reward model start from it), "
                            "or its lora_adapter/ folder (the adapter merged into its base, its value head). "
                            "Required for --algorithm ppo and whenever the reward model scores answers; a "
                            "critic-free algorithm scored by --reward_fn alone needs none.")
    group.add_argument("--reward_model_name_or_path", type=user_path, default=None,
                       help="The reward model's folder (default: --critic_model_name_or_path, as upstream): a step-2 "
                            "output, or a Hugging Face *ForSequenceClassification folder with num_labels 1. Its "
                            "tokenizer may differ from the actor's (another family): each answer is then decoded, "
                            "rendered as prompt + answer (a classifier's: through its chat template, if it has one), "
                            "re-tokenised and cut to its maximum length, keeping the end. The critic needs the "
                            "actor's tokenizer: with another one, or without --critic_model_name_or_path, it starts "
                            "from the actor with a fresh value head.")
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
                            "after the last answer token ('after_last', upstream's) or the last real "
                            "answer token ('last').")
    group.add_argument("--decoding", type=str, default="sample", choices=("sample", "greedy"),
                       help="(dschat) Rollout decoding. 'sample' (default) draws answers from the "
                            "policy, which is what the PPO ratio assumes; 'greedy' reproduces "
                            "upstream's default for OPT and its saved checkpoints.")
    group.add_argument("--temperature", type=float, default=1.0, help="(dschat) Sampling temperature: a finite number >= 1e-6 (fp16: 1e-2) "
                       "(--decoding greedy for lower; greedy decoding uses no --temperature, --top_k, --top_p).")
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
    group.add_argument("--cliprange_high", type=float, default=None,
                       help="(dschat) DAPO's clip-higher: the ratio is clipped to [1 - cliprange, 1 + cliprange_high] "
                            "(default: --cliprange, symmetric).")
    group.add_argument("--dual_clip", type=float, default=None, metavar="C",
                       help="(dschat) Dual-clip PPO: with a negative advantage A a token's loss is at most -C x A "
                            "(C > 1, e.g. 3). Default: off.")
    group.add_argument("--overlong_buffer_len", type=int, default=0, metavar="L",
                       help="(dschat) DAPO's soft overlong punishment: an answer of n tokens (an episode: the actor's "
                            "tokens) with n > M - L (M: --max_answer_seq_len) gets -factor x (n - (M - L)) / L added "
                            "to its score. 0 (default): off.")
    group.add_argument("--overlong_penalty_factor", type=float, default=None,
                       help="(dschat) With --overlong_buffer_len (refused without it): the penalty at n = M "
                            "(not given: 1.0).")
    group.add_argument("--mask_truncated_answers", action="store_true",
                       help="(dschat) DAPO's overlong filtering: answers cut at --max_answer_seq_len without EOS are "
                            "masked out of the loss (their rewards still enter their group's statistics).")
    group.add_argument("--dynamic_sampling", action="store_true",
                       help="(dschat) DAPO's dynamic sampling (grpo, rloo): a group whose answers all got the same "
                            "reward is dropped, and the next prompt batches are sampled until the generation batch "
                            "holds only groups of different rewards or --max_sampling_rounds batches were drawn.")
    group.add_argument("--max_sampling_rounds", type=int, default=None, metavar="N",
                       help="(dschat) With --dynamic_sampling (refused without it): the most generation batches one "
                            "batch may draw, the first included (not given: 4); a batch still short is filled with "
                            "equal-reward groups masked out of the loss.")
    group.add_argument("--importance_sampling_level", type=str, default="token", choices=("token", "sequence"),
                       help="(dschat) 'token' (default): one PPO ratio per token; 'sequence': GSPO's one ratio per "
                            "answer, exp(mean of the answer's token log-ratios), clipped per answer (critic-free "
                            "algorithms; --loss_aggregation auto becomes sequence).")
    group.add_argument("--reward_fn", type=str, action="append", default=None, metavar="MODULE:FUNCTION",
                       help="(dschat) A reward function fn(prompts, answers, **columns) -> list[float] (columns: "
                            "the prompt's other dataset fields). Repeatable; built-ins dschat.rewards:gold (the "
                            "embedded data's gold judge) and dschat.rewards:math_exact_match (column 'answer').")
    group.add_argument("--reward_fn_weight", type=float, action="append", default=None,
                       help="(dschat) Weight of each --reward_fn, in order (default 1.0 each).")
    group.add_argument("--reward_fn_timeout", type=float, default=600.0, metavar="SECONDS",
                       help="(dschat) Longest one call of a --reward_fn or --eval_judge function may take before the "
                            "run stops with an error naming it (default 600; 0: no limit; at most 1e9). Collectives then wait "
                            "this (for each function of a batch's reward, plus --reward_url's worst case) plus 5 "
                            "minutes when that is longer, so the other ranks outwait a stuck call and its line stops "
                            "the run.")
    group.add_argument("--shared_prompt_fields", choices=("refuse", "first"), default=None,
                       help="(dschat) No longer needed, accepted and ignored: every phase-3 prompt carries its "
                            "dataset row, so reward functions, judges and --env get their own row's fields also "
                            "where several rows share a prompt.")
    group.add_argument("--reward_model_weight", type=float, default=None,
                       help="(dschat) Reward model's weight in the reward. Default: 1.0 without --reward_fn, 0 (not "
                            "loaded) with it or --reward_url; give it to combine both.")
    group.add_argument("--reward_url", type=str, default=None, metavar="URL",
                       help="(dschat) A reward server (OpenRLHF's protocol: POST {\"query\", \"prompts\", \"labels\"}, "
                            "reply {\"rewards\"}), e.g. python -m dschat.serve's http://127.0.0.1:PORT/get_reward. "
                            "Weighed into the reward like a --reward_fn. Default: none (nothing is sent).")
    group.add_argument("--reward_url_weight", type=float, default=1.0,
                       help="(dschat) Weight of --reward_url's rewards (default 1.0).")
    group.add_argument("--reward_url_timeout", type=float, default=60.0, metavar="SECONDS",
                       help="(dschat) Seconds one --reward_url attempt may take for each step of connecting (each "
                            "address the host name resolves to, each read of a TLS handshake; the name lookup has no "
                            "limit) and between bytes of the reply; once connected, the attempt (sending, the whole "
                            "reply) also ends twice that after it began. An attempt past a limit counts as failed "
                            "(default 60; at most 1e9).")
    group.add_argument("--reward_url_retries", type=int, default=3,
                       help="(dschat) Retries of a --reward_url request after a connection error, a timeout or an "
                            "HTTP 408/429/5xx, with exponential backoff (0.5 s, 1 s, 2 s, ...); then the run stops "
                            "(default 3).")
    return group


def add_environment_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """(dschat) Multi-turn rollouts: an environment answers each of the actor's turns
    (:mod:`dschat.envs`, :mod:`dschat.rlhf.episodes`); docs/environments.md."""
    group = parser.add_argument_group("environments and tools (dschat)")
    group.add_argument("--env", type=str, default=None, metavar="MODULE:FACTORY",
                       help="(dschat) Multi-turn episodes: factory(row) makes the environment of one prompt's episode "
                            "from its dataset row (all columns); env.step(answer) -> (observation, reward, done). The "
                            "observation is appended to the conversation and the actor answers again, until done or "
                            "--max_turns. Only the actor's tokens are trained on. Built-in: "
                            "dschat.envs_examples:calculator (column 'answer') and dschat.envs_examples:word_game "
                            "(column 'word'; --data_path dschat/wordgame).")
    group.add_argument("--max_turns", type=int, default=4,
                       help="(dschat) With --env: the most actor turns in one episode (default 4); an episode that "
                            "reaches it, or --max_answer_seq_len tokens after the prompt, is cut.")
    group.add_argument("--env_timeout", type=float, default=600.0, metavar="SECONDS",
                       help="(dschat) With --env: longest one factory or step call may take before the run stops with "
                            "an error naming the environment and the row (default 600; 0: no limit; at most 1e9). The calls of a "
                            "batch run concurrently. Collectives wait this plus 5 minutes when that is longer (start-up "
                            "keeps --dist_timeout), so the other ranks outwait a stuck call and its line stops the run.")
    return group


def eval_interval(value: str) -> int | str:
    """``--eval_interval``'s type: an integer or ``auto``."""
    return EVAL_INTERVAL_AUTO if value == EVAL_INTERVAL_AUTO else int(value)


def add_step3_eval_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """(dschat) Step 3's held-out evaluation, over-optimization alarm and best checkpoint
    (:mod:`dschat.rlhf.heldout.evaluation`); docs/evaluation.md "Did step 3 work?"."""
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
                            "(dschat: its own Hybrid Engine, dschat/rlhf/rollout/dschat_engine.py, for Llama, Mistral, Qwen2/3, "
                            "Phi-3, Gemma, OPT, GPT-NeoX; other models fall back to the module, saying why once).")
    group.add_argument("--unpin_actor_parameters", action="store_true",
                       help="Unpin actor's parameters during generation. This makes generation slower "
                            "but requires less memory. (dschat: read only by DeepSpeed's Hybrid Engine, which is "
                            "not built under transformers 5, so not used (step 3 says so); --release_inference_cache "
                            "frees dschat's Hybrid Engine's gathered weights and KV cache.)")
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
                            "sampling loop (dschat/rlhf/rollout/sample_loop.py: the same tokens for a seed as Hugging Face "
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
    group.add_argument("--preflight", type=str, default="on", choices=("on", "off"),
                       help="(dschat) Plan the run's memory per GPU before any model is loaded (python -m "
                            "dschat.plan; docs/memory-plan.md#preflight). On a GPU a run that cannot fit stops with "
                            "one line naming the phase, the shortfall and a configuration that fits; on a CPU the "
                            "plan is printed, not enforced; a run the planner cannot plan gets a note and goes on. "
                            "'off': skip it.")
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
    add_tracker_args(group, tensorboard_path="step3_tensorboard")
    group.add_argument("--print_answers", action="store_true", help="Print prompt and answers during training")
    group.add_argument("--print_answers_interval", type=int, default=1,
                       help="If --print_answers enabled, controls the printing interval.")
    group.add_argument("--enable_test_mode", action="store_true",
                       help="Enable a testing mode that terminates training based on args.test_stop_step")
    group.add_argument("--test_stop_step", type=int, default=0,
                       help="Training non-overflow step at which to terminate training during testing.")
    return group


def add_step3_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every flag of step 3, in ``--help``'s order: step 3's ``main.py``, the memory planner and the
    step-3 config (its defaults for an upstream-style Namespace) build their parsers with it."""
    add_data_args(parser, phase=3)
    add_unsupervised_data_args(parser)
    add_step3_model_args(parser)
    add_step3_training_args(parser)
    add_ppo_args(parser)
    add_algorithm_args(parser)
    add_environment_args(parser)
    add_step3_lora_args(parser)
    add_step3_deepspeed_args(parser)
    add_step3_logging_args(parser)
    add_step3_eval_args(parser)
    add_runtime_args(parser, seed=1234)  # upstream's None was not reproducible
    add_eot_args(parser, eot_token_flag=False)
    add_checkpoint_args(parser)
    add_deepspeed_args(parser)
    return parser


@functools.lru_cache(maxsize=None)
def _step3_defaults() -> dict[str, object]:
    """Every step-3 flag's default, from step 3's parser (:func:`add_step3_args`)."""
    parser = add_step3_args(argparse.ArgumentParser(add_help=False))
    return {action.dest: action.default for action in parser._actions if action.dest != "help"}


def flags_off_default(args: object, names: Iterable[str]) -> set[str]:
    """Those of the step-3 flags ``names`` that ``args`` holds at other than the step-3 parser's default
    (a flag ``args`` lacks is at its default): what a guard refuses when nothing would apply it."""
    defaults = _step3_defaults()
    return {name for name in names if getattr(args, name, defaults[name]) != defaults[name]}


def complete_step3_args(args: object) -> argparse.Namespace:
    """``args`` with every step-3 flag it lacks at the step-3 parser's default (``args`` itself when it
    lacks none; else a new Namespace, ``args`` unchanged). An upstream ``main.py`` parses upstream's
    flags only; dschat's own flags then take their defaults."""
    defaults = _step3_defaults()
    if isinstance(args, argparse.Namespace) and all(hasattr(args, name) for name in defaults):
        return args
    given = {name: getattr(args, name) for name in dir(args) if not name.startswith("_")}
    return argparse.Namespace(**{**defaults, **given})
