"""``DeepSpeedRLHFEngine``: the five DeepSpeed engines of PPO (upstream's ``rlhf_engine.py``).

* **actor** -- trainable, from the step-1 checkpoint (LoRA optional), Hybrid Engine where it works;
* **ref** -- frozen copy of the step-1 checkpoint (the KL anchor);
* **actor_ema** -- optional (``--enable_ema``), the exponential moving average of the actor;
* **critic** -- trainable, from the step-2 checkpoint (LoRA optional);
* **reward** -- frozen, from the same step-2 checkpoint, or ``--reward_model_name_or_path``.

Where the critic and the reward model come from (:class:`ModelSources`, :func:`resolve_model_sources`):
the critic reads the actor's token ids, so it starts from ``--critic_model_name_or_path`` only when
that folder's tokenizer is the actor's, else from the actor with a fresh value head (one line says
so). The reward model (default: the critic's folder, upstream's behaviour) may have another
tokenizer: it then scores re-tokenised text (:class:`~dschat.models.reward_inputs.CrossTokenizerInputs`)
and keeps its own embedding size.

Upstream's placement rules: reference and EMA use ZeRO-3 only if the actor does (else stage 0);
the reward model uses ZeRO-3 only if the critic does. ``--offload_reference_model`` applies to the
reference *and* the EMA model; the actor/critic optimizers offload with ``--offload``. The actor's
batch keys use ``gradient_accumulation_steps x 2`` with PPO-ptx (its ``step()`` runs twice per
micro-batch). Every config comes from the one builder (:func:`ds_config_for`), from step 3's ZeRO part
(:class:`~dschat.rlhf.config.ZeroConfig`); the models from its models part
(:class:`~dschat.rlhf.config.ModelsConfig`).

The Hybrid Engine is only enabled where it can work (:mod:`dschat.rlhf.rollout.deepspeed_engine`); the EMA
model starts as an exact copy of the actor, LoRA factors included; with ``--only_optimize_lora`` the
critic's value head stays trainable, as in step 2 (upstream differences: docs/upstream.md#step-3-ppo).
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from deepspeed import DeepSpeedEngine
from deepspeed.accelerator import get_accelerator
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from dschat.cli.step3 import complete_step3_args
from dschat.errors import UserError
from dschat.models.build import aligned_vocab_rows, create_critic_model, create_hf_model
from dschat.models.registry import load_config, resolve_model_path
from dschat.models.reward_inputs import CrossTokenizerInputs, reward_max_length
from dschat.models.tokenizer import load_hf_tokenizer, tokenizer_differences
from dschat.rlhf.actor_ema import moving_average
from dschat.rlhf.config import (
    ModelsConfig,
    ModelSpec,
    Step3Config,
    ZeroConfig,
    models_config,
    ppo_config,
    rollout_config,
    zero_config,
)
from dschat.rlhf.rollout import deepspeed_engine  # decide_hybrid_engine called through the module: tests replace it
from dschat.rlhf.rollout.generator import RolloutGenerator
from dschat.rlhf.rollout.tensor_parallel import check_inference_tp
from dschat.runtime.dist import get_world_size, is_rank_0
from dschat.runtime import ds_config as ds_utils  # upstream's utils/ds_utils.py
from dschat.runtime.ds_config import resolve_dtype
from dschat.runtime.zero3 import begin_passes_with_dschats_rule, release_zero3_prefetch
from dschat.training.engine_setup import OptimSettings, apply_lora, initialize_engine

__all__ = ["DeepSpeedRLHFEngine", "ModelSources", "resolve_model_sources", "log_init", "ds_config_for", "ROLES"]

ROLES = ("actor", "ref", "ema", "critic", "reward")


@dataclass(frozen=True)
class ModelSources:
    """The folders step 3's critic and reward model are built from.

    ``critic``: the critic's folder (the actor's when ``critic_from_actor``: body of the actor, fresh
    value head); ``reward``: the reward model's folder; ``reward_tokenizer``: its tokenizer when it
    differs from the actor's (it then scores re-tokenised text), None when it reads the actor's ids.
    ``notes``: the lines that say what was chosen and why."""

    critic: str | None
    reward: str | None
    critic_from_actor: bool = False
    reward_tokenizer: PreTrainedTokenizerBase | None = None
    notes: tuple[str, ...] = ()


def _differences(tokenizer: PreTrainedTokenizerBase, path: str, role: str) -> tuple[list[str], PreTrainedTokenizerBase]:
    try:
        other = load_hf_tokenizer(path)
    except UserError as err:
        raise UserError(f"cannot compare the tokenizer of the {role} {path} with the actor's: {err}") from None
    return tokenizer_differences(tokenizer, other), other


def resolve_model_sources(actor: str, critic: str | None, reward: str | None, tokenizer: PreTrainedTokenizerBase,
                          *, needs_critic: bool, needs_reward: bool) -> ModelSources:
    """Where the critic and the reward model come from. ``reward`` defaults to ``critic``
    (``--reward_model_name_or_path`` unset). The critic starts from ``critic`` when its tokenizer is
    the actor's ``tokenizer``, else (another tokenizer, or no ``critic``) from ``actor`` with a fresh
    value head; the reward model keeps its folder and, when its tokenizer differs, its tokenizer."""
    reward = reward or critic
    notes: list[str] = []
    critic_source, from_actor = critic, False
    if needs_critic:
        if critic is None:
            critic_source, from_actor = actor, True
            notes.append(f"critic: no --critic_model_name_or_path; the critic starts from the actor {actor} with a "
                         "fresh value head")
        else:
            differences, _ = _differences(tokenizer, resolve_model_path(critic), "critic")
            if differences:
                critic_source, from_actor = actor, True
                notes.append(f"critic: the tokenizer of {critic} differs from the actor's ({'; '.join(differences)}); "
                             f"the critic starts from the actor {actor} with a fresh value head")
    reward_tokenizer = None
    if needs_reward and reward is not None:
        differences, other = _differences(tokenizer, resolve_model_path(reward), "reward model")
        if differences:
            reward_tokenizer = other
            notes.append(f"reward model: the tokenizer of {reward} differs from the actor's ({'; '.join(differences)}); "
                         "it scores each answer decoded and re-tokenised with its own tokenizer")
    return ModelSources(critic_source, reward, from_actor, reward_tokenizer, tuple(notes))


def log_init(model_name: str, stime: float | None = None) -> float:
    """Upstream's 90-column banner: ``[start] Initializing Actor Model [start]`` / ``[end] ...``."""
    if is_rank_0():
        tag = "start" if stime is None else "end"
        suffix = "ing" if stime is None else "ed"
        duration = "" if stime is None else "(duration: {:.2f}s)".format(time.time() - stime)
        msg = f"[{tag}] Initializ{suffix} {model_name} Model [{tag}] {duration}"
        stars = (90 - len(msg)) // 2
        extra_star = "*" if (90 - len(msg)) % 2 == 1 else ""
        print("*" * stars + msg + "*" * stars + extra_star, flush=True)
    return time.time()


def ds_config_for(role: str, zero: ZeroConfig, *, dtype: str, hybrid_engine: bool = False,
                  world_size: int | None = None) -> dict:
    """The DeepSpeed config of one step-3 engine (``role`` in :data:`ROLES`), from step 3's ZeRO part.

    Stage rules as upstream: ref/EMA ZeRO-3 iff the actor is, reward ZeRO-3 iff the critic is (else
    stage 0). Micro-batch = ``per_device_training_batch_size``; gradient accumulation = the actor's
    (doubled with PPO-ptx) for actor/ref/EMA, the plain one for critic/reward.
    """
    ga, ga_actor = zero.gradient_accumulation_steps, zero.gradient_accumulation_steps_actor
    batch = {"micro_batch_size": zero.micro_batch_size, "world_size": world_size}
    if role == "actor":
        return ds_utils.get_train_ds_config(
            offload=zero.offload, dtype=dtype, stage=zero.actor_zero_stage,
            enable_hybrid_engine=hybrid_engine, inference_tp_size=zero.inference_tp_size,
            release_inference_cache=zero.release_inference_cache,
            pin_parameters=zero.pin_parameters,
            tp_gather_partition_size=zero.tp_gather_partition_size,
            max_out_tokens=zero.max_out_tokens,
            enable_tensorboard=zero.enable_tensorboard,
            enable_mixed_precision_lora=zero.enable_mixed_precision_lora,
            tb_path=zero.tensorboard_path, tb_name="step3_actor",
            gradient_accumulation_steps=ga_actor, **batch)
    if role in ("ref", "ema"):
        stage = 3 if zero.actor_zero_stage == 3 else 0
        return ds_utils.get_eval_ds_config(zero.offload_reference_model, dtype, stage, gradient_accumulation_steps=ga_actor, **batch)
    if role == "critic":
        return ds_utils.get_train_ds_config(
            offload=zero.offload, dtype=dtype, stage=zero.critic_zero_stage,
            enable_tensorboard=zero.enable_tensorboard, tb_path=zero.tensorboard_path, tb_name="step3_critic",
            gradient_accumulation_steps=ga, **batch)
    if role == "reward":
        stage = 3 if zero.critic_zero_stage == 3 else 0
        return ds_utils.get_eval_ds_config(zero.offload_reward_model, dtype, stage, gradient_accumulation_steps=ga, **batch)
    raise ValueError(f"unknown role {role!r}; one of {ROLES}")


def _apply_lora(model: nn.Module, role: str, lora_dim: int, module_name: str, only_optimize: bool,
                force_optimize: tuple[str, ...] = ()) -> nn.Module:
    """``dschat.training.engine_setup.apply_lora`` with step 3's flag names in its error messages."""
    try:
        return apply_lora(model, lora_dim, module_name, only_optimize, force_optimize)
    except UserError as err:
        raise UserError(str(err).replace("--lora_module_name", f"--{role}_lora_module_name")) from None


class DeepSpeedRLHFEngine:
    """Builds and holds ``actor``, ``ref``, ``actor_ema`` (or None), ``critic``, ``reward`` engines.

    Upstream's signature. ``with_reward_model=False`` skips the reward engine (``reward`` is None),
    for runs that score answers with reward functions only; ``with_critic=False`` skips the critic
    (``critic`` is None), for the critic-free algorithms. ``config``: step 3's
    :class:`~dschat.rlhf.config.Step3Config`, whose models, ZeRO and rollout parts (and the PPO part's
    answer length) the engine reads; without it (upstream's signature) those parts are built from
    ``args``, dschat's flags at their defaults. ``sources`` (:func:`resolve_model_sources`): where the
    critic and the reward model come from; without it (upstream's signature) both come from
    ``critic_model_name_or_path``, read with the actor's token ids.
    """

    def __init__(self, actor_model_name_or_path: str, critic_model_name_or_path: str | None,
                 tokenizer: PreTrainedTokenizerBase, args: argparse.Namespace, num_total_iters: int, *,
                 with_reward_model: bool = True, with_critic: bool = True,
                 config: Step3Config | None = None, sources: ModelSources | None = None) -> None:
        self.args = args  # upstream's attribute
        self.models: ModelsConfig
        self.zero: ZeroConfig
        if config is None:
            args = complete_step3_args(args)
            self.models, self.zero, rollout = models_config(args), zero_config(args), rollout_config(args)
            max_answer_seq_len = ppo_config(args).max_answer_seq_len
        else:
            self.models, self.zero, rollout = config.models, config.zero, config.rollout
            max_answer_seq_len = config.ppo.max_answer_seq_len
        models, zero = self.models, self.zero
        self.num_total_iters = num_total_iters
        self.tokenizer = tokenizer
        self.dtype = resolve_dtype(models.dtype)
        self.world_size = get_world_size()
        self.sources = sources or ModelSources(critic_model_name_or_path, critic_model_name_or_path)
        self.critic_from_actor = self.sources.critic_from_actor
        actor_config = load_config(resolve_model_path(actor_model_name_or_path))
        # The critic and a reward model of the actor's tokenizer read the ids the actor samples: one
        # embedding size for all (a critic-free run scored by reward functions alone loads neither).
        configs = {"actor": actor_config}
        reads_actor_ids = {}
        if with_critic and not self.critic_from_actor:
            reads_actor_ids["critic"] = self.sources.critic
        if with_reward_model and self.sources.reward_tokenizer is None:
            reads_actor_ids["reward model"] = self.sources.reward
        if len(set(reads_actor_ids.values())) == 1:  # one folder: the message names it once
            reads_actor_ids = {"/".join(reads_actor_ids): next(iter(reads_actor_ids.values()))}
        for name, path in reads_actor_ids.items():
            configs[name] = load_config(resolve_model_path(path))
        self.vocab_rows, note = aligned_vocab_rows(tokenizer, configs)
        if note and is_rank_0():
            print(note, flush=True)
        self.hybrid_engine = deepspeed_engine.decide_hybrid_engine(zero.enable_hybrid_engine, actor_config,
                                                                get_accelerator().device_name())
        check_inference_tp(zero.inference_tp_size, actor_config, self.world_size, zero.enable_hybrid_engine)

        self.actor = self._init_actor(actor_model_name_or_path)
        self.ref = self._init_ref(actor_model_name_or_path)
        self.actor_ema = self._init_ema(actor_model_name_or_path) if models.enable_ema else None
        self.critic = self._init_critic(self.sources.critic) if with_critic else None
        self.reward = self._init_reward(self.sources.reward) if with_reward_model else None
        if models.critic.gradient_checkpointing and self.critic is not None:
            # Permanently on for the critic (upstream); the actor's is toggled around training only.
            self.critic.module.gradient_checkpointing_enable()

        self.generator = RolloutGenerator(
            self.actor, tokenizer, decision=self.hybrid_engine, decoding=rollout.decoding,
            max_answer_seq_len=max_answer_seq_len, zero_stage=zero.actor_zero_stage,
            zero3_gather=rollout.zero3_gather, generation_loop=rollout.generation_loop,
            cpu_decode_linear=rollout.cpu_decode_linear,
            release_inference_cache=zero.release_inference_cache,
            inference_tp_size=zero.inference_tp_size, tp_gather_partition_size=zero.tp_gather_partition_size,
            chat_turn_end=rollout.env is not None,  # episodes continue through the chat template
        )
        # A reward model of another tokenizer reads each answer re-tokenised, at most its own length,
        # as ended where the rollout ended it.
        self.reward_inputs: CrossTokenizerInputs | None = None
        if self.reward is not None and self.sources.reward_tokenizer is not None:
            self.reward_inputs = CrossTokenizerInputs(
                tokenizer, self.sources.reward_tokenizer,
                reward_max_length(self.sources.reward_tokenizer, self.reward.module.config),
                end_ids=self.generator.end_ids, template=self.reward.module.reads_chat_template)

    # ------------------------------------------------------------------ helpers
    def release_prefetch(self) -> None:
        """Leave no ZeRO-3 parameter of any engine in flight (the end of a run: the group is destroyed
        at exit, and the reference and reward engines are never saved, which would release theirs).
        Collective: every rank calls it."""
        for engine in (self.actor, self.ref, self.actor_ema, self.critic, self.reward):
            if engine is not None:
                release_zero3_prefetch(engine)

    def _config(self, role: str) -> dict:
        return ds_config_for(role, self.zero, dtype=self.dtype, hybrid_engine=self.hybrid_engine.enabled,
                             world_size=self.world_size)

    def _optim(self, spec: ModelSpec) -> OptimSettings:
        return OptimSettings(lr=spec.learning_rate, weight_decay=spec.weight_decay, lora_lr=spec.lora_learning_rate,
                             offload=self.zero.offload, scheduler=self.models.lr_scheduler_type,
                             num_warmup_steps=self.models.num_warmup_steps, num_training_steps=self.num_total_iters)

    # ------------------------------------------------------------------ the five engines
    def _init_actor(self, actor_model_name_or_path: str) -> DeepSpeedEngine:
        stime = log_init("Actor")
        spec = self.models.actor
        ds_config = self._config("actor")
        model = create_hf_model(AutoModelForCausalLM, actor_model_name_or_path, self.tokenizer, ds_config,
                                dropout=spec.dropout, vocab_rows=self.vocab_rows)
        model = _apply_lora(model, "actor", spec.lora_dim, spec.lora_module_name, self.models.only_optimize_lora)
        engine = initialize_engine(model, ds_config, self._optim(spec))
        if self.zero.enable_mixed_precision_lora:
            # MixZ++: quantise the frozen (non-LoRA) weights; upstream did this in main.py.
            if not hasattr(engine.optimizer, "quantize_nontrainable_params"):
                raise UserError(
                    f"--enable_mixed_precision_lora: this DeepSpeed's {type(engine.optimizer).__name__} cannot "
                    "quantise frozen weights (ZeRO++ needs --actor_zero_stage 3 on CUDA); drop the flag")
            engine.optimizer.quantize_nontrainable_params()
            if is_rank_0():
                print("Mixed Precision ZeRO++ enabled")
        begin_passes_with_dschats_rule(engine)  # ZeRO-3: generation passes do not cut the training trace short
        log_init("Actor", stime=stime)
        return engine

    def _init_ref(self, actor_model_name_or_path: str) -> DeepSpeedEngine:
        stime = log_init("Ref")
        ds_config = self._config("ref")
        model = create_hf_model(AutoModelForCausalLM, actor_model_name_or_path, self.tokenizer, ds_config,
                                vocab_rows=self.vocab_rows)
        engine = initialize_engine(model, ds_config, None)
        log_init("Ref", stime=stime)
        return engine

    def _init_ema(self, actor_model_name_or_path: str) -> DeepSpeedEngine:
        stime = log_init("EMA")
        spec = self.models.actor
        ds_config = self._config("ema")
        model = create_hf_model(AutoModelForCausalLM, actor_model_name_or_path, self.tokenizer, ds_config,
                                dropout=spec.dropout, vocab_rows=self.vocab_rows)  # saved config as the actor's
        # Same LoRA structure as the actor, so the two parameter lists zip one to one. The EMA has no
        # optimizer: requires_grad mirrors the actor's only to mark what the averaging moves (what its
        # saved PEFT adapter must hold); lerp(x, x) == x leaves the actor's frozen weights exact.
        model = _apply_lora(model, "actor", spec.lora_dim, spec.lora_module_name, self.models.only_optimize_lora)
        engine = initialize_engine(model, ds_config, None)
        moving_average(self.actor, engine, beta=0.0)  # start as an exact copy (LoRA factors included)
        log_init("EMA", stime=stime)
        return engine

    def _init_critic(self, critic_model_name_or_path: str) -> DeepSpeedEngine:
        stime = log_init("Critic")
        models, spec = self.models, self.models.critic
        ds_config = self._config("critic")
        # From the actor (its tokenizer differs from the critic folder's, or none was given): the
        # actor's body and a fresh value head, as step 2 starts.
        model = create_critic_model(critic_model_name_or_path, self.tokenizer, ds_config,
                                    num_padding_at_beginning=models.num_padding_at_beginning,
                                    rlhf_training=not self.critic_from_actor,
                                    dropout=spec.dropout, zero_stage=self.zero.critic_zero_stage,
                                    compute_fp32_loss=models.compute_fp32_loss, vocab_rows=self.vocab_rows)
        model = _apply_lora(model, "critic", spec.lora_dim, spec.lora_module_name,
                            models.only_optimize_lora, force_optimize=("v_head.weight",))
        engine = initialize_engine(model, ds_config, self._optim(spec))
        begin_passes_with_dschats_rule(engine)  # ZeRO-3: scoring passes do not cut the training trace short
        log_init("Critic", stime=stime)
        return engine

    def _init_reward(self, reward_model_name_or_path: str) -> DeepSpeedEngine:
        stime = log_init("Reward")
        models = self.models
        ds_config = self._config("reward")
        stage = ds_config["zero_optimization"]["stage"]
        # Another tokenizer: its own pad id and embedding size (it never reads the actor's ids).
        own_tokenizer = self.sources.reward_tokenizer
        model = create_critic_model(reward_model_name_or_path, own_tokenizer or self.tokenizer, ds_config,
                                    num_padding_at_beginning=models.num_padding_at_beginning, rlhf_training=True,
                                    dropout=models.critic.dropout, zero_stage=stage,
                                    compute_fp32_loss=models.compute_fp32_loss,
                                    vocab_rows=None if own_tokenizer is not None else self.vocab_rows)
        engine = initialize_engine(model, ds_config, None)
        log_init("Reward", stime=stime)
        return engine
