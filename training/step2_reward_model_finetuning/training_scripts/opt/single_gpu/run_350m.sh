#!/bin/bash
# Generated from configs/step2.yaml (recipe opt/single_gpu/350m) by
# `python -m dschat.recipes write-scripts`: edit the recipe, not this file.
#
# OPT-350m reward model on one GPU (everything else main.py's defaults)
# Re-creates upstream's training/step2_reward_model_finetuning/training_scripts/opt/single_gpu/run_350m.sh.
#
# Usage: bash run_350m.sh [OUTPUT] [ZERO_STAGE] [--main_py_flag VALUE ...]
#   Empty or missing positionals take the defaults: OUTPUT=./output ZERO_STAGE=0
#   Flags after the positionals are added to main.py's (one given there replaces the recipe's),
#   except --hostfile, --master_addr, --master_port, --num_nodes and --num_gpus: the launcher's.
#   Output goes to the terminal and to OUTPUT/training.log.
#
# Reward-model guidance: weight decay 0.1, dropout 0, 1 epoch.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../../.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m dschat.launch --repo-root "$ROOT" step2 opt/single_gpu/350m --script-args "$@"
