"""Build (or validate) the tokenised-dataset cache ahead of training.

    python -m dschat.data.prepare --data_path dschat/builtin --train_phase 2 \\
        --model_name_or_path tiny-llama --max_seq_len 512

Useful before a multi-node launch: the step scripts then find the cache and only load it. The
flags mirror the step scripts', so the cache key matches theirs when the values do (every step
appends the tokenizer's EOS unless ``--end_of_conversation_token`` says otherwise; pass
``--add_eot_token`` if the step does). Bad input prints one ``error:`` line and exits with code 2
(``--debug`` shows the traceback).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from dschat.cli.shared import add_data_args, check_seed, user_path
from dschat.data.dispatch import resolve_dataset
from dschat.data.phases import plan_phase_data
from dschat.data.split import parse_data_split
from dschat.errors import UserError, cli_main
from dschat.models.registry import (check_local_model_path, check_pair_seq_len, check_seq_len_fits_positions,
                                    check_sft_seq_len)
from dschat.models.tokenizer import end_of_conversation_text, load_hf_tokenizer
from dschat.runtime.fs import check_writable_dir


#: Each phase's length flag default in its step script (steps 1 and 2's --max_seq_len, step 3's
#: --max_prompt_seq_len): prepare's default, so that its cache key is the one the step reads.
PHASE_MAX_LEN_DEFAULTS: dict[int, int] = {1: 512, 2: 512, 3: 256}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dschat.data.prepare",
        description="Build or validate the tokenised-dataset cache of one training phase.",
    )
    add_data_args(parser, phase=1)
    group = parser.add_argument_group("tokenisation")
    group.add_argument("--model_name_or_path", type=user_path, required=True,
                       help="Model folder, hub id or dschat short name whose tokenizer to use.")
    group.add_argument("--train_phase", type=int, choices=(1, 2, 3), required=True,
                       help="1 = SFT, 2 = reward model / DPO, 3 = PPO prompts.")
    group.add_argument("--max_seq_len", "--max_prompt_seq_len", dest="max_seq_len", type=int, default=None,
                       help="Sequence length (phases 1-2), or the max prompt length (phase 3; longer "
                            "prompts are filtered). Default: the step's own default, 512 for phases 1-2 "
                            "(--max_seq_len) and 256 for phase 3 (--max_prompt_seq_len).")
    group.add_argument("--seed", type=int, default=1234, help="Seed of the data split and shuffles.")
    group.add_argument("--end_of_conversation_token", type=str, default=None,
                       help="Appended to every phase-1/2 text. Default: the tokenizer's EOS (as the "
                            "step scripts; upstream's steps 2-3 used '<|endoftext|>').")
    group.add_argument("--add_eot_token", action="store_true",
                       help="Add --eot_token to the tokenizer as a special token (as the steps' flag).")
    group.add_argument("--eot_token", type=str, default="<|endoftext|>",
                       help="The token --add_eot_token adds.")
    parser.add_argument("--debug", action="store_true", help="Show tracebacks for input errors.")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.max_seq_len is None:
        args.max_seq_len = PHASE_MAX_LEN_DEFAULTS[args.train_phase]
    # Input checks first, without torch/transformers and without writing anything: names, paths,
    # the split, then the data itself (parse errors, columns, empty phases).
    parse_data_split(args.data_split)
    check_seed(args.seed)
    if args.max_seq_len < 1:
        raise UserError(f"--max_seq_len must be positive, got {args.max_seq_len}")
    if args.train_phase in (1, 2):  # as steps 1 and 2 check it: a row, a pair needs 2 positions
        (check_sft_seq_len if args.train_phase == 1 else check_pair_seq_len)(args.max_seq_len)
    sft_paths = list(args.sft_only_data_path) if args.train_phase == 1 else []
    for name in list(args.data_path) + sft_paths:
        resolve_dataset(name)
    # A model path that cannot work gets a clear line before transformers is even imported.
    check_local_model_path(args.model_name_or_path)
    check_seq_len_fits_positions(args.model_name_or_path, args.max_seq_len, tokenizer_only=True)  # no weights
    check_writable_dir(args.data_output_path, "--data_output_path")
    plan_phase_data(args.data_path, sft_paths, args.data_split, args.train_phase, args.seed, args.data_output_path)

    # lazy: torch costs 1.3 s at import (python -X importtime); bad input is refused above without it
    from dschat.data import cache, prompt_dataset

    cache.check_data_output_path(args.data_output_path)  # a folder another user could write: before the tokenizer

    tokenizer = load_hf_tokenizer(
        args.model_name_or_path, fast_tokenizer=True,
        add_special_tokens=args.eot_token if args.add_eot_token else None,
    )
    # The step scripts' default: the tokenizer's EOS in every phase (see add_eot_args); phases 1-2 need one.
    eot = (end_of_conversation_text(tokenizer, args.end_of_conversation_token, args.model_name_or_path)
           if args.train_phase < 3 else args.end_of_conversation_token or tokenizer.eos_token)
    train, held_out = prompt_dataset.create_prompt_dataset(
        -1, args.data_path, args.data_split, args.data_output_path, args.train_phase, args.seed,
        tokenizer, args.max_seq_len, end_of_conversation_token=eot,
        sft_only_data_path=args.sft_only_data_path, reload=args.rebuild_data_cache,
    )
    # Phase 3: prompts too long; phase 2: pairs without a shared first token (dschat.data.tokenization).
    extra = f", filtered train={train.filtered} eval={held_out.filtered}" if args.train_phase >= 2 else ""
    print(f"phase {args.train_phase}: train={len(train)} eval={len(held_out)}{extra}; cache {Path(args.data_output_path) / f'traindata_{train.cache_key}.safetensors'}")


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
