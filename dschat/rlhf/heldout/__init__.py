"""Step 3's held-out evaluation during training (``--eval_interval``): the flag rules, judges and
prompts checked before any model loads (:mod:`~dschat.rlhf.heldout.setup`), the evaluation itself
and the best checkpoint (:mod:`~dschat.rlhf.heldout.evaluation`), the over-optimization alarm
(:mod:`~dschat.rlhf.heldout.alarm`) and what an evaluation costs (:mod:`~dschat.rlhf.heldout.cost`).
The end-of-run report is :mod:`dschat.eval.report`."""
