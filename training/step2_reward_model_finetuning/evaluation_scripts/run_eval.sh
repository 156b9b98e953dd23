#!/usr/bin/env bash
# Upstream's evaluation_scripts/run_eval.sh: score upstream's good / bad answer pairs with a trained
# reward model (a dschat or upstream DeepSpeed-Chat step-2 output folder). Upstream hard-coded the
# path; here it is the first argument. Any further arguments go to rw_eval.py as they are
# (e.g. --num_padding_at_beginning 0). Runs from any directory
# (paths are taken relative to the current one). PYTHON picks the interpreter (default: python).
set -euo pipefail
if [ "$#" -lt 1 ]; then
    echo "usage: bash $0 REWARD_MODEL [rw_eval.py flags...]" >&2
    exit 2
fi
model="$1"
shift
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"  # upstream: the first GPU
exec "${PYTHON:-python}" "$(dirname "$0")/../rw_eval.py" --model_name_or_path "$model" "$@"
