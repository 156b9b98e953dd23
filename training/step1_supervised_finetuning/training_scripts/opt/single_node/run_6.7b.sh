#!/bin/bash
# Generated from configs/step1.yaml (recipe opt/single_node/6.7b) by
# `python -m dschat.recipes write-scripts`: edit the recipe, not this file.
#
# OPT-6.7b full fine-tuning on one node, ZeRO-3, gradient checkpointing
# Re-creates upstream's training/step1_supervised_finetuning/training_scripts/opt/single_node/run_6.7b.sh.
#
# Usage: bash run_6.7b.sh [OUTPUT] [ZERO_STAGE] [--main_py_flag VALUE ...]
#   Empty or missing positionals take the defaults: OUTPUT=./output ZERO_STAGE=3
#   Flags after the positionals are added to main.py's (one given there replaces the recipe's),
#   except --hostfile, --master_addr, --master_port, --num_nodes and --num_gpus: the launcher's.
#   Output goes to the terminal and to OUTPUT/training.log.
#
# SFT guidance: weight decay 0, keep the model's dropout, 16 epochs.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../../.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m dschat.launch --repo-root "$ROOT" step1 opt/single_node/6.7b --script-args "$@"
