"""A decoding path that falls back does so on every rank or on none (two real gloo ranks): a rank
whose rollout succeeded drops it when another rank's path fell back, and raises one line when another
rank's path failed in a way no rank falls back from, so no rank is left in another collective than
the others (:func:`dschat.rlhf.rollout.generator._decode`)."""
from __future__ import annotations

from helpers.two_ranks import run_gloo_ranks

RANKS = r'''
import datetime, json, sys
import torch
import torch.distributed as dist

rank, store, out, failing = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
from dschat.rlhf.rollout.conversation import Conversation
from dschat.rlhf.rollout.generator import _decode
from dschat.rlhf.rollout.path import DecodingPath, RolloutRequest
from dschat.rlhf.rollout.sampling import Rollout


class Compiled(DecodingPath):
    name = loop = label = "compiled"
    falls_back = True

    def __init__(self):
        self.off = False

    def can_serve(self, request):
        return None

    def generate(self, request):
        request.conversation.reused = True  # as a path that continued the turn's KV cache
        if rank == 1:
            raise (RuntimeError("compile failed") if failing == "compile" else torch.OutOfMemoryError("out of memory"))
        return Rollout(request.prompts, None)

    def fall_back(self, err, request):
        if isinstance(err, torch.OutOfMemoryError):
            return None
        self.off = True
        return f"compiled failed ({err}); the next path from now on"


path = Compiled()
request = RolloutRequest(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long),
                         conversation=Conversation())
try:
    rollout, failure = _decode(path, request)
    result = {"rollout": rollout is not None, "reason": None if failure is None else failure[0], "off": path.off,
              "reused": request.conversation.reused}
except BaseException as err:
    result = {"raised": type(err).__name__, "line": str(err)}
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(result, f)
from dschat.runtime.dist import destroy_gloo_group
destroy_gloo_group()  # the steps' teardown: gc first (a bare destroy aborted now and then)
'''


def test_a_fallback_on_one_rank_is_taken_on_every_rank(tmp_path):
    succeeded, failed = run_gloo_ranks(RANKS, tmp_path, "compile")
    assert failed == {"rollout": False, "reason": "compiled failed (compile failed); the next path from now on",
                      "off": True, "reused": False}
    # Rank 0's own rollout worked; it is dropped (its continued KV cache too), and the path is off here too.
    assert succeeded == {"rollout": False, "off": True, "reused": False,
                         "reason": "compiled failed (compiled failed on another rank); the next path from now on"}


def test_an_error_no_rank_falls_back_from_stops_every_rank(tmp_path):
    succeeded, failed = run_gloo_ranks(RANKS, tmp_path, "oom")
    assert failed == {"raised": "OutOfMemoryError", "line": "out of memory"}
    assert succeeded == {"raised": "UserError",
                         "line": "decoding with compiled failed on another rank (its error is in that rank's log)"}
