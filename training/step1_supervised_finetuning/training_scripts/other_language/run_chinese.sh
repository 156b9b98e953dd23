#!/bin/bash
# Generated from configs/step1.yaml (recipe other_language/chinese) by
# `python -m dschat.recipes write-scripts`: edit the recipe, not this file.
#
# BLOOM-1b1 on Chinese data, SFT only (data split 10,0,0)
# Re-creates upstream's training/step1_supervised_finetuning/training_scripts/other_language/run_chinese.sh.
#
# Usage: bash run_chinese.sh [OUTPUT] [ZERO_STAGE] [--main_py_flag VALUE ...]
#   Empty or missing positionals take the defaults: OUTPUT=./output ZERO_STAGE=2
#   Flags after the positionals are added to main.py's (one given there replaces the recipe's),
#   except --hostfile, --master_addr, --master_port, --num_nodes and --num_gpus: the launcher's.
#   Output goes to the terminal and to OUTPUT/training.log.
#
# The Chinese data mostly has one response and no rejected one, so only step 1 is run and all
# data goes to step 1 (data split 10,0,0).

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m dschat.launch --repo-root "$ROOT" step1 other_language/chinese --script-args "$@"
