#!/bin/bash
# Generated from configs/step1.yaml (recipe opt/single_node/30b_lora) by
# `python -m dschat.recipes write-scripts`: edit the recipe, not this file.
#
# OPT-30b on one node, ZeRO-3, LoRA 128 (default module filter), gradient checkpointing
# Re-creates upstream's training/step1_supervised_finetuning/training_scripts/opt/single_node/run_30b_lora.sh.
#
# Usage: bash run_30b_lora.sh [OUTPUT] [ZERO_STAGE] [--main_py_flag VALUE ...]
#   Empty or missing positionals take the defaults: OUTPUT=./output ZERO_STAGE=3
#   Flags after the positionals are added to main.py's (one given there replaces the recipe's),
#   except --hostfile, --master_addr, --master_port, --num_nodes and --num_gpus: the launcher's.
#   Output goes to the terminal and to OUTPUT/training.log.
#
# Upstream hard-coded the output folder (./output) and ZeRO stage 3; both are positionals here.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../../.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m dschat.launch --repo-root "$ROOT" step1 opt/single_node/30b_lora --script-args "$@"
