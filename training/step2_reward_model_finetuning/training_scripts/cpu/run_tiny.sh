#!/bin/bash
# Generated from configs/step2.yaml (recipe cpu/tiny) by
# `python -m dschat.recipes write-scripts`: edit the recipe, not this file.
#
# Smoke test: tiny random LLaMA reward model, 2 optimizer steps
#
# Usage: bash run_tiny.sh [OUTPUT] [ZERO_STAGE] [--main_py_flag VALUE ...]
#   Empty or missing positionals take the defaults: OUTPUT=./output ZERO_STAGE=0
#   Flags after the positionals are added to main.py's (one given there replaces the recipe's),
#   except --hostfile, --master_addr, --master_port, --num_nodes and --num_gpus: the launcher's.
#   Output goes to the terminal and to OUTPUT/training.log.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m dschat.launch --repo-root "$ROOT" step2 cpu/tiny --script-args "$@"
