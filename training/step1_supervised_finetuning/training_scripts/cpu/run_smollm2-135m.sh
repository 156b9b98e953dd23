#!/bin/bash
# Generated from configs/step1.yaml (recipe cpu/smollm2-135m) by
# `python -m dschat.recipes write-scripts`: edit the recipe, not this file.
#
# CPU demo: SmolLM2-135M-Instruct SFT on dschat/builtin, fp32, one rank
#
# Usage: bash run_smollm2-135m.sh [OUTPUT] [ZERO_STAGE] [--main_py_flag VALUE ...]
#   Empty or missing positionals take the defaults: OUTPUT=./output ZERO_STAGE=0
#   Flags after the positionals are added to main.py's (one given there replaces the recipe's),
#   except --hostfile, --master_addr, --master_port, --num_nodes and --num_gpus: the launcher's.
#   Output goes to the terminal and to OUTPUT/training.log.
#
# SFT guidance kept: weight decay 0, model dropout kept. One short epoch instead of 16: the demo
# has minutes, not hours (--max_train_steps caps it).
#
# One rank is faster than two on a 2-core machine (no gradient all-reduce, 2 threads for
# matmuls).

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m dschat.launch --repo-root "$ROOT" step1 cpu/smollm2-135m --script-args "$@"
