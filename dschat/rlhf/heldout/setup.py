"""Step 3's held-out evaluation, before any model loads: the ``--eval_*`` flag rules, the judges
(``--eval_judge``) and the held-out prompts (:mod:`dschat.rlhf.heldout.evaluation` runs the evaluation).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from transformers import PreTrainedTokenizerBase

from dschat.cli.step3 import EVAL_INTERVAL_AUTO, flags_off_default
from dschat.data.prompt_dataset import create_prompt_dataset
from dschat.data.adapters.local import builtin_folders
from dschat.data.prompt_columns import PromptColumns
from dschat.data.token_dataset import PromptItem
from dschat.errors import UserError
from dschat.eval.scoring import check_reward_folder
from dschat.models.registry import resolve_model_path
from dschat.paths import BEST_DIR
from dschat.rewards import RewardFunction, load_reward_function
from dschat.runtime.dist import print_rank_0

__all__ = ["GOLD", "GOLD_SPEC", "Judge", "check_eval_args", "check_same_prompts", "heldout_prompt_items",
           "prompts_digest", "resolve_judges"]

#: ``--eval_judge gold``: the built-in gold judge (dschat.rewards:gold).
GOLD = "gold"
GOLD_SPEC = "dschat.rewards:gold"
PROXY = "proxy"  # the series of the step's own reward; a judge is named by its --eval_judge text


@dataclass(frozen=True)
class Judge:
    """One ``--eval_judge``: a reward function (``fn``) or a reward-model folder (``folder``)."""

    name: str
    fn: RewardFunction | None = None
    folder: Path | None = None


def _is_builtin_data(data_path: Sequence[str]) -> bool:
    # dschat/builtin-samples asks dschat/builtin's train prompts: the gold judge judges both.
    return bool(data_path) and all(p in builtin_folders() for p in data_path)


def resolve_judges(specs: Sequence[str], data_path: Sequence[str], timeout: float = 0.0) -> list[Judge]:
    """The ``--eval_judge`` values as :class:`Judge` objects: ``gold``, ``module:function`` (each call
    bounded by ``timeout`` seconds, ``--reward_fn_timeout``; 0: no limit) or a reward-model folder. A bad
    value is one :class:`UserError` line; no model is loaded here."""
    judges: list[Judge] = []
    for spec in specs:
        if spec in (GOLD, GOLD_SPEC):
            if not _is_builtin_data(data_path):
                raise UserError(f"--eval_judge {spec}: the gold judge scores the embedded data only (--data_path "
                                f"dschat/builtin or dschat/builtin-samples), not {' '.join(data_path)}; give a module:function or a reward-model "
                                "folder as judge")
            judges.append(Judge(GOLD, fn=load_reward_function(GOLD_SPEC)))
        elif Path(spec).expanduser().is_dir():
            if spec == PROXY:  # the judge's scores would be read as the proxy's, and the reverse
                raise UserError(f"--eval_judge {spec}: {PROXY!r} names the step's own reward (the proxy) in the "
                                f"evaluation's records; spell the folder ./{spec}")
            # the check the evaluation's load_reward makes: a step-2 output, its lora_adapter/, a classifier
            folder = check_reward_folder(Path(spec).expanduser(), "--eval_judge")
            resolve_model_path(str(folder))  # what the model flags check of a local folder
            judges.append(Judge(str(spec), folder=folder))
        elif ":" in spec:
            try:
                fn = load_reward_function(spec, timeout=timeout, nonfinite_numbers=True)  # only observes
            except UserError as err:  # the loader's lines name --reward_fn, its usual flag
                raise UserError(str(err).replace("--reward_fn", "--eval_judge")) from None
            judges.append(Judge(spec, fn=fn))
        else:
            raise UserError(f"--eval_judge {spec!r} is neither 'gold', a module.path:function nor a reward-model "
                            "folder; give one of those")
    names = [j.name for j in judges]
    if len(set(names)) != len(names):
        raise UserError(f"--eval_judge given twice: {', '.join(sorted({n for n in names if names.count(n) > 1}))}")
    folders = [str(j.folder.resolve()) for j in judges if j.folder is not None]  # one model, two spellings
    if len(set(folders)) != len(folders):
        twice = sorted({j.name for j in judges if j.folder is not None and folders.count(str(j.folder.resolve())) > 1})
        raise UserError(f"--eval_judge given twice: {', '.join(twice)} name the same folder; give it once")
    return judges


def check_eval_args(args: argparse.Namespace) -> list[Judge]:
    """Evaluation flag rules (before anything loads) and the resolved judges; resolves
    ``args.save_best_by``'s default in place: ``judge`` with a judge and an ``--output_dir``, else ``none``;
    and ``args.eval_interval``'s: ``auto`` when an evaluation flag asks for the evaluation, else 0 (off, as
    upstream)."""
    if args.eval_interval is None:
        wanted = bool(args.eval_judge) or args.stop_on_overoptimization or args.save_best_by not in (None, "none")
        args.eval_interval = EVAL_INTERVAL_AUTO if wanted else 0
    auto = args.eval_interval == EVAL_INTERVAL_AUTO
    interval, prompts = 1 if auto else int(args.eval_interval), int(args.eval_prompts)
    judges_given = list(args.eval_judge or [])
    if interval < 0:
        raise UserError(f"--eval_interval must be >= 0 (0: no evaluation), got {interval}")
    tuned = flags_off_default(args, ("eval_prompts", "eval_alarm_sigmas"))
    if interval == 0:
        extras = [flag for flag, on in (("--eval_judge", bool(judges_given)),
                                        ("--stop_on_overoptimization", args.stop_on_overoptimization),
                                        ("--save_best_by", args.save_best_by not in (None, "none")),
                                        ("--eval_prompts", "eval_prompts" in tuned),
                                        ("--eval_alarm_sigmas", "eval_alarm_sigmas" in tuned)) if on]
        if extras:
            raise UserError(f"{', '.join(extras)} need(s) the held-out evaluation: give --eval_interval N (> 0) "
                            "or auto")
        args.save_best_by = "none"
        return []
    if prompts < 1:
        raise UserError(f"--eval_prompts must be >= 1, got {prompts}")
    if not 0 < args.eval_alarm_sigmas < math.inf:  # inf: the alarm (and --stop_on_overoptimization) never fires
        raise UserError(f"--eval_alarm_sigmas must be a finite number > 0, got {args.eval_alarm_sigmas}")
    judges = resolve_judges(judges_given, args.data_path, getattr(args, "reward_fn_timeout", 0.0))
    for flag, on in (("--stop_on_overoptimization", args.stop_on_overoptimization),
                     ("--eval_alarm_sigmas", "eval_alarm_sigmas" in tuned)):
        if on and not judges:
            raise UserError(f"{flag}: the alarm compares the proxy with a judge; give --eval_judge")
    if args.save_best_by is None:
        args.save_best_by = "judge" if judges and args.output_dir else "none"
    if args.save_best_by == "judge" and not judges:
        raise UserError("--save_best_by judge needs a judge: give --eval_judge (or --save_best_by proxy|none)")
    if args.save_best_by != "none" and not args.output_dir:
        raise UserError(f"--save_best_by {args.save_best_by} keeps the best models in <output_dir>/{BEST_DIR}; "
                        "give --output_dir (or --save_best_by none)")
    return judges


def heldout_prompt_items(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase, local_rank: int,
                         columns: PromptColumns | None = None) -> list[PromptItem]:
    """The first ``--eval_prompts`` distinct prompts of the phase-3 eval split (the tokenised cache
    step 3 already built), in the dataset's fixed order. With ``--env`` and the run's ``columns``,
    distinct rows: rows that share a prompt are distinct tasks where their fields differ (a guessing
    game's secrets). None there is one :class:`UserError` line."""
    _, held_out = create_prompt_dataset(
        local_rank, args.data_path, args.data_split, args.data_output_path, 3, args.seed, tokenizer,
        args.max_prompt_seq_len, end_of_conversation_token=args.end_of_conversation_token or tokenizer.eos_token,
    )
    by_row = columns is not None and bool(getattr(args, "env", None))
    items, seen = [], set()
    for i in range(len(held_out)):
        item = held_out[i]
        key: tuple = tuple(item[0][item[1].bool()].tolist())
        if by_row and item.source is not None:
            key = (key, json.dumps(columns.records[item.source].fields, sort_keys=True, default=repr))
        if key in seen:
            continue
        seen.add(key)
        items.append(item)
        if len(items) == args.eval_prompts:
            break
    if not items:
        raise UserError(
            f"--eval_interval {args.eval_interval}: the phase-3 eval split of {' '.join(args.data_path)} has no "
            f"held-out prompts (data_split {args.data_split}, max_prompt_seq_len {args.max_prompt_seq_len}); add an "
            "eval.*/test.* file or rows to the data, or drop --eval_interval"
        )
    if len(items) < args.eval_prompts:
        print_rank_0(f"[eval] only {len(items)} distinct held-out prompts (--eval_prompts {args.eval_prompts}); "
                     "evaluating on those")
    return items


def prompts_digest(items: Sequence[PromptItem]) -> str:
    """SHA-256 of the held-out prompts' token ids, in order: what an evaluation series is measured on."""
    return hashlib.sha256(json.dumps([item[0].tolist() for item in items]).encode()).hexdigest()


def check_same_prompts(state: dict, digest: str, k: int) -> None:
    """One line when a checkpoint's evaluation ``state`` was measured on other prompts than this run's
    ``k`` (:func:`prompts_digest` ``digest``; a checkpoint without one: its count): its paired
    changes, best score and alarm would compare other prompts (before, a traceback after a PPO step)."""
    saved_k = len(state["history"][0]["proxy"]) if state.get("history") else None
    if state.get("prompts", digest) == digest and saved_k in (None, k):
        return
    measured = f"{saved_k} held-out prompts" if saved_k is not None else "other held-out prompts"
    raise UserError(f"the checkpoint's evaluations were made on {measured}, and this run's are {k} "
                    f"{'other ' if saved_k == k else ''}prompts: its series, best score and alarm cannot go on "
                    "here; resume with the flags that wrote it (--eval_prompts, --data_split, --max_prompt_seq_len), "
                    "or pass another --output_dir")
