#!/bin/bash
# Generated from configs/step3.yaml (recipe llama2/7b_lora) by
# `python -m dschat.recipes write-scripts`: edit the recipe, not this file.
#
# Llama-2-7b actor + critic, ZeRO-3/3, actor and critic LoRA 64 on "layers.", HE
# Re-creates upstream's training/step3_rlhf_finetuning/training_scripts/llama2/run_llama2_7b_lora.sh.
#
# Usage: bash run_llama2_7b_lora.sh [ACTOR_MODEL_PATH] [CRITIC_MODEL_PATH] [ACTOR_ZERO_STAGE] [CRITIC_ZERO_STAGE] [OUTPUT] [--main_py_flag VALUE ...]
#   Empty or missing positionals take the defaults: ACTOR_MODEL_PATH=(required) CRITIC_MODEL_PATH=(required) ACTOR_ZERO_STAGE=3 CRITIC_ZERO_STAGE=3 OUTPUT=./output_step3_llama2
#   Flags after the positionals are added to main.py's (one given there replaces the recipe's),
#   except --hostfile, --master_addr, --master_port, --num_nodes and --num_gpus: the launcher's.
#   Output goes to the terminal and to OUTPUT/training.log.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m dschat.launch --repo-root "$ROOT" step3 llama2/7b_lora --script-args "$@"
