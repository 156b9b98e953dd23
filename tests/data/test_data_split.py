"""--data_split chunking and the seeded shuffle, against values worked out by hand."""
from __future__ import annotations

import numpy as np
import pytest

from dschat.data.split import get_raw_dataset_split_index, get_shuffle_idx, parse_data_split, split_boundaries
from dschat.errors import UserError


def test_shuffle_idx_is_numpy_randomstate_permutation():
    # RandomState's stream is frozen by NumPy's compatibility policy, so these values are stable.
    idx = get_shuffle_idx(1234, 10)
    assert idx.dtype == np.uint32
    assert idx.tolist() == [7, 2, 9, 1, 0, 8, 4, 5, 6, 3]
    expected = np.arange(10, dtype=np.uint32)
    np.random.RandomState(1234).shuffle(expected)
    assert idx.tolist() == expected.tolist()
    assert get_shuffle_idx(0, 5).tolist() == [2, 0, 1, 3, 4]


@pytest.mark.parametrize(
    "proportions, n, expected",
    [
        # "2,4,4" -> 0.2/0.4/0.4. N=10: round(2.0)=2, round(4.0)=4, round(4.0)=4 -> cumsum [0,2,6,10], diff 0.
        ([2, 4, 4], 10, [0, 2, 6, 10]),
        # N=7: round(1.4)=1, round(2.8)=3, round(2.8)=3 -> [0,1,4,7], diff 0.
        ([2, 4, 4], 7, [0, 1, 4, 7]),
        # N=1: round(0.2)=0, round(0.4)=0, round(0.4)=0 -> [0,0,0,0]; diff = 0-1 = -1 is subtracted
        # from every boundary after the first -> [0,1,1,1]: the first chunk absorbs the row.
        ([2, 4, 4], 1, [0, 1, 1, 1]),
        # Banker's rounding: N=5, "1,1": round(2.5)=2 twice -> [0,2,4]; diff = -1 -> [0,3,5].
        # (Half-up rounding would give round(2.5)=3 -> [0,3,6]; diff 1 -> [0,2,5].)
        ([1, 1], 5, [0, 3, 5]),
        # N=7, "1,1": round(3.5)=4 (4 is even) -> [0,4,8]; diff = 1 -> [0,3,7].
        ([1, 1], 7, [0, 3, 7]),
        # "10,0,0": everything to phase 1.
        ([10, 0, 0], 7, [0, 7, 7, 7]),
        # train_eval "9,1", N=10: round(9.0)=9, round(1.0)=1 -> [0,9,10].
        ([9, 1], 10, [0, 9, 10]),
        # train_eval "9,1", N=5: 0.9*5 = 4.5 -> round = 4 (banker's), 0.1*5 = 0.5 -> 0 -> [0,4,4];
        # diff = -1 -> [0,5,5]: eval gets nothing (upstream's rule, kept).
        ([9, 1], 5, [0, 5, 5]),
        # Our fix: N=3, "0,1,1": round(1.5)=2 twice -> [0,0,2,4]; upstream's diff=1 would give
        # [0,-1,1,3] (a negative slice end: overlapping chunks). The first chunk can absorb nothing,
        # so the excess row comes off the second chunk -> [0,0,1,3].
        ([0, 1, 1], 3, [0, 0, 1, 3]),
    ],
)
def test_split_boundaries_by_hand(proportions, n, expected):
    assert split_boundaries(proportions, n) == expected


def test_split_index_is_a_slice_of_the_shuffle():
    # seed 1234, N=10: permutation [7,2,9,1,0,8,4,5,6,3]; "2,4,4" boundaries [0,2,6,10].
    chunks = [get_raw_dataset_split_index(-1, "/unused", "ds", 1234, "train", "2,4,4", i, 10) for i in range(3)]
    assert chunks == [[7, 2], [9, 1, 0, 8], [4, 5, 6, 3]]
    shuffle = get_shuffle_idx(1234, 10).tolist()
    assert chunks[0] + chunks[1] + chunks[2] == shuffle
    assert all(type(i) is int for c in chunks for i in c)


def test_split_index_train_eval_and_sft_only():
    # train_eval 9:1 on 20 rows: boundaries [0,18,20]; 10,0,0 gives phase 1 everything.
    shuffle = get_shuffle_idx(7, 20).tolist()
    assert get_raw_dataset_split_index(0, "/x", "d", 7, "train_eval", "9,1", 0, 20) == shuffle[:18]
    assert get_raw_dataset_split_index(0, "/x", "d", 7, "train_eval", "9,1", 1, 20) == shuffle[18:]
    assert get_raw_dataset_split_index(0, "/x", "d", 7, "train", "10,0,0", 0, 20) == shuffle
    assert get_raw_dataset_split_index(0, "/x", "d", 7, "train", "10,0,0", 1, 20) == []


def test_split_index_writes_no_files_and_follows_data_size(tmp_path):
    # Upstream cached the index in a .npy named without the data size (stale after data changes).
    a = get_raw_dataset_split_index(0, str(tmp_path), "d", 1, "train", "2,4,4", 0, 10)
    b = get_raw_dataset_split_index(0, str(tmp_path), "d", 1, "train", "2,4,4", 0, 20)
    assert len(a) == 2 and len(b) == 4
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bad", ["2,4", "a,b,c", "1,-1,1", "0,0,0", "1,nan,1", "", "1,,1"])
def test_bad_data_split_is_a_user_error(bad):
    with pytest.raises(UserError, match="--data_split"):
        parse_data_split(bad)


def test_parse_data_split_accepts_floats_and_spaces():
    assert parse_data_split("2, 4, 4") == [2.0, 4.0, 4.0]
    assert parse_data_split("0.5,0.25,0.25") == [0.5, 0.25, 0.25]
    assert parse_data_split("9,1", parts=None) == [9.0, 1.0]


def test_a_phases_rows_follow_the_seed(tmp_path):
    """select_phase_rows takes chunk phase-1 of the split's shuffle by --seed: another seed, other rows."""
    from dschat.data.dispatch import get_raw_dataset
    from dschat.data.phases import select_phase_rows

    from helpers.data import pref_rows, write_jsonl

    raw = get_raw_dataset(str(write_jsonl(tmp_path / "p.jsonl", pref_rows(60))), str(tmp_path), 1234, -1)
    rows = {}
    for seed in (1234, 7):
        sel = select_phase_rows(raw, "2,4,4", 1, seed, str(tmp_path), -1)
        expected = get_raw_dataset_split_index(-1, str(tmp_path), raw.dataset_name_clean, seed, "train", "2,4,4", 0,
                                               len(raw.get_train_data()))
        rows[seed] = [r["prompt"] for r in sel.train]
        assert rows[seed] == [raw.get_train_data()[int(i)]["prompt"] for i in expected]
    assert rows[1234] != rows[7]
