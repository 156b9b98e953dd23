#!/usr/bin/env python
"""Score two fixed (prompt, good answer, bad answer) pairs with a trained step-2 reward model.

Upstream's ``rw_eval.py`` built ``create_critic_model(..., rlhf_training=False)``: the body from
``AutoModel.from_pretrained`` (whose ``rwtransformer.*`` keys did not match) and a freshly random
value head, so its scores were random and changed from run to run (DSE #808, #737). This one loads
the trained body and value head strictly (``rlhf_training=True``), so the scores are the model's
and are the same on every run. Runs on the first GPU when there is one, else on the CPU.

    python rw_eval.py --model_name_or_path ./output/step2
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from dschat.errors import UserError, cli_main
from dschat.models.tokenizer import EOT_SPECIAL_TOKEN, end_of_conversation_text

# Upstream's pairs. Its prompts end with "Assistant: " (a trailing space), unlike the training
# data's "Assistant:" + " answer"; kept as upstream.
PROMPTS = [
    "Human: Please tell me about Microsoft in a few sentence? Assistant: ",
    "Human: Explain the moon landing to a 6 year old in a few sentences. Assistant: ",
]
GOOD_ANSWERS = [
    "Microsoft is a software company that develops, licenses, and supports software products, including Windows, "
    "Office, and Windows Phone. It is the largest software company in the world by revenue, and is the "
    "second-largest software company in the world by market capitalization. Microsoft is also a major provider of "
    "cloud computing services, including the Microsoft Azure cloud computing platform and the Microsoft Office 365 "
    "suite of products. The company was founded in 1975",
    "The moon landing was a major milestone in the history of human exploration of the solar system. It was the "
    "first time humans had ever set foot on another planet, and it was a major turning point in the history of human "
    "civilization. The astronauts, Neil Armstrong, Buzz Aldrin, and Michael Collins, successfully landed the Apollo "
    "11 spacecraft on the moon, marking the first time humans had ever set foot on another",
]
BAD_ANSWERS = [
    "I'm not sure. Human: What's your job? Assistant: I'm not sure. Human: What's your favorite color? Assistant: "
    "I'm not sure. Human: What's your favorite food? Assistant: I'm not sure. Human: What's your favorite drink? "
    "Assistant: I'm not sure.",
    "I don't know, I don't know.",
]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Eval the finetued reward model")
    parser.add_argument("--model_name_or_path", type=str, required=True,
                        help="A step-2 output folder (training/step2_reward_model_finetuning/main.py --output_dir).")
    parser.add_argument("--num_padding_at_beginning", type=int, default=1,
                        help="OPT model has a fixed number (1) of padding tokens at the beginning of the input. "
                             "We did not see this in other models but keep it as an option for now. (dschat "
                             "reads the sequence end from the attention mask; this count is used only without one.)")
    parser.add_argument("--add_eot_token", action="store_true",
                        help="Add <|endoftext|> as additional special token to tokenizer")
    parser.add_argument("--end_of_conversation_token", type=str, default=None,
                        help="(dschat) Text appended to each answer; use the same as step 2 did. Default: the "
                             "tokenizer's EOS (step 2's default). Upstream used '<|endoftext|>'.")
    parser.add_argument("--max_seq_len", type=int, default=512,
                        help="(dschat flag, upstream constant) Length every pair is padded / truncated to.")
    parser.add_argument("--debug", action="store_true",
                        help="(dschat) Show full tracebacks for input errors instead of one line.")
    return parser.parse_args(argv)


def default_device() -> torch.device:
    """The first CUDA device when there is one, else the CPU."""
    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def load_stuff(model_name_or_path: str, num_padding_at_beginning: int,
               additional_special_tokens: str | None) -> tuple[Any, Any]:
    """The trained reward model (strictly loaded, dropout 0) and its tokenizer.

    Upstream also forced ``pad = eos`` here; dschat keeps the tokenizer's pad, as step 2 did.
    """
    from dschat.models.build import create_critic_model
    from dschat.models.tokenizer import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(model_name_or_path, fast_tokenizer=True,
                                  add_special_tokens=additional_special_tokens)
    model = create_critic_model(model_name_or_path, tokenizer, None, num_padding_at_beginning,
                                rlhf_training=True, dropout=0.0)
    return model, tokenizer


def prepare_datapair(prompt: str, good_ans: str, bad_ans: str, tokenizer: Any, max_seq_len: int = 512,
                     end_of_conversation_token: str = EOT_SPECIAL_TOKEN) -> dict[str, torch.Tensor]:
    """A step-2 style batch ``[chosen; rejected]``, each padded to ``max_seq_len``. Shape (2, L)."""
    chosen = tokenizer(prompt + good_ans + end_of_conversation_token, max_length=max_seq_len,
                       padding="max_length", truncation=True, return_tensors="pt")
    rejected = tokenizer(prompt + bad_ans + end_of_conversation_token, max_length=max_seq_len,
                         padding="max_length", truncation=True, return_tensors="pt")
    return {
        "input_ids": torch.cat([chosen["input_ids"], rejected["input_ids"]], dim=0),
        "attention_mask": torch.cat([chosen["attention_mask"], rejected["attention_mask"]], dim=0),
    }


def prepare_singlesample(prompt: str, good_ans: str, tokenizer: Any, max_seq_len: int = 512,
                         end_of_conversation_token: str = EOT_SPECIAL_TOKEN) -> dict[str, torch.Tensor]:
    """One sequence padded to ``max_seq_len``. Shape (1, L)."""
    token = tokenizer(prompt + good_ans + end_of_conversation_token, max_length=max_seq_len,
                      padding="max_length", truncation=True, return_tensors="pt")
    return {"input_ids": token["input_ids"], "attention_mask": token["attention_mask"]}


@dataclass(frozen=True)
class PairScore:
    prompt: str
    good_score: float
    bad_score: float


def run_pair_comparison(args: argparse.Namespace) -> list[PairScore]:
    """Upstream's evaluation: score each good / bad pair and print the result block."""
    from dschat.runtime.devices import to_device

    device = default_device()
    rm_model, tokenizer = load_stuff(args.model_name_or_path, args.num_padding_at_beginning,
                                     EOT_SPECIAL_TOKEN if args.add_eot_token else None)
    rm_model.to(device).eval()
    eot = end_of_conversation_text(tokenizer, args.end_of_conversation_token, args.model_name_or_path)
    scores = []
    for prompt, good_ans, bad_ans in zip(PROMPTS, GOOD_ANSWERS, BAD_ANSWERS):
        batch = to_device(prepare_datapair(prompt, good_ans, bad_ans, tokenizer, args.max_seq_len, eot), device)
        with torch.no_grad():
            outputs = rm_model(**batch)
        print("==================Eval result============================")
        print("prompt: ", prompt)
        print("\ngood_ans: ", good_ans)
        print("\nbad_ans:", bad_ans)
        print()
        print("=============Scores (higher, better)========================")
        good, bad = outputs["chosen_mean_scores"].item(), outputs["rejected_mean_scores"].item()
        print("good_ans score: ", good)
        print("bad_ans score: ", bad)
        scores.append(PairScore(prompt, good, bad))
    return scores


def run_single_sample(args: argparse.Namespace) -> float:
    """Upstream's unused single-answer variant (``forward_value`` end score), kept callable."""
    from dschat.runtime.devices import to_device

    device = default_device()
    rm_model, tokenizer = load_stuff(args.model_name_or_path, args.num_padding_at_beginning,
                                     EOT_SPECIAL_TOKEN if args.add_eot_token else None)
    rm_model.to(device).eval()
    eot = end_of_conversation_text(tokenizer, args.end_of_conversation_token, args.model_name_or_path)
    prompt = "Human: Explain the moon landing to a 6 year old in a few sentences."
    my_ans = "Assistant: " + GOOD_ANSWERS[1]
    batch = to_device(prepare_singlesample(prompt, my_ans, tokenizer, args.max_seq_len, eot), device)
    with torch.no_grad():
        outputs = rm_model.forward_value(**batch, prompt_length=max(2, args.num_padding_at_beginning))
    score = outputs["chosen_end_scores"].item()
    print("==================Eval result============================")
    print("prompt: ", prompt)
    print("my_ans: ", my_ans)
    print()
    print("=============Scores========================")
    print("my_ans score: ", score)
    return score


def check_max_seq_len(model_name_or_path: str, max_seq_len: int) -> None:
    """``--max_seq_len`` holds a pair (>= 2, as step 2's) and fits the model's positions, read from
    its config before any weight loads: a position table's length as the steps refuse it
    (``check_seq_len_fits_positions``), and, for families that compute their positions, the
    ``max_position_embeddings`` it was trained for (every pair is padded to ``--max_seq_len``: longer
    only costs memory). One :class:`UserError` line otherwise."""
    from dschat.models.registry import load_config, resolve_model_path
    from dschat.training.step_data import check_pair_seq_len, check_seq_len_fits_positions

    check_pair_seq_len(max_seq_len)
    check_seq_len_fits_positions(model_name_or_path, max_seq_len)
    limit = getattr(load_config(resolve_model_path(model_name_or_path)), "max_position_embeddings", None)
    if isinstance(limit, int) and max_seq_len > limit:
        raise UserError(f"--max_seq_len {max_seq_len} is longer than the {limit} positions {model_name_or_path} "
                        f"was trained for, and every pair is padded to it; pass --max_seq_len {limit} or less")


def main(argv: Sequence[str] | None = None) -> list[PairScore]:
    from dschat.eval.scoring import check_not_step3_root
    from dschat.training.run_setup import quiet_transformers

    args = parse_args(argv)
    check_not_step3_root(args.model_name_or_path, "--model_name_or_path")
    check_max_seq_len(args.model_name_or_path, args.max_seq_len)
    quiet_transformers()
    return run_pair_comparison(args)


if __name__ == "__main__":
    sys.exit(cli_main(main))
