#!/bin/bash
# Generated from configs/step3.yaml (recipe opt/single_gpu/1.3b) by
# `python -m dschat.recipes write-scripts`: edit the recipe, not this file.
#
# OPT-1.3b actor + OPT-350m critic on one GPU, actor LoRA 128, Hybrid Engine
# Re-creates upstream's training/step3_rlhf_finetuning/training_scripts/opt/single_gpu/run_1.3b.sh.
#
# Usage: bash run_1.3b.sh [ACTOR_MODEL_PATH] [CRITIC_MODEL_PATH] [ACTOR_ZERO_STAGE] [CRITIC_ZERO_STAGE] [OUTPUT] [--main_py_flag VALUE ...]
#   Empty or missing positionals take the defaults: ACTOR_MODEL_PATH=(required) CRITIC_MODEL_PATH=(required) ACTOR_ZERO_STAGE=0 CRITIC_ZERO_STAGE=0 OUTPUT=./output
#   Flags after the positionals are added to main.py's (one given there replaces the recipe's),
#   except --hostfile, --master_addr, --master_port, --num_nodes and --num_gpus: the launcher's.
#   Output goes to the terminal and to OUTPUT/training.log.
#
# Step-3 guidance: actor dropout 0, 1 epoch; everything else main.py's defaults here.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../../.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m dschat.launch --repo-root "$ROOT" step3 opt/single_gpu/1.3b --script-args "$@"
