#!/bin/bash
# Generated from configs/step3.yaml (recipe cpu/tiny) by
# `python -m dschat.recipes write-scripts`: edit the recipe, not this file.
#
# Smoke test: PPO of tiny random LLaMA actor and critic, 2 PPO steps
#
# Usage: bash run_tiny.sh [ACTOR_MODEL_PATH] [CRITIC_MODEL_PATH] [ACTOR_ZERO_STAGE] [CRITIC_ZERO_STAGE] [OUTPUT] [--main_py_flag VALUE ...]
#   Empty or missing positionals take the defaults: ACTOR_MODEL_PATH=(required) CRITIC_MODEL_PATH=(required) ACTOR_ZERO_STAGE=0 CRITIC_ZERO_STAGE=0 OUTPUT=./output
#   Flags after the positionals are added to main.py's (one given there replaces the recipe's),
#   except --hostfile, --master_addr, --master_port, --num_nodes and --num_gpus: the launcher's.
#   Output goes to the terminal and to OUTPUT/training.log.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m dschat.launch --repo-root "$ROOT" step3 cpu/tiny --script-args "$@"
