#!/usr/bin/env python
"""Compare a baseline and a fine-tuned (step 1, or step 3 actor) model on fixed prompts, greedily.

As upstream's ``prompt_eval.py``: the tokenizer comes from the baseline, both models are loaded in
fp32 with ``create_hf_model``, every prompt is answered by greedy decoding, and the answers are
printed under upstream's headers. Runs on the first GPU when there is one, else on the CPU.

    python prompt_eval.py --model_name_or_path_baseline smollm2-135m \\
        --model_name_or_path_finetune ./output/step1 --max_new_tokens 64
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from dschat.errors import cli_main

# Upstream's prompts. They end with ":" (not ": "): base models often stall after a trailing space.
PROMPTS: dict[str, list[str]] = {
    "English": [
        "Human: Please tell me about Microsoft in a few sentence? Assistant:",
        "Human: Explain the moon landing to a 6 year old in a few sentences. Assistant:",
        "Human: Write a short poem about a wise frog. Assistant:",
        "Human: Who was president of the United States in 1955? Assistant:",
        "Human: How does a telescope work? Assistant:",
        "Human: Why do birds migrate south for the winter? Assistant:",
    ],
    "Chinese": [
        "Human: 请用几句话介绍一下微软? Assistant:",
        "Human: 用几句话向6岁的孩子解释登月。 Assistant:",
        "Human: 写一首关于一只聪明的青蛙的短诗。 Assistant:",
        "Human: 谁是1955年的美国总统? Assistant:",
        "Human: 望远镜是如何工作的? Assistant:",
        "Human: 鸟类为什么要南迁过冬? Assistant:",
    ],
    "Japanese": [
        "Human: マイクロソフトについて簡単に教えてください。 Assistant:",
        "Human: 6歳児に月面着陸を短い文で説明する。 Assistant:",
        "Human: 賢いカエルについて短い詩を書いてください。 Assistant:",
        "Human: 1955年のアメリカ合衆国大統領は誰? Assistant:",
        "Human: 望遠鏡はどのように機能しますか? Assistant:",
        "Human: 鳥が冬に南に移動するのはなぜですか? Assistant:",
    ],
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Eval the finetued SFT model")
    parser.add_argument("--model_name_or_path_baseline", type=str, required=True,
                        help="Path to baseline model (folder, hub id or dschat short name).")
    parser.add_argument("--model_name_or_path_finetune", type=str, required=True,
                        help="Path to the fine-tuned model (e.g. the step-1 --output_dir).")
    parser.add_argument("--num_beams", type=int, default=1,
                        help="Number of beams (for the beam-search variants; the comparison is greedy).")
    parser.add_argument("--num_beam_groups", type=int, default=1,
                        help="Number of beam groups (diverse beam search variant; unused by the greedy comparison).")
    parser.add_argument("--top_k", type=int, default=4,
                        help="top_k of the contrastive-search variant (unused by default).")
    parser.add_argument("--penalty_alpha", type=float, default=0.6,
                        help="penalty_alpha of the contrastive-search variant (unused by default).")
    parser.add_argument("--num_return_sequences", type=int, default=1, help="Specify num of return sequences")
    parser.add_argument("--max_new_tokens", type=int, default=100, help="Maximum number of new tokens per answer.")
    parser.add_argument("--language", type=str, default="English", choices=list(PROMPTS),
                        help="Which of upstream's prompt sets to use.")
    parser.add_argument("--add_eot_token", action="store_true",
                        help="Add <|endoftext|> as additional special token to tokenizer")
    parser.add_argument("--debug", action="store_true",
                        help="(dschat) Show full tracebacks for input errors instead of one line.")
    args = parser.parse_args(argv)
    from dschat.errors import UserError

    if args.max_new_tokens < 1 or args.num_return_sequences < 1:
        raise UserError("--max_new_tokens and --num_return_sequences must be >= 1")
    if args.num_return_sequences > 1:  # upstream's comparison is greedy too: one answer per prompt and model
        raise UserError(f"--num_return_sequences {args.num_return_sequences}: the comparison decodes greedily, "
                        "which gives one answer per prompt; pass --num_return_sequences 1")
    return args


def default_device() -> torch.device:
    """The first CUDA device when there is one, else the CPU."""
    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def generate(model: Any, tokenizer: Any, inputs: Any, num_beams: int = 1, do_sample: bool = False,
             num_return_sequences: int = 1, max_new_tokens: int = 100) -> list[str]:
    """Decode ``inputs`` (greedy by default) and return the full texts, prompt included."""
    with torch.no_grad():
        generate_ids = model.generate(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
            num_beams=num_beams, do_sample=do_sample, num_return_sequences=num_return_sequences,
            max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
        )
    return tokenizer.batch_decode(generate_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def print_utils(gen_output: Sequence[str]) -> None:
    for text in gen_output:
        print()
        print(text)
        print()


@dataclass(frozen=True)
class PromptResult:
    prompt: str
    baseline: list[str]
    finetune: list[str]


def prompt_eval(args: argparse.Namespace, model_baseline: Any, model_finetuned: Any, tokenizer: Any,
                device: torch.device, prompts: Sequence[str]) -> list[PromptResult]:
    """Upstream's loop: baseline greedy, then fine-tuned greedy, per prompt."""
    results = []
    for prompt in prompts:
        inputs = tokenizer(prompt, return_tensors="pt").to(device)
        print("==========Baseline: Greedy=========")
        r_base = generate(model_baseline, tokenizer, inputs, num_beams=1,
                          num_return_sequences=args.num_return_sequences, max_new_tokens=args.max_new_tokens)
        print_utils(r_base)
        print("==========finetune: Greedy=========")
        r_finetune = generate(model_finetuned, tokenizer, inputs, num_beams=1,
                              num_return_sequences=args.num_return_sequences, max_new_tokens=args.max_new_tokens)
        print_utils(r_finetune)
        # Greedy is the comparison upstream reports; sampling / beam / contrastive variants are a
        # matter of passing do_sample / num_beams / top_k + penalty_alpha to generate().
        print("====================prompt end=============================")
        print()
        print()
        results.append(PromptResult(prompt, r_base, r_finetune))
    return results


def main(argv: Sequence[str] | None = None) -> list[PromptResult]:
    from transformers import AutoModelForCausalLM

    from dschat.errors import UserError
    from dschat.models.build import create_hf_model
    from dschat.models.reward_model import refuse_reward_model
    from dschat.models.tokenizer import tokenizer_differences
    from dschat.models.registry import load_config, resolve_model_path
    from dschat.paths import step3_part
    from dschat.training.run_setup import quiet_transformers
    from dschat.training.step_data import load_tokenizer

    args = parse_args(argv)
    # Both paths are checked before either model loads: causal LMs, not step-2 reward models.
    for flag in ("model_name_or_path_baseline", "model_name_or_path_finetune"):
        name = getattr(args, flag)
        actor = step3_part(name, "actor")
        if actor is not None:  # a step-3 output root: its actor/, as inference/chatbot.py takes it
            print(f"(using the step-3 actor in {actor} for --{flag})", flush=True)
            name = str(actor)
            setattr(args, flag, name)
        refuse_reward_model(resolve_model_path(name), f"--{flag} {name}",
                            "pass a base model or a step-1 or step-3 actor folder")
    quiet_transformers()
    device = default_device()
    tokenizer = load_tokenizer(args.model_name_or_path_baseline, args.add_eot_token)
    # The baseline's tokenizer encodes the prompts and decodes the answers of both models.
    differences = tokenizer_differences(tokenizer, load_tokenizer(args.model_name_or_path_finetune, args.add_eot_token))
    if differences:
        fix = "pass a baseline of the fine-tuned model's family"
        if not args.add_eot_token and not tokenizer_differences(load_tokenizer(args.model_name_or_path_baseline, True),
                                                                load_tokenizer(args.model_name_or_path_finetune, True)):
            fix = "the fine-tuned model was trained with --add_eot_token: pass --add_eot_token"
        raise UserError(f"the baseline's tokenizer, used for both models, is not the fine-tuned model's "
                        f"({'; '.join(differences)}); {fix}")
    longest = max(len(tokenizer(prompt)["input_ids"]) for prompt in PROMPTS[args.language])
    for flag in ("model_name_or_path_baseline", "model_name_or_path_finetune"):  # before any weights load
        limit = getattr(load_config(resolve_model_path(getattr(args, flag))), "max_position_embeddings", None)
        if limit and longest + args.max_new_tokens > limit:
            raise UserError(f"--max_new_tokens {args.max_new_tokens} after the longest prompt's {longest} tokens "
                            f"passes --{flag}'s {limit} positions (max_position_embeddings); give --max_new_tokens "
                            f"{limit - longest} or less")
    model_baseline = create_hf_model(AutoModelForCausalLM, args.model_name_or_path_baseline, tokenizer, None)
    model_finetuned = create_hf_model(AutoModelForCausalLM, args.model_name_or_path_finetune, tokenizer, None)
    model_baseline.to(device).eval()
    model_finetuned.to(device).eval()
    return prompt_eval(args, model_baseline, model_finetuned, tokenizer, device, PROMPTS[args.language])


if __name__ == "__main__":
    sys.exit(cli_main(main))
