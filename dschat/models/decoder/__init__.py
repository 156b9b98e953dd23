"""dschat's decode model: the actor's weights in an inference layout and a forward written for decoding.

* :mod:`.layouts` -- the per-family table (module paths, forward switches) and :func:`unsupported_reason`;
* :mod:`.weights` -- :class:`InferenceWeights`, fused contiguous buffers refreshed in place;
* :mod:`.rope` -- RoPE tables from transformers' own frequency functions;
* :mod:`.kv_cache` -- :class:`StaticKVCache`;
* :mod:`.forward` -- :class:`DecodeModel`: prefill and the one-token decode step.

The rollout engine that drives it (sampling, weight refresh, compilation) is
:mod:`dschat.rlhf.rollout.dschat_engine`.
"""
