#!/bin/bash
# One case of upstream DeepSpeed-Chat's step-3 test matrix (its tests/test_training.py runs this script
# from training/step3_rlhf_finetuning with 11 positionals and then looks for actor/pytorch_model.bin and
# critic/pytorch_model.bin in OUTPUT).
#
# Usage: bash run_single.sh ACTOR CRITIC ACTOR_ZERO CRITIC_ZERO HYBRID_ENGINE OFFLOAD LORA \
#                           MIXED_PRECISION_LORA OUTPUT TEST TEST_STOP_STEP [--flag VALUE ...]
#   HYBRID_ENGINE, OFFLOAD, LORA, MIXED_PRECISION_LORA and TEST are true or false (anything but true is
#   false); empty zero stages are 2. They become --enable_hybrid_engine, --offload, --actor_lora_dim 128
#   --actor_lora_module_name decoder.layers. (else --actor_lora_dim 0), --enable_mixed_precision_lora and
#   --enable_test_mode --test_stop_step TEST_STOP_STEP. Flags after the 11 positionals go to main.py as
#   in every recipe script (the launcher's --hostfile, --master_port, ... to the launcher).
#
# The rest is recipe opt/single_node/sweep of configs/step3.yaml (run_recipe.sh beside this file), which
# saves in both formats (--save_format both). Unlike upstream's, this script does not write
# OUTPUT/OUTPUT.log: the log is OUTPUT/training.log, as for every recipe.
set -euo pipefail
if [ "$#" -lt 11 ]; then
    echo "usage: bash $0 ACTOR CRITIC ACTOR_ZERO CRITIC_ZERO HYBRID_ENGINE OFFLOAD LORA MIXED_PRECISION_LORA OUTPUT TEST TEST_STOP_STEP [--flag VALUE ...]" >&2
    exit 2
fi
switches=()
[ "$5" == true ] && switches+=(--enable_hybrid_engine)
[ "$6" == true ] && switches+=(--offload)
if [ "$7" == true ]; then
    switches+=(--actor_lora_dim 128 --actor_lora_module_name decoder.layers.)
else
    switches+=(--actor_lora_dim 0)
fi
[ "$8" == true ] && switches+=(--enable_mixed_precision_lora)
[ "${10}" == true ] && switches+=(--enable_test_mode --test_stop_step "${11}")
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_recipe.sh" "$1" "$2" "$3" "$4" "$9" "${switches[@]}" "${@:12}"
