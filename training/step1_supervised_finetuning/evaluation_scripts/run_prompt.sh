#!/usr/bin/env bash
# Upstream's evaluation_scripts/run_prompt.sh: compare a baseline and a fine-tuned model on the same
# prompts (greedy answers of both, one after the other). Upstream hard-coded "XXX" for both paths;
# here they are the two arguments. Any further arguments go to prompt_eval.py as they are
# (e.g. --max_new_tokens 64 --language Chinese). Runs from any directory
# (paths are taken relative to the current one). PYTHON picks the interpreter (default: python).
set -euo pipefail
if [ "$#" -lt 2 ]; then
    echo "usage: bash $0 BASELINE_MODEL FINETUNED_MODEL [prompt_eval.py flags...]" >&2
    exit 2
fi
baseline="$1"
finetune="$2"
shift 2
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"  # upstream: the first GPU
exec "${PYTHON:-python}" "$(dirname "$0")/../prompt_eval.py" \
    --model_name_or_path_baseline "$baseline" \
    --model_name_or_path_finetune "$finetune" \
    "$@"
