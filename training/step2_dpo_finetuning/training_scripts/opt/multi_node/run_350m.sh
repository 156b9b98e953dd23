#!/bin/bash
# Generated from configs/dpo.yaml (recipe opt/multi_node/350m) by
# `python -m dschat.recipes write-scripts`: edit the recipe, not this file.
#
# OPT-350m DPO on several nodes (hostfile), batch 2 per device
# Re-creates upstream's training/step2_dpo_finetuning/training_scripts/opt/multi_node/run_350m.sh.
#
# Usage: bash run_350m.sh [OUTPUT] [ZERO_STAGE] [--main_py_flag VALUE ...]
#   Empty or missing positionals take the defaults: OUTPUT=./output ZERO_STAGE=0
#   Flags after the positionals are added to main.py's (one given there replaces the recipe's),
#   except --hostfile, --master_addr, --master_port, --num_nodes and --num_gpus: the launcher's.
#   Output goes to the terminal and to OUTPUT/training.log.
#
# Multi-node: the deepspeed launcher reads the hostfile (default /job/hostfile; pass
# --hostfile). Pass --master_addr when the first host's first `hostname -I` address is not the
# one the others reach, --master_port when the port is taken there.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../../.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m dschat.launch --repo-root "$ROOT" dpo opt/multi_node/350m --script-args "$@"
