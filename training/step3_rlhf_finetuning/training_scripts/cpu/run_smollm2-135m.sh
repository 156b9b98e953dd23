#!/bin/bash
# Generated from configs/step3.yaml (recipe cpu/smollm2-135m) by
# `python -m dschat.recipes write-scripts`: edit the recipe, not this file.
#
# CPU demo: PPO of the SmolLM2-135M SFT actor against the step-2 reward model, fp32, one rank
#
# Usage: bash run_smollm2-135m.sh [ACTOR_MODEL_PATH] [CRITIC_MODEL_PATH] [ACTOR_ZERO_STAGE] [CRITIC_ZERO_STAGE] [OUTPUT] [--main_py_flag VALUE ...]
#   Empty or missing positionals take the defaults: ACTOR_MODEL_PATH=(required) CRITIC_MODEL_PATH=(required) ACTOR_ZERO_STAGE=0 CRITIC_ZERO_STAGE=0 OUTPUT=./output
#   Flags after the positionals are added to main.py's (one given there replaces the recipe's),
#   except --hostfile, --master_addr, --master_port, --num_nodes and --num_gpus: the launcher's.
#   Output goes to the terminal and to OUTPUT/training.log.
#
# Step-3 guidance kept: weight decay 0, actor dropout 0, 1 epoch, EMA on, generation batch ==
# training batch, ppo_epochs 1, generation_batches 1 (on-policy).
#
# Learning rates are above upstream's 9.65e-6 / 5e-6: the demo has 20 PPO steps, not thousands.
#
# Tuning history and the measured gold-judge results of this recipe over five seeds:
# docs/getting-started.md, section 'Measured on this project's 2-core CPU (fp32)'.
#
# The run stops after --test_stop_step PPO steps (main.py's test mode) because one epoch over
# the builtin prompts would take hours on a CPU.
#
# Held-out evaluation (docs/evaluation.md, 'Did step 3 work?') at steps 0, 10 and 20 on 8
# prompts, judged by the gold judge, which only judges dschat/builtin: with another --data_path
# also pass another --eval_judge (a module:function reward or a reward-model folder).

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m dschat.launch --repo-root "$ROOT" step3 cpu/smollm2-135m --script-args "$@"
