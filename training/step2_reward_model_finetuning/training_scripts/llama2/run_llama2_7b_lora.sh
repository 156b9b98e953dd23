#!/bin/bash
# Generated from configs/step2.yaml (recipe llama2/7b_lora) by
# `python -m dschat.recipes write-scripts`: edit the recipe, not this file.
#
# Llama-2-7b reward model, ZeRO-3 with offload, LoRA 128 on "layers."
# Re-creates upstream's training/step2_reward_model_finetuning/training_scripts/llama2/run_llama2_7b_lora.sh.
#
# Usage: bash run_llama2_7b_lora.sh [OUTPUT] [ZERO_STAGE] [--main_py_flag VALUE ...]
#   Empty or missing positionals take the defaults: OUTPUT=./output_step2_llama_7b_epoch1_lr9.65e-6 ZERO_STAGE=3
#   Flags after the positionals are added to main.py's (one given there replaces the recipe's),
#   except --hostfile, --master_addr, --master_port, --num_nodes and --num_gpus: the launcher's.
#   Output goes to the terminal and to OUTPUT/training.log.
#
# Reward-model guidance: weight decay 0.1, 1 epoch; --num_padding_at_beginning 0 for LLaMA.
#
# meta-llama/Llama-2-7b-hf is a gated hub model; accept its licence and log in first.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m dschat.launch --repo-root "$ROOT" step2 llama2/7b_lora --script-args "$@"
