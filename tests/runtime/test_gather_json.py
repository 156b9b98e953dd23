"""gather_json (dschat/runtime/dist.py) on two real gloo ranks, and the two gathers built on it: step 3's
evaluation rows (dschat/rlhf/heldout/evaluation.py) and the data-cache build outcome (dschat/data/prompt_dataset.py).
``torch.distributed.all_gather_object`` (pickles) is replaced by a function that fails, so a gather
that still unpickles what another process sends cannot pass."""
from __future__ import annotations

import math

from dschat.runtime.dist import gather_json

from helpers.two_ranks import run_gloo_ranks

SCRIPT = r'''
import json, math, sys
import torch
import torch.distributed as dist

rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)


def no_pickles(*args, **kwargs):
    raise AssertionError("all_gather_object: pickles between processes")


dist.all_gather_object = no_pickles
from dschat.data.prompt_dataset import _share_build_outcome
from dschat.errors import UserError
from dschat.rlhf.heldout import evaluation as ev
from dschat.rlhf.heldout.setup import Judge
from dschat.runtime.dist import gather_json

result = {}
# Different lengths per rank, non-ASCII text, NaN and infinities, nesting; an empty string.
value = {"rank": rank, "text": "é" * (3 + 100 * rank), "scores": [math.nan, -math.inf, 0.1 * rank], "none": None}
result["plain"] = gather_json(value)
result["empty"] = gather_json("" if rank == 0 else ["x"])
# Step 3's evaluation rows: rank 0 holds prompts 0 and 2, rank 1 prompt 1.
rows = ev._Rows(index=[0, 2] if rank == 0 else [1], proxy=[0.5, 2.5] if rank == 0 else [1.5],
                judges={"j": [math.nan, 2.0] if rank == 0 else [1.0]}, kl=[0.0, 0.2] if rank == 0 else [0.1],
                entropy=[1.0, 1.2] if rank == 0 else [1.1], tokens=[3, 5] if rank == 0 else [4],
                ended=[True, False] if rank == 0 else [True])
evaluation = ev.StepThreeEvaluation(type("A", (), {"eval_interval": 0, "output_dir": None})(), None,
                                    judges=[Judge("j")], rank=rank, world_size=2)
gathered = evaluation._gathered(rows)
result["rows"] = {k: getattr(gathered, k) for k in ("index", "proxy", "judges", "kl", "entropy", "tokens", "ended")}
# The data-cache build: rank 1 fails with a user error, rank 0 raises the same line.
try:
    _share_build_outcome(UserError("every prompt is longer than 8 tokens") if rank == 1 else None)
    result["build"] = "no error"
except UserError as err:
    result["build"] = f"UserError: {err}"
try:
    _share_build_outcome(OSError("disk full") if rank == 0 else None)
except (OSError, RuntimeError) as err:
    result["other"] = f"{type(err).__name__}: {err}"
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(result, f, allow_nan=True)
dist.barrier()  # neither rank tears gloo down while the other still talks to it
from dschat.runtime.dist import destroy_gloo_group
destroy_gloo_group()  # the steps' teardown: gc first (a bare destroy aborted now and then)
'''


def test_two_gloo_ranks_gather_json_evaluation_rows_and_build_outcomes_without_pickles(tmp_path):
    results = run_gloo_ranks(SCRIPT, tmp_path)
    for rank, got in enumerate(results):
        plain = got["plain"]
        assert [p["rank"] for p in plain] == [0, 1] and [len(p["text"]) for p in plain] == [3, 103]
        assert plain[1]["text"] == "é" * 103 and plain[0]["none"] is None
        assert math.isnan(plain[0]["scores"][0]) and plain[1]["scores"][1:] == [-math.inf, 0.1]
        assert got["empty"] == ["", ["x"]]
        rows = got["rows"]
        assert rows["index"] == [0, 1, 2] and rows["proxy"] == [0.5, 1.5, 2.5] and rows["tokens"] == [3, 4, 5]
        assert rows["kl"] == [0.0, 0.1, 0.2] and rows["ended"] == [True, True, False]
        assert math.isnan(rows["judges"]["j"][0]) and rows["judges"]["j"][1:] == [1.0, 2.0]
        assert got["build"] == "UserError: every prompt is longer than 8 tokens"
    assert results[0]["other"] == "OSError: disk full"
    assert results[1]["other"] == "RuntimeError: rank 0 failed to build the data cache (OSError: disk full); see its log"


def test_without_a_process_group_it_is_the_value_through_json():
    assert gather_json({"a": (1, 2.5), "b": math.inf}) == [{"a": [1, 2.5], "b": math.inf}]
