#!/bin/bash
# Generated from configs/step3.yaml (recipe cpu/smollm2-135m) by
# `python -m dschat.recipes write-scripts`: edit the recipe, not this file.
#
# CPU demo: PPO of the SmolLM2-135M SFT actor against the step-2 reward model, fp32, one rank
#
# Usage: bash run_smollm2-135m.sh [ACTOR_MODEL_PATH] [CRITIC_MODEL_PATH] [ACTOR_ZERO_STAGE] [CRITIC_ZERO_STAGE] [OUTPUT] [--main_py_flag VALUE ...]
#   Empty or missing positionals take the defaults: ACTOR_MODEL_PATH=(required) CRITIC_MODEL_PATH=(required) ACTOR_ZERO_STAGE=0 CRITIC_ZERO_STAGE=0 OUTPUT=./output
#   Flags after the positionals are added to main.py's (one given there replaces the recipe's).
#   Output goes to the terminal and to OUTPUT/training.log.
#
# Step-3 guidance kept: weight decay 0, actor dropout 0, 1 epoch, EMA on, generation batch ==
# training batch, ppo_epochs 1, generation_batches 1 (on-policy).
#
# Learning rates are above upstream's 9.65e-6 / 5e-6: the demo has 20 PPO steps, not thousands.
#
# Tried on the CPU demo (gold-judge change of the RLHF actor vs the SFT actor, 96 held-out
# prompts), all without --missing_eos_penalty: this recipe -0.02 and -0.06 (two runs); a reward
# model trained on batch 8 (82% held-out accuracy, but step 2 takes 5.7 min) with kl_ctl 0.2
# -0.27; actor lr 1e-5 with critic lr 1e-4 -0.31. In three of the four the actor stopped
# emitting EOS: the reward model scores an answer cut at 48 tokens higher than a finished one
# (it never saw unfinished answers), so --missing_eos_penalty 1 (TRL's remedy) is on here.
#
# The run stops after --test_stop_step PPO steps (main.py's test mode) because one epoch over
# the builtin prompts would take hours on a CPU.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m dschat.launch --repo-root "$ROOT" step3 cpu/smollm2-135m --script-args "$@"
