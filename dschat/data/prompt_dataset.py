"""``create_prompt_dataset``: a phase's tokenised (train, eval) datasets, built once and cached.

Upstream's entry point (``data_utils.create_prompt_dataset``), same arguments and blending: every
dataset of ``--data_path`` is loaded and its rows for the phase selected (:mod:`dschat.data.phases`),
tokenised (:mod:`dschat.data.tokenization`), blended and shuffled, and stored in the cache
(:mod:`dschat.data.cache`); a later run with the same inputs loads the cache instead.

* ``reload=True`` (``--rebuild_data_cache``) rebuilds on processes with ``local_rank <= 0``; when a
  process group is up every rank then waits for them, and an error in a build (say, every prompt
  too long) is raised on every rank, a :class:`UserError` with the same message.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from dschat.data.cache import (
    building,
    cache_files,
    cache_key,
    check_data_output_path,
    key_fields,
    load_cache,
    write_cache,
)
from dschat.data.dispatch import resolve_dataset
from dschat.data.phases import PhasePlan, PhaseRows, check_data_path, plan_phase_data, require_eval
from dschat.data.split import get_shuffle_idx, parse_data_split
from dschat.data.token_dataset import PromptDataset
from dschat.data.tokenization import tokenize_selection
from dschat.errors import UserError
from dschat.runtime.dist import gather_json

#: Used when ``seed`` is None (upstream step 3's default): see :func:`create_prompt_dataset`.
DEFAULT_SEED = 1234

__all__ = ["create_prompt_dataset", "DEFAULT_SEED"]


def _build_datasets(
    plan: PhasePlan, train_phase: int, seed: int, tokenizer: Any, max_seq_len: int, eot: str, reload: bool,
) -> tuple[PromptDataset, PromptDataset, list[dict]]:
    """Tokenise, blend and shuffle as upstream; returns (train, eval, per-dataset stats)."""
    print(f"Creating prompt dataset {plan.data_path}, reload={reload}")
    stats = []

    def run(selections: list[PhaseRows], kind: str) -> tuple[list[PromptDataset], list[PromptDataset]]:
        trains, evals = [], []
        for index, sel in enumerate(selections):
            tr, ev = tokenize_selection(sel, train_phase, tokenizer, eot, max_seq_len, index)
            trains.append(tr)
            evals.append(ev)
            stats.append({
                "name": sel.raw.dataset_name, "role": kind,
                "train_size": len(tr), "eval_size": len(ev),
                "train_filtered": tr.filtered, "eval_filtered": ev.filtered,
            })
        return trains, evals

    trains, evals = run(plan.selections, "data_path")
    if len(trains) == 1:  # single dataset: upstream keeps its order
        train, held_out = trains[0], evals[0]
    else:  # blending: ConcatDataset, then Subset by get_shuffle_idx(seed, total)
        train = PromptDataset.concat(trains)
        train = train.take(get_shuffle_idx(seed, len(train)).astype("int64"))
        held_out = PromptDataset.concat(evals)
        held_out = held_out.take(get_shuffle_idx(seed, len(held_out)).astype("int64"))
    if train_phase == 1 and plan.sft_selections:
        sft_trains, sft_evals = run(plan.sft_selections, "sft_only_data_path")
        train = PromptDataset.concat([train] + sft_trains)
        train = train.take(get_shuffle_idx(seed, len(train)).astype("int64"))
        held_out = PromptDataset.concat([held_out] + sft_evals)
        held_out = held_out.take(get_shuffle_idx(seed, len(held_out)).astype("int64"))
    require_eval(plan.data_path, train_phase, len(held_out))
    return train, held_out, stats


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _share_build_outcome(failure: Exception | None) -> None:
    """Wait for every rank (a collective, like the barrier it replaces) and fail on all of them if a
    building rank failed.

    Under ``reload`` only local rank 0 builds; an error there that the other ranks cannot see (e.g.
    every prompt longer than ``max_prompt_seq_len``, found only while tokenising) would leave them
    waiting at a barrier. A :class:`UserError` is raised with the same message on every rank; any
    other error is re-raised where it happened and reported as a ``RuntimeError`` naming that rank
    elsewhere. The outcomes travel as JSON (:func:`dschat.runtime.dist.gather_json`), never pickled.
    """
    outcome = None
    if failure is not None:
        outcome = [isinstance(failure, UserError), type(failure).__name__, str(failure)]
    outcomes: list[Any] = gather_json(outcome)  # data only: no pickles from other processes
    if failure is not None:
        raise failure
    for rank, reported in enumerate(outcomes):
        if reported is not None:
            is_user_error, kind, message = reported
            if is_user_error:
                raise UserError(message)
            raise RuntimeError(f"rank {rank} failed to build the data cache ({kind}: {message}); see its log")


def create_prompt_dataset(
    local_rank: int,
    data_path: Sequence[str] | str,
    data_split: str,
    output_path: str,
    train_phase: int,
    seed: int | None,
    tokenizer: Any,
    max_seq_len: int,
    end_of_conversation_token: str = "<|endoftext|>",
    sft_only_data_path: Sequence[str] = (),
    reload: bool = False,
) -> tuple[PromptDataset, PromptDataset]:
    """(train, eval) :class:`PromptDataset` for ``train_phase``, built once and cached on disk.

    Same arguments and blending as upstream (see the module docstring for the cache). The phase-3
    eval split is a real held-out prompt set (docs/evaluation.md); ``seed=None`` (upstream step 3's
    default) uses :data:`DEFAULT_SEED`, because a random seed would give step 3 a chunk that overlaps
    the rows steps 1 and 2 trained on (docs/upstream.md#flags-and-defaults).
    """
    data_path = [data_path] if isinstance(data_path, str) else list(data_path)
    check_data_path(data_path)
    if train_phase not in (1, 2, 3):
        raise UserError(f"train_phase must be 1, 2 or 3, got {train_phase}")
    if int(max_seq_len) < 1:
        raise UserError(f"max_seq_len must be a positive number of tokens, got {max_seq_len}")
    proportions = parse_data_split(data_split)
    if seed is None:
        print(f"Warning: no seed given for the data split; using {DEFAULT_SEED} (steps 1-2's default) "
              "so the phases keep disjoint rows")
        seed = DEFAULT_SEED
    # Upstream ignores --sft_only_data_path outside phase 1; so does the key.
    sft_paths = list(sft_only_data_path) if train_phase == 1 else []
    sources = [resolve_dataset(p) for p in data_path]
    sft_sources = [resolve_dataset(p) for p in sft_paths]
    fields = key_fields(sources, sft_sources, proportions, train_phase, seed, tokenizer, max_seq_len, end_of_conversation_token)
    key = cache_key(fields)
    files = cache_files(output_path, key)
    check_data_output_path(output_path)  # before reading anything there

    def build(plan: PhasePlan) -> tuple[PromptDataset, PromptDataset]:
        train, held_out, stats = _build_datasets(
            plan, train_phase, seed, tokenizer, max_seq_len, end_of_conversation_token, reload,
        )
        write_cache(files, key, fields, train, held_out, stats)
        return train, held_out

    def keyed(pair: tuple[PromptDataset, PromptDataset]) -> tuple[PromptDataset, PromptDataset]:
        pair[0].cache_key = pair[1].cache_key = key
        return pair

    if reload:
        # Every rank validates, so bad input fails everywhere instead of leaving ranks at the barrier.
        plan = plan_phase_data(data_path, sft_paths, data_split, train_phase, seed, output_path, local_rank)
        result, failure = None, None
        if local_rank <= 0:
            try:
                with building(files):
                    result = build(plan)
            except Exception as err:  # re-raised below, on every rank
                if not _distributed():
                    raise
                failure = err
        if _distributed():
            _share_build_outcome(failure)  # the barrier, telling every rank how the builds went
        if result is not None:
            return keyed(result)

    cached = load_cache(files, key)
    if cached is not None:
        return keyed(cached)
    # Validate and load the raw data before creating anything on disk: bad input leaves no files.
    plan = plan_phase_data(data_path, sft_paths, data_split, train_phase, seed, output_path, local_rank)
    with building(files):
        cached = load_cache(files, key)  # another process may have built it while we waited
        if cached is not None:
            return keyed(cached)
        return keyed(build(plan))
