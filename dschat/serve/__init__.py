"""``python -m dschat.serve MODEL``: a model behind HTTP on one machine.

A step-2 reward model is served on OpenRLHF's remote reward protocol (``POST /get_reward``, what
step 3's ``--reward_url`` sends; :mod:`dschat.serve.app`), scored by :mod:`dschat.serve.reward_scorer`.
Serving an actor (OpenAI-compatible ``/v1/completions``) is not built: such a folder is refused with
one line. See docs/serving.md.
"""
