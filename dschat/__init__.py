"""dschat: DeepSpeed-Chat's three-step RLHF pipeline (SFT, reward model, PPO), re-implemented and tested."""
import logging as _logging

from dschat.runtime.import_guards import keep_mlflow_out_of_deepspeeds_autotuner as _keep_mlflow_out
from dschat.version import __version__

# DeepSpeed's autotuner imports MLflow, where installed, at every start-up; dschat never uses it.
_keep_mlflow_out()

# bitsandbytes logs a CPU-kernel warning at import on CPUs without its optional kernels; dschat
# only uses it for opt-in QLoRA, so keep every step's output free of it.
_logging.getLogger("bitsandbytes").setLevel(_logging.ERROR)

__all__ = ["__version__"]
