#!/bin/bash
# Generated from configs/step1.yaml (recipe cpu/tiny) by
# `python -m dschat.recipes write-scripts`: edit the recipe, not this file.
#
# Smoke test: tiny random LLaMA, 2 optimizer steps (tests and install checks)
#
# Usage: bash run_tiny.sh [OUTPUT] [ZERO_STAGE] [--main_py_flag VALUE ...]
#   Empty or missing positionals take the defaults: OUTPUT=./output ZERO_STAGE=0
#   Flags after the positionals are added to main.py's (one given there replaces the recipe's),
#   except --hostfile, --master_addr, --master_port, --num_nodes and --num_gpus: the launcher's.
#   Output goes to the terminal and to OUTPUT/training.log.
#
# Proves the pipeline runs end to end in about a minute; the model learns nothing useful.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m dschat.launch --repo-root "$ROOT" step1 cpu/tiny --script-args "$@"
