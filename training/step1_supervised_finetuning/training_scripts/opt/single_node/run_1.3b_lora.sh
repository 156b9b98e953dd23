#!/bin/bash
# Generated from configs/step1.yaml (recipe opt/single_node/1.3b_lora) by
# `python -m dschat.recipes write-scripts`: edit the recipe, not this file.
#
# OPT-1.3b on one node, LoRA 128 with --only_optimize_lora, lr 1e-3
# Re-creates upstream's training/step1_supervised_finetuning/training_scripts/opt/single_node/run_1.3b_lora.sh.
#
# Usage: bash run_1.3b_lora.sh [OUTPUT] [ZERO_STAGE] [--main_py_flag VALUE ...]
#   Empty or missing positionals take the defaults: OUTPUT=./output ZERO_STAGE=0
#   Flags after the positionals are added to main.py's (one given there replaces the recipe's),
#   except --hostfile, --master_addr, --master_port, --num_nodes and --num_gpus: the launcher's.
#   Output goes to the terminal and to OUTPUT/training.log.
#
# Note that usually LoRA needs to use larger learning rate (this recipe uses 1e-3).
#
# Upstream hard-coded the output folder (./output) and ZeRO stage 0; both are positionals here.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../../.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m dschat.launch --repo-root "$ROOT" step1 opt/single_node/1.3b_lora --script-args "$@"
