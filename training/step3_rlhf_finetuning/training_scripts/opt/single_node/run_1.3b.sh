#!/bin/bash
# Generated from configs/step3.yaml (recipe opt/single_node/1.3b) by
# `python -m dschat.recipes write-scripts`: edit the recipe, not this file.
#
# OPT-1.3b actor + OPT-350m critic on one node, ZeRO-2/2, Hybrid Engine, EMA
# Re-creates upstream's training/step3_rlhf_finetuning/training_scripts/opt/single_node/run_1.3b.sh.
#
# Usage: bash run_1.3b.sh [ACTOR_MODEL_PATH] [CRITIC_MODEL_PATH] [ACTOR_ZERO_STAGE] [CRITIC_ZERO_STAGE] [OUTPUT] [--main_py_flag VALUE ...]
#   Empty or missing positionals take the defaults: ACTOR_MODEL_PATH=(required) CRITIC_MODEL_PATH=(required) ACTOR_ZERO_STAGE=2 CRITIC_ZERO_STAGE=2 OUTPUT=./output
#   Flags after the positionals are added to main.py's (one given there replaces the recipe's),
#   except --hostfile, --master_addr, --master_port, --num_nodes and --num_gpus: the launcher's.
#   Output goes to the terminal and to OUTPUT/training.log.
#
# Step-3 guidance: actor lr 9.65e-6, critic lr 5e-6, weight decay 0, actor dropout 0, 1 epoch,
# EMA on.
#
# Upstream defaulted $1 / $2 to its public checkpoints AdamG012/chat-opt-1.3b-sft-deepspeed and
# AdamG012/chat-opt-350m-reward-deepspeed on the hub. dschat reads upstream's folder format, but
# a critic must be a local folder (no hub download), so here both paths are required: pass your
# step-1 and step-2 output folders, or local copies of those two checkpoints (huggingface-cli
# download <id> --local-dir DIR).

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../../.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m dschat.launch --repo-root "$ROOT" step3 opt/single_node/1.3b --script-args "$@"
