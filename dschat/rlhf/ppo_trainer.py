"""PPO trainer (upstream's ``dschat/rlhf/ppo_trainer.py``): :class:`DeepSpeedPPOTrainer`, a facade
with upstream's method names over two parts that share one set of scoring passes.

* :class:`~dschat.rlhf.experience_maker.ExperienceMaker` generates and scores a rollout batch into an
  :class:`~dschat.rlhf.experience.Experience` (``generate_experience``) and fills in a rollout's
  advantages and returns (``prepare_rollout``);
* :class:`~dschat.rlhf.ppo_update.PPOUpdate` schedules the micro-steps (``schedule``) and runs the
  actor and critic steps (``train_rlhf``), the PPO-ptx step, fp16 overflow alignment;
* :class:`~dschat.rlhf.scoring_passes.ScoringPasses` runs both parts' forwards (log-probs, values,
  packing, ZeRO-3 gathers).

The trainer is itself the :class:`~dschat.rlhf.ppo_formulas.PPOFormulas` both parts use (upstream's
``compute_rewards``, ``get_advantages_and_returns``, ``actor_loss_fn``, ``critic_loss_fn`` with the
flags' hyperparameters), so code written against upstream that overrides one of them, or changes a
hyperparameter on the trainer, changes what the run computes. Upstream's other names
(``generate_experience``, ``train_rlhf``, ``train_unsupervised``, ``get_overflow``, ``train``,
``eval``, the debugging helpers) stay here and hand over to the parts, for code written against
upstream; step 3's own loop (:func:`dschat.rlhf.ppo_loop.run_ppo`) calls the parts directly.
"""
from __future__ import annotations

import argparse

import torch
from deepspeed import DeepSpeedEngine

from dschat.rl_math.logprobs import gather_log_probs  # also upstream's module-level name here
from dschat.data.prompt_columns import PromptColumns
from dschat.envs import load_environment
from dschat.models.packing import PackedRows
from dschat.rewards import RewardFunction, RewardMix
from dschat.rlhf.config import BatchPlan, Step3Config, step3_config
from dschat.rlhf.episodes import EpisodePlayer
from dschat.rlhf.experience import Experience
from dschat.rlhf.experience_maker import ExperienceMaker, RewardFn, RolloutStats
from dschat.rlhf.rollout.generator import RolloutGenerator
from dschat.rlhf.ppo_formulas import PPOFormulas
from dschat.rlhf.ppo_update import MicroStepStats, PPOUpdate, Schedule
from dschat.rlhf.rlhf_engine import DeepSpeedRLHFEngine
from dschat.rlhf.scoring_passes import ScoringGather, ScoringPasses, TrainingGather
from dschat.runtime.dist import all_reduce_sum, get_rank, get_world_size
from dschat.runtime.zero3 import gathered_parameters
from dschat.training.nonfinite import NonFiniteGuard

__all__ = [
    "RewardFn",
    "MicroStepStats",
    "RolloutStats",
    "DeepSpeedPPOTrainer",
    "DeepSpeedPPOTrainerUnsupervised",
    "gather_log_probs",
    "get_model_norm",
    "print_all_ranks",
]



def print_all_ranks(tag: str, value: float, rank: int) -> None:
    """Upstream's debugging helper: rank 0 prints ``tag`` and every rank's ``value`` (a collective)."""
    world = get_world_size()
    values = torch.zeros(world, dtype=torch.float64)
    values[rank] = float(value)
    values = all_reduce_sum(values)
    if rank <= 0:
        print(f"{tag} {values.tolist()}")


def get_model_norm(model: DeepSpeedEngine | torch.nn.Module) -> float:
    """L2 norm over all of ``model``'s parameters (upstream's debugging helper). Under ZeRO-3 each
    parameter is gathered in turn, so every rank must call it."""
    return sum(float(param.float().pow(2).sum()) for _, param in gathered_parameters(model)) ** 0.5


class DeepSpeedPPOTrainer(PPOFormulas):
    """PPO -- and the critic-free algorithms of ``--algorithm`` -- on the engines of a
    :class:`~dschat.rlhf.rlhf_engine.DeepSpeedRLHFEngine` (whose ``critic`` is None for those):
    :meth:`generate_experience` and :meth:`prepare_rollout` (its :attr:`experience` maker), then
    :meth:`schedule` and one :meth:`train_rlhf` per micro-step (its :attr:`update`).

    ``config`` is step 3's :class:`~dschat.rlhf.config.Step3Config` (the trainer reads its batch plan,
    reward, algorithm, PPO, rollout and ZeRO parts). Without it (upstream's signature) the config is
    :func:`~dschat.rlhf.config.step3_config` of ``args``: ``plan`` defaults to its batch plan for this
    world size; the reward is ``reward_mix``
    (reward model and ``--reward_fn`` functions by weight), or a bare ``reward_fn`` (a
    :data:`~dschat.rlhf.experience_maker.RewardFn`) that replaces the reward model. ``prompt_columns``
    gives reward functions the dataset fields beside each prompt.
    """

    def __init__(self, rlhf_engine: DeepSpeedRLHFEngine, args: argparse.Namespace, *, plan: BatchPlan | None = None,
                 reward_fn: RewardFn | None = None, reward_mix: RewardMix | None = None,
                 prompt_columns: PromptColumns | None = None, config: Step3Config | None = None) -> None:
        if config is None:
            if reward_mix is None:
                reward_mix = (RewardMix((RewardFunction("reward_fn", reward_fn, require_finite=False),),
                                        model_weight=0.0) if reward_fn is not None else RewardMix())
            config = step3_config(args, get_world_size(), reward_mix, batches=plan)
        self.config = config
        self.rlhf_engine = rlhf_engine
        self.args = args
        self.actor_model = rlhf_engine.actor
        self.critic_model = rlhf_engine.critic
        self.ref_model = rlhf_engine.ref
        self.reward_model = rlhf_engine.reward
        self.generator: RolloutGenerator = rlhf_engine.generator
        self.tokenizer = rlhf_engine.tokenizer
        self.dtype = rlhf_engine.dtype
        # Upstream's attribute. An answer ends at any of self.generator.end_ids: the tokenizer's EOS and
        # the generation config's EOS ids (docs/upstream.md#small-fixes).
        self.end_of_conversation_token_id = self.tokenizer.eos_token_id
        self.z3_enabled = config.zero.actor_zero_stage == 3
        self.reward_fn = reward_fn
        reward_mix, settings, ppo = config.reward, config.algorithm, config.ppo
        if reward_mix.uses_model and self.reward_model is None:
            raise ValueError("DeepSpeedPPOTrainer needs a reward model or a reward_fn")
        if settings.critic and self.critic_model is None:
            raise ValueError(f"--algorithm {settings.algorithm} needs a critic engine")
        self.init_formulas(ppo, settings)
        self.plan = config.batches

        self.passes = ScoringPasses(
            {"actor": self.actor_model, "reference": self.ref_model, "critic": self.critic_model,
             "reward": self.reward_model if reward_mix.uses_model else None},
            packing=ppo.sequence_packing, temperature=self.generator.decoding.logit_temperature,
            fp32=ppo.compute_fp32_loss, scoring_gather=ppo.zero3_gather_for_scoring,
            training_gather=ppo.zero3_gather_for_training,
            reward_inputs=getattr(rlhf_engine, "reward_inputs", None))
        # --max_nonfinite_steps: rollouts and micro-steps with NaN/inf are skipped, counted, logged;
        # step 3's main points ``last_checkpoint`` at its checkpoints for the stop message.
        self.nonfinite = NonFiniteGuard(ppo.max_nonfinite_steps, get_rank(), self.device)
        rollout = config.rollout
        episodes = None
        if rollout.env:  # multi-turn episodes: the environment answers each turn
            episodes = EpisodePlayer(self.generator, self.tokenizer, load_environment(rollout.env, rollout.env_timeout),
                                     max_turns=rollout.max_turns, max_answer_seq_len=ppo.max_answer_seq_len,
                                     max_context=config.zero.max_out_tokens)
        self.experience = ExperienceMaker(
            self.generator, self.tokenizer, self.passes, self, reward_mix, prompt_columns=prompt_columns,
            nonfinite=self.nonfinite, print_answers=rollout.print_answers,
            print_answers_interval=rollout.print_answers_interval, episodes=episodes)
        self.update = PPOUpdate(self.passes, self, self.plan, ppo_epochs=ppo.ppo_epochs, nonfinite=self.nonfinite,
                                dtype=self.dtype, align_overflow=ppo.align_overflow)

    # ================================================================== the parts' state, upstream's names
    @property
    def device(self) -> torch.device:
        return self.passes.device

    @property
    def reward_mix(self) -> RewardMix:
        return self.experience.reward_mix

    @property
    def prompt_columns(self) -> PromptColumns | None:
        return self.experience.prompt_columns

    @property
    def logit_temperature(self) -> float:
        return self.passes.temperature

    @property
    def packing(self) -> dict[str, bool]:
        """Which models run their passes over a rollout on packed rows (``--sequence_packing``)."""
        return self.passes.packing

    @packing.setter
    def packing(self, value: dict[str, bool]) -> None:
        self.passes.packing = value

    @property
    def packing_span(self) -> int | None:
        return self.passes.packing_span

    @property
    def scoring_gather(self) -> ScoringGather:
        return self.passes.scoring_gather

    @scoring_gather.setter
    def scoring_gather(self, value: ScoringGather) -> None:
        self.passes.scoring_gather = value

    @property
    def training_gather(self) -> TrainingGather:
        return self.passes.training_gather

    @training_gather.setter
    def training_gather(self, value: TrainingGather) -> None:
        self.passes.training_gather = value

    @property
    def reuse_rollout_logprobs(self) -> bool:
        """Old log-probs from generation instead of a second actor pass (benchmarks/step3.py's baseline
        turns it off)."""
        return self.experience.reuse_rollout_logprobs

    @reuse_rollout_logprobs.setter
    def reuse_rollout_logprobs(self, value: bool) -> None:
        self.experience.reuse_rollout_logprobs = value

    @property
    def generate_time(self) -> float:
        """The last :meth:`generate_experience` call's generation, in seconds (upstream)."""
        return self.experience.generate_time

    @property
    def experience_time(self) -> float:
        """... and its scoring passes, in seconds."""
        return self.experience.experience_time

    @property
    def align_overflow(self) -> bool:
        return self.update.align_overflow

    @property
    def micro_stats(self) -> list[MicroStepStats]:
        return self.update.micro_stats

    # ================================================================== experience
    def generate_experience(self, prompts: torch.Tensor, mask: torch.Tensor, step: int,
                            sources: torch.Tensor | None = None) -> Experience | None:
        """Generate one rollout batch and score it. ``None`` when no rank kept any answer.
        Shapes: prompts, mask (B, P) left-padded; ``sources`` (B, 3): the batch's ``prompt_sources``
        (:meth:`~dschat.rlhf.experience_maker.ExperienceMaker.generate_experience`). Collective."""
        return self.experience.generate_experience(prompts, mask, step, sources)

    def _generate_sequence(self, prompts: torch.Tensor, mask: torch.Tensor, step: int) -> torch.Tensor | None:
        """Upstream's generation half of :meth:`generate_experience`: the models put in evaluation mode,
        then the ``(B', P + A)`` sequences (left-padded prompt, answer, padding; with ``--env`` the
        episodes) of the rows whose answer has more than one token, as upstream's, or ``None`` when no
        row of this rank has one (upstream drops such rows; :meth:`generate_experience` keeps them
        masked out). Printed with ``--print_answers``. Collective."""
        maker = self.experience
        maker.eval()
        generated = maker.generate_answers(prompts, mask, step)
        keep = generated.masks.answer_lengths > 1
        maker._report_dropped(prompts, generated.seq, keep, step)
        return generated.seq[keep] if bool(keep.any()) else None

    def prepare_rollout(self, exp_dataset: list[Experience]) -> RolloutStats:
        """Fill in advantages / returns of every micro-batch of a rollout; rollout statistics over
        every rank (collective)."""
        self.update.mark_rollout()
        return self.experience.prepare_rollout(exp_dataset)

    # Passes and rewards by upstream-style names (the held-out evaluation scores with them too).
    def _log_probs(self, logits: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
        return self.passes.log_probs(logits, seq)

    def _token_log_probs(self, name: str, model: DeepSpeedEngine, seq: torch.Tensor, attention_mask: torch.Tensor,
                         position_ids: torch.Tensor, packed: PackedRows | None) -> torch.Tensor:
        return self.passes.token_log_probs(name, model, seq, attention_mask, position_ids, packed)

    def _token_values(self, seq: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                      packed: PackedRows | None) -> torch.Tensor:
        return self.passes.token_values(seq, attention_mask, position_ids, packed)

    def _packed(self, seq: torch.Tensor, attention_mask: torch.Tensor, *names: str) -> PackedRows | None:
        return self.passes.packed(seq, attention_mask, *names)

    def _reward_scores(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, seq: torch.Tensor,
                       attention_mask: torch.Tensor, position_ids: torch.Tensor,
                       packed: PackedRows | None = None, sources: torch.Tensor | None = None) -> torch.Tensor:
        return self.experience._reward_scores(prompts, prompt_mask, seq, attention_mask, position_ids, packed,
                                              sources)

    def _decode_for_hook(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, seq: torch.Tensor,
                         attention_mask: torch.Tensor) -> tuple[list[str], list[str]]:
        return self.experience._decode_for_hook(prompts, prompt_mask, seq, attention_mask)

    # ================================================================== the update
    def schedule(self, exp_dataset: list[Experience], unsup_dataset: list[dict] | None) -> Schedule:
        """The micro-steps of one rollout in training order: ``(ppo_epoch, experience, ptx batch)``."""
        return self.update.schedule(exp_dataset, unsup_dataset)

    def train_rlhf(self, inputs: Experience) -> tuple[torch.Tensor, torch.Tensor]:
        """One PPO micro-step: actor update, then critic update. Returns (actor_loss, critic_loss)."""
        return self.update.train_rlhf(inputs)

    def get_overflow(self) -> tuple[bool, bool]:
        """(actor, critic) fp16 loss-scale overflow of the last step; never with bf16 / fp32."""
        return self.update.get_overflow()

    def pop_micro_stats(self) -> list[MicroStepStats]:
        return self.update.pop_micro_stats()

    def dump_model_norms(self, tag: str) -> None:
        """Upstream's debugging helper: every rank's parameter norm of the four models, printed by
        rank 0 (a collective: call it on every rank)."""
        rank = get_rank()
        models = {"actor": self.actor_model, "ref": self.ref_model, "critic": self.critic_model,
                  "reward": self.reward_model}
        for name, model in models.items():
            if model is not None:
                print_all_ranks(f"{tag} {name}_model_norm", get_model_norm(model), rank)

    # ================================================================== modes
    def _validate_training_mode(self) -> None:
        self.update._validate_training_mode()

    def _validate_evaluation_mode(self) -> None:
        assert not self.actor_model.module.training
        assert self.critic_model is None or not self.critic_model.module.training
        assert not self.ref_model.module.training
        if self.reward_model is not None:
            assert not self.reward_model.module.training

    def train(self) -> None:
        self.update.train()

    def eval(self) -> None:
        self.experience.eval()


class DeepSpeedPPOTrainerUnsupervised(DeepSpeedPPOTrainer):
    """PPO-ptx (InstructGPT eq. 2): after each PPO micro-step the actor also takes a language-model
    step on a pretraining batch, weighted by ``unsup_coef``. The actor's gradient accumulation is
    doubled so the PPO and ptx gradients of a micro-batch land in the same optimizer update."""

    def train_unsupervised(self, inputs: dict[str, torch.Tensor], unsup_coef: float) -> torch.Tensor:
        return self.update.train_unsupervised(inputs, unsup_coef)
