"""Every ``from dschat... import ...`` line of upstream DeepSpeed-Chat's scripts and library modules
still imports, and each alias name is the object dschat itself uses (not a second copy)."""
from __future__ import annotations

import importlib

import pytest

# Upstream's import lines, gathered from its step scripts (step 1, 2, DPO and 3 main.py, prompt_eval.py,
# rw_eval.py), inference/chatbot.py and its library modules (rlhf_engine, ppo_trainer, model_utils,
# data_utils). Module path -> the names those lines import from it.
UPSTREAM_IMPORTS: dict[str, tuple[str, ...]] = {
    "dschat.utils.utils": (
        "print_rank_0", "to_device", "save_hf_format", "set_random_seed", "get_all_reduce_mean",
        "get_optimizer_grouped_parameters", "save_zero_three_model", "load_hf_tokenizer", "moving_average",
        "ExponentialMovingAverage", "MovingAverage", "load_state_dict_into_model", "get_tokenizer", "is_rank_0",
    ),
    "dschat.utils.ds_utils": ("get_train_ds_config", "get_eval_ds_config"),
    "dschat.utils.perf": ("print_throughput", "print_throughput_step3", "calculate_flops", "get_hf_configs"),
    "dschat.utils.data.data_utils": (
        "create_prompt_dataset", "DataCollatorReward", "DataCollatorRLHF", "MiniDataset", "get_unsupervised_data",
        "PromptDataset", "create_dataset", "create_dataset_split", "get_raw_dataset", "get_shuffle_idx",
        "get_raw_dataset_split_index", "raw_datasets",
    ),
    "dschat.utils.data.raw_datasets": ("PromptRawDataset", "DahoasRmstaticDataset", "LocalJsonFileDataset"),
    "dschat.utils.model.model_utils": (
        "create_hf_model", "create_critic_model", "causal_lm_model_to_fp32_loss", "configure_dropout",
    ),
    "dschat.utils.model.reward_model": ("RewardModel",),
    "dschat.utils.module.lora": (
        "LinearLayer_LoRA", "convert_linear_layer_to_lora", "convert_lora_to_linear_layer",
        "only_optimize_lora_parameters", "make_model_gradient_checkpointing_compatible",
    ),
    "dschat.rlhf.rlhf_engine": ("DeepSpeedRLHFEngine",),
    "dschat.rlhf.ppo_trainer": ("DeepSpeedPPOTrainer", "DeepSpeedPPOTrainerUnsupervised"),
}

# Where each alias module's names really live (dschat's own modules import these paths).
HOMES = {
    "dschat.utils.ds_utils": "dschat.runtime.ds_config",
    "dschat.utils.perf": "dschat.runtime.perf",
    "dschat.utils.model.model_utils": "dschat.models.build",
    "dschat.utils.model.reward_model": "dschat.models.reward_model",
    "dschat.utils.module.lora": "dschat.models.lora",
    "dschat.utils.dist": "dschat.runtime.dist",
    "dschat.utils.fs": "dschat.runtime.fs",
    "dschat.utils.optim": "dschat.runtime.optim",
    "dschat.testing.tiny": "dschat.models.tiny",
}


@pytest.mark.parametrize("module", sorted(UPSTREAM_IMPORTS))
def test_upstream_import_line_works(module):
    mod = importlib.import_module(module)
    missing = [name for name in UPSTREAM_IMPORTS[module] if not hasattr(mod, name)]
    assert not missing, f"{module} lacks {missing}"
    # ``from module import *`` works too and offers every name above
    exported = getattr(mod, "__all__", None)
    if exported is not None:
        assert set(UPSTREAM_IMPORTS[module]) <= set(exported), f"{module}.__all__ lacks some"


@pytest.mark.parametrize("alias,home", sorted(HOMES.items()))
def test_alias_module_re_exports_its_home(alias, home):
    alias_mod, home_mod = importlib.import_module(alias), importlib.import_module(home)
    assert set(home_mod.__all__) <= set(alias_mod.__all__)
    for name in home_mod.__all__:
        assert getattr(alias_mod, name) is getattr(home_mod, name), f"{alias}.{name} is not {home}.{name}"
