"""Seeded shuffles and ``--data_split`` chunking, with upstream's exact arithmetic.

Upstream (``dschat/utils/data/data_utils.py``) splits every dataset into one chunk per training
phase: the proportions in ``--data_split`` (``"2,4,4"``) are parsed as floats and normalised, each
chunk gets ``int(round(p * N))`` rows (Python's ``round``: ties go to the even neighbour), the
boundaries are the cumulative sums, and the rounding error ``last - N`` is subtracted from every
boundary after the first, so the *first* chunk absorbs it. Rows are assigned through a
``numpy.random.RandomState(seed)`` permutation, so a given seed yields the same chunks in steps 1, 2
and 3 and the phases train on disjoint rows.

The index is computed in memory every time; no index file is written or read, so it cannot go stale
when a dataset changes size (upstream's ``.npy`` index cache: docs/upstream.md#data-splits).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from dschat.errors import UserError

__all__ = [
    "parse_data_split",
    "split_boundaries",
    "get_shuffle_idx",
    "get_raw_dataset_split_index",
]


def parse_data_split(data_split: str, *, parts: int | None = 3) -> list[float]:
    """Parse ``"2,4,4"`` into ``[2.0, 4.0, 4.0]`` (not normalised).

    ``parts`` is the number of proportions required (3 for ``--data_split``; ``None`` accepts any
    count, as the internal ``"9,1"`` train/eval split needs). Raises :class:`UserError` for
    non-numbers, negative or non-finite values, a wrong count, or all zeros.
    """
    text = str(data_split)
    fix = "pass comma-separated non-negative proportions for phases 1, 2, 3, e.g. --data_split 2,4,4"
    try:
        values = [float(piece) for piece in text.split(",")]
    except ValueError:
        raise UserError(f"--data_split {text!r} is not a list of numbers; {fix}") from None
    if parts is not None and len(values) != parts:
        raise UserError(f"--data_split {text!r} has {len(values)} proportion(s), expected {parts}; {fix}")
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise UserError(f"--data_split {text!r} has a negative or non-finite proportion; {fix}")
    if sum(values) <= 0:
        raise UserError(f"--data_split {text!r} gives every phase a zero share; {fix}")
    return values


def split_boundaries(proportions: Sequence[float], data_size: int) -> list[int]:
    """Chunk boundaries ``[0, b1, ..., N]`` for ``data_size`` rows, by upstream's rounding rule.

    Example (N = 5, ``"1,1"``): ``round(2.5) = 2`` twice (banker's rounding) gives ``[0, 2, 4]``;
    the shortfall ``4 - 5 = -1`` is subtracted from every boundary after the first: ``[0, 3, 5]``.

    When rounding *over*-allocates by more rows than the first chunk holds (tiny N with a small first
    share, e.g. N = 3, ``"0,1,1"``: upstream's ``[0, -1, 1, 3]``, whose overlapping slices share rows),
    the excess that the first chunk cannot absorb is taken from the following chunks in order
    (``[0, 0, 1, 3]``). Whenever upstream's boundaries are valid they are returned unchanged.
    """
    total = float(sum(proportions))
    sizes = [int(round((p / total) * float(data_size))) for p in proportions]
    # Upstream: boundaries = cumsum(sizes); diff = boundaries[-1] - N; boundaries[1:] -= diff,
    # i.e. the first chunk's size changes by -diff and every later chunk keeps its rounded size.
    diff = sum(sizes) - data_size
    sizes[0] -= diff
    carry = -sizes[0] if sizes[0] < 0 else 0
    if carry:
        sizes[0] = 0
        for i in range(1, len(sizes)):
            take = min(carry, sizes[i])
            sizes[i] -= take
            carry -= take
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    assert bounds[-1] == data_size, (bounds, data_size)
    return bounds


def get_shuffle_idx(seed: int | None, size: int) -> np.ndarray:
    """Upstream's permutation: ``RandomState(seed).shuffle(arange(size))``, uint32 unless huge.

    The dtype matters for reproducibility: ``RandomState.shuffle`` draws the same swaps for any
    dtype, but we keep upstream's uint32 (int64 from ``2**32 - 2`` rows on) so arrays compare equal.
    """
    rng = np.random.RandomState(seed=seed)
    dtype = np.uint32
    if size >= (np.iinfo(np.uint32).max - 1):
        dtype = np.int64
    shuffle_idx = np.arange(start=0, stop=size, step=1, dtype=dtype)
    rng.shuffle(shuffle_idx)
    return shuffle_idx


def get_raw_dataset_split_index(
    local_rank: int,
    output_path: str,
    dataset_name: str,
    seed: int | None,
    split_name: str,
    data_split: str,
    split_index: int,
    data_size: int,
    rebuild: bool = False,
) -> list[int]:
    """Row indices of chunk ``split_index`` of a ``data_size``-row split, shuffled by ``seed``.

    Same signature and result as upstream; ``local_rank``, ``output_path``, ``dataset_name``,
    ``split_name`` and ``rebuild`` only named upstream's ``.npy`` cache file, which dschat does not
    write (see the module docstring), and are accepted for compatibility.
    """
    del local_rank, output_path, dataset_name, split_name, rebuild  # no index files (see above)
    proportions = parse_data_split(data_split, parts=None)
    if not 0 <= split_index < len(proportions):
        raise ValueError(f"split_index {split_index} out of range for data_split {data_split!r}")
    bounds = split_boundaries(proportions, data_size)
    shuffle_idx = get_shuffle_idx(seed, data_size)
    return shuffle_idx[bounds[split_index]:bounds[split_index + 1]].tolist()
