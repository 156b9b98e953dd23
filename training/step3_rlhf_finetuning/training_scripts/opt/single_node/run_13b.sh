#!/bin/bash
# Generated from configs/step3.yaml (recipe opt/single_node/13b) by
# `python -m dschat.recipes write-scripts`: edit the recipe, not this file.
#
# OPT-13b actor on one node, ZeRO-3/3, actor LoRA 128 (lr 5e-4), HE with inference TP 2
# Re-creates upstream's training/step3_rlhf_finetuning/training_scripts/opt/single_node/run_13b.sh.
#
# Usage: bash run_13b.sh [ACTOR_MODEL_PATH] [CRITIC_MODEL_PATH] [ACTOR_ZERO_STAGE] [CRITIC_ZERO_STAGE] [OUTPUT] [--main_py_flag VALUE ...]
#   Empty or missing positionals take the defaults: ACTOR_MODEL_PATH=(required) CRITIC_MODEL_PATH=(required) ACTOR_ZERO_STAGE=3 CRITIC_ZERO_STAGE=3 OUTPUT=./output
#   Flags after the positionals are added to main.py's (one given there replaces the recipe's),
#   except --hostfile, --master_addr, --master_port, --num_nodes and --num_gpus: the launcher's.
#   Output goes to the terminal and to OUTPUT/training.log.
#
# --inference_tp_size > 1 is broken upstream (DSE #628, shape mismatch); dschat's Hybrid Engine
# implements it (docs/inference_tensor_parallel.md).

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../../.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m dschat.launch --repo-root "$ROOT" step3 opt/single_node/13b --script-args "$@"
