"""Upstream DeepSpeed-Chat's flags, per step script: the names its ``main.py`` files define.

dschat keeps every one of them under the same name (a test checks each against the step's parser);
every other flag of a step is dschat's. ``UPSTREAM_DEFAULTS`` holds upstream's default where dschat's
differs, and why (docs/upstream.md lists every such difference).
"""
from __future__ import annotations

# deepspeed.add_config_arguments, called by every upstream main.py, and the launcher's --local_rank.
_DEEPSPEED = ("deepspeed", "deepspeed_config", "deepscale", "deepscale_config", "local_rank")

_STEP1_2_COMMON = (
    "data_path", "data_split", "data_output_path", "model_name_or_path", "per_device_train_batch_size",
    "per_device_eval_batch_size", "max_seq_len", "learning_rate", "weight_decay", "num_train_epochs",
    "gradient_accumulation_steps", "lr_scheduler_type", "num_warmup_steps", "output_dir", "seed",
    "gradient_checkpointing", "dropout", "offload", "dtype", "zero_stage", "lora_dim", "lora_module_name",
    "only_optimize_lora", "lora_learning_rate", "compute_fp32_loss", "enable_tensorboard", "tensorboard_path",
    "add_eot_token",
)

UPSTREAM_FLAGS: dict[str, frozenset[str]] = {
    "step1": frozenset(_DEEPSPEED + _STEP1_2_COMMON + ("sft_only_data_path", "eot_token", "print_loss")),
    "step2": frozenset(_DEEPSPEED + _STEP1_2_COMMON + ("num_padding_at_beginning", "eval_interval", "eval_iters")),
    "dpo": frozenset(_DEEPSPEED + _STEP1_2_COMMON + ("beta", "label_smoothing", "offload_reference_model",
                                                     "print_loss")),
    "step3": frozenset(_DEEPSPEED + (
        "data_path", "data_split", "data_output_path", "unsupervised_dataset_name",
        "unsupervised_dataset_config_name", "unsup_coef", "actor_model_name_or_path", "critic_model_name_or_path",
        "num_padding_at_beginning", "per_device_generation_batch_size", "per_device_training_batch_size",
        "generation_batches", "ppo_epochs", "max_prompt_seq_len", "max_answer_seq_len", "actor_learning_rate",
        "critic_learning_rate", "actor_weight_decay", "critic_weight_decay", "num_train_epochs", "lr_scheduler_type",
        "gradient_accumulation_steps", "num_warmup_steps", "output_dir", "seed", "preprocessing_num_workers",
        "enable_hybrid_engine", "unpin_actor_parameters", "release_inference_cache", "inference_tp_size",
        "tp_gather_partition_size", "offload", "dtype", "offload_reference_model", "offload_reward_model",
        "actor_zero_stage", "critic_zero_stage", "actor_gradient_checkpointing", "critic_gradient_checkpointing",
        "actor_dropout", "critic_dropout", "actor_lora_dim", "actor_lora_module_name", "critic_lora_dim",
        "critic_lora_module_name", "only_optimize_lora", "actor_lora_learning_rate", "critic_lora_learning_rate",
        "enable_ema", "enable_mixed_precision_lora", "compute_fp32_loss", "enable_tensorboard", "tensorboard_path",
        "add_eot_token", "align_overflow", "print_answers", "print_answers_interval", "enable_test_mode",
        "test_stop_step",
    )),
}

_DATA_OUTPUT = "`/tmp/data_files/`, a folder every user of the machine shared"

#: (step, flag) -> upstream's default, where dschat's differs, in words.
UPSTREAM_DEFAULTS: dict[tuple[str, str], str] = {
    ("step1", "data_output_path"): _DATA_OUTPUT,
    ("step2", "data_output_path"): _DATA_OUTPUT,
    ("dpo", "data_output_path"): _DATA_OUTPUT,
    ("step3", "data_output_path"): "`/tmp/data_files`, a folder every user of the machine shared",
    ("step3", "seed"): "`None`, not reproducible",
    ("step3", "critic_model_name_or_path"): "required (a critic-free `--algorithm` needs none)",
}
