"""dschat: DeepSpeed-Chat's three-step RLHF pipeline (SFT, reward model, PPO), re-implemented and tested."""
from dschat.version import __version__

__all__ = ["__version__"]
