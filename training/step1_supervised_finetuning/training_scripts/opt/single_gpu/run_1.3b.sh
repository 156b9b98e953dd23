#!/bin/bash
# Generated from configs/step1.yaml (recipe opt/single_gpu/1.3b) by
# `python -m dschat.recipes write-scripts`: edit the recipe, not this file.
#
# OPT-1.3b on one GPU with LoRA 128 (everything else main.py's defaults)
# Re-creates upstream's training/step1_supervised_finetuning/training_scripts/opt/single_gpu/run_1.3b.sh.
#
# Usage: bash run_1.3b.sh [OUTPUT] [ZERO_STAGE] [--main_py_flag VALUE ...]
#   Empty or missing positionals take the defaults: OUTPUT=./output ZERO_STAGE=0
#   Flags after the positionals are added to main.py's (one given there replaces the recipe's),
#   except --hostfile, --master_addr, --master_port, --num_nodes and --num_gpus: the launcher's.
#   Output goes to the terminal and to OUTPUT/training.log.
#
# Note that usually LoRA needs to use larger learning rate (main.py's default is 1e-3).

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../../.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m dschat.launch --repo-root "$ROOT" step1 opt/single_gpu/1.3b --script-args "$@"
