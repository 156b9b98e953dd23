"""Pure RL math for DeepSpeed-Chat's three steps: torch only, no DeepSpeed, no transformers.

Everything here is a small function of tensors (no state, no ``args``), so each formula can be
read next to upstream's and pinned by a test (``tests/rlhf/test_rl_math.py``). Hyperparameters are
keyword arguments whose defaults are upstream's hard-coded values (``ppo_trainer.py``:
``kl_ctl=0.1, clip_reward_value=5, cliprange=0.2, cliprange_value=0.2, gamma=1.0, lam=0.95``;
DPO ``beta=0.1, label_smoothing=0.0``). The topics are modules of this package; each name is
imported from the module that defines it (this package re-exports nothing):

* :mod:`~dschat.rl_math.logprobs`: token log-probs, a sequence's log-prob, the causal-LM loss;
* :mod:`~dschat.rl_math.stats`: masked sums, means, variances, whitening, explained variance;
* :mod:`~dschat.rl_math.ppo`: KL penalty, per-token rewards, GAE, the clipped losses (step 3);
* :mod:`~dschat.rl_math.critic_free`: the critic-free algorithms (GRPO, Dr.GRPO, RLOO, REINFORCE++,
  ReMax): group advantages, returns-to-go, loss aggregation, truncated importance sampling;
* :mod:`~dschat.rl_math.preference`: the reward model's pairwise loss (step 2) and DPO.

Index conventions for step 3 (upstream's, kept as they are):

* ``seq`` is ``(B, L)``: a prompt left-padded to exactly ``P`` tokens, then ``A`` answer tokens,
  right-padded. Log-probs, values and rewards are ``(B, T)`` with ``T = L - 1``: position ``i``
  scores token ``i + 1`` (``gather_log_probs(logits[:, :-1], seq[:, 1:])``).
* ``start = P - 1`` is the first position that scores an answer token, and
  ``action_mask = attention_mask[:, 1:]`` (``(B, T)``).
* ``n = answer_span(action_mask, start)`` is the answer's span: its token count when the mask is
  contiguous from ``start`` (upstream's ``action_mask[:, start:].sum(1)``), and one past the last
  actor token of a multi-turn episode whose observation tokens are holes in the mask (``skip``
  passes over them in GAE).

Defaults reproduce upstream exactly; anything beyond upstream (``reward_at="last"``, the k2/k3
estimators, ``normalizer``) is opt-in.
"""
