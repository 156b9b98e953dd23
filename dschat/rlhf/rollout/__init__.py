"""Step 3's rollout: one module per decoding path, and the generator that asks them in order.

``generator`` (:class:`~dschat.rlhf.rollout.generator.RolloutGenerator`), ``path`` (the contract of a
path), ``sampling`` (decoding settings, the rollout, the shared sampling), and one module per path:
``tensor_parallel``, ``dschat_engine``, ``deepspeed_engine``, ``graphs``, ``sample_loop``,
``hf_generate``. Nothing here imports the rest of ``dschat.rlhf``.
"""
