"""The training steps a recipe can launch: key, number, folder and positional parameters."""
from __future__ import annotations

from dataclasses import dataclass

from dschat.errors import UserError

PARAMS_1_2: tuple[str, ...] = ("output_dir", "zero_stage")
PARAMS_3: tuple[str, ...] = ("actor_model", "critic_model", "actor_zero_stage", "critic_zero_stage", "output_dir")
ZERO_STAGE_PARAMS = frozenset({"zero_stage", "actor_zero_stage", "critic_zero_stage"})
# Upstream's shell variable names for the positionals, used in the generated scripts' usage lines.
SHELL_NAMES: dict[str, str] = {
    "output_dir": "OUTPUT",
    "zero_stage": "ZERO_STAGE",
    "actor_model": "ACTOR_MODEL_PATH",
    "critic_model": "CRITIC_MODEL_PATH",
    "actor_zero_stage": "ACTOR_ZERO_STAGE",
    "critic_zero_stage": "CRITIC_ZERO_STAGE",
}


@dataclass(frozen=True)
class StepSpec:
    """One training step: its key, number, folder and positional parameters."""

    key: str
    number: int
    folder: str  # relative to the repository root
    params: tuple[str, ...]
    title: str

    @property
    def config_file(self) -> str:
        return f"configs/{self.key}.yaml"

    @property
    def main_py(self) -> str:
        return f"{self.folder}/main.py"


STEPS: dict[str, StepSpec] = {
    "step1": StepSpec("step1", 1, "training/step1_supervised_finetuning", PARAMS_1_2, "supervised fine-tuning (SFT)"),
    "step2": StepSpec("step2", 2, "training/step2_reward_model_finetuning", PARAMS_1_2, "reward model"),
    "dpo": StepSpec("dpo", 2, "training/step2_dpo_finetuning", PARAMS_1_2, "DPO"),
    "step3": StepSpec("step3", 3, "training/step3_rlhf_finetuning", PARAMS_3, "PPO (RLHF)"),
}
STEP_ALIASES: dict[str, str] = {
    "1": "step1", "sft": "step1", "2": "step2", "rm": "step2", "reward": "step2",
    "3": "step3", "ppo": "step3", "rlhf": "step3",
}


def step_spec(name: str) -> StepSpec:
    """The :class:`StepSpec` for ``step1``/``step2``/``dpo``/``step3`` (or ``1``/``2``/``3``, ``sft``, ``ppo``...)."""
    key = STEP_ALIASES.get(str(name).lower(), str(name).lower())
    if key not in STEPS:
        raise UserError(f"unknown step {name!r}; use one of: {', '.join(STEPS)} (or 1, 2, 3)")
    return STEPS[key]
