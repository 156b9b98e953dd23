"""Earlier path of :mod:`dschat.rlhf.actor_ema` (the EMA of the actor's weights): aliases only."""
from dschat.rlhf.actor_ema import EMA_BETA, moving_average

__all__ = ["EMA_BETA", "moving_average"]
