#!/bin/bash
# Generated from configs/step1.yaml (recipe opt/multi_node/66b) by
# `python -m dschat.recipes write-scripts`: edit the recipe, not this file.
#
# OPT-66b on several nodes (hostfile), ZeRO-3, LoRA 128, lr 1e-4, weight decay 0.1, 2 epochs
# Re-creates upstream's training/step1_supervised_finetuning/training_scripts/opt/multi_node/run_66b.sh.
#
# Usage: bash run_66b.sh [OUTPUT] [ZERO_STAGE] [--main_py_flag VALUE ...]
#   Empty or missing positionals take the defaults: OUTPUT=./output ZERO_STAGE=3
#   Flags after the positionals are added to main.py's (one given there replaces the recipe's),
#   except --hostfile, --master_addr, --master_port, --num_nodes and --num_gpus: the launcher's.
#   Output goes to the terminal and to OUTPUT/training.log.
#
# Multi-node: the deepspeed launcher reads the hostfile (default /job/hostfile; pass
# --hostfile). Pass --master_addr when the first host's first `hostname -I` address is not the
# one the others reach, --master_port when the port is taken there.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../../.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m dschat.launch --repo-root "$ROOT" step1 opt/multi_node/66b --script-args "$@"
