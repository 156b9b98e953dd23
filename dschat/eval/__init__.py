"""Evaluation of a finished pipeline: :mod:`dschat.eval.report` compares the SFT and RLHF actors on
held-out prompts with the gold judge and the step-2 reward model, and plots the PPO curves."""
