#!/bin/bash
# Generated from configs/step3.yaml (recipe opt/single_node/sweep) by
# `python -m dschat.recipes write-scripts`: edit the recipe, not this file.
#
# one case of upstream's step-3 test matrix (tests/test_training.py); run it through
# sweep/run_single.sh
# Re-creates upstream's training/step3_rlhf_finetuning/training_scripts/opt/single_node/sweep/run_single.sh.
#
# Usage: bash run_recipe.sh [ACTOR_MODEL_PATH] [CRITIC_MODEL_PATH] [ACTOR_ZERO_STAGE] [CRITIC_ZERO_STAGE] [OUTPUT] [--main_py_flag VALUE ...]
#   Empty or missing positionals take the defaults: ACTOR_MODEL_PATH=(required) CRITIC_MODEL_PATH=(required) ACTOR_ZERO_STAGE=2 CRITIC_ZERO_STAGE=2 OUTPUT=./output
#   Flags after the positionals are added to main.py's (one given there replaces the recipe's),
#   except --hostfile, --master_addr, --master_port, --num_nodes and --num_gpus: the launcher's.
#   Output goes to the terminal and to OUTPUT/training.log.
#
# sweep/run_single.sh takes upstream's 11 positionals (actor critic actor_zero critic_zero
# hybrid_engine offload lora mixed_precision_lora output test test_stop_step; the switches are
# true/false), turns the switches into flags and runs this recipe with them.
#
# Saves in both formats (--save_format both): upstream's test asserts actor/pytorch_model.bin
# and critic/pytorch_model.bin, and dschat's own readers take either.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../../../.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m dschat.launch --repo-root "$ROOT" step3 opt/single_node/sweep --script-args "$@"
