"""``python -m dschat.serve MODEL``: a model behind HTTP on one machine.

A step-2 reward model is served on OpenRLHF's remote reward protocol (``POST /get_reward``, what
step 3's ``--reward_url`` sends; :mod:`dschat.serve.app`), scored by :mod:`dschat.serve.reward_scorer`.
An actor is served OpenAI-compatibly (``/v1/completions``, ``/v1/chat/completions``:
:mod:`dschat.serve.openai_api`), its requests batched and decoded by :mod:`dschat.serve.actor`.
See docs/serving.md.
"""
