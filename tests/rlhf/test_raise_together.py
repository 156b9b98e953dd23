"""A rank whose user code fails or is stuck: :func:`dschat.rlhf.experience.raise_together` on two real
gloo ranks, and the collective timeout step 3 asks for (:func:`dschat.training.run_setup.collective_timeout_minutes`),
which outwaits the longest call of user code so that the stuck rank's own line stops the run."""
from __future__ import annotations

import argparse

import pytest

from dschat.remote_reward import worst_case_seconds
from dschat.training import run_setup
from dschat.training.run_setup import USER_CALL_MARGIN_MINUTES, collective_timeout_minutes, longest_user_call_seconds

from helpers.two_ranks import run_gloo_ranks

# Rank 1's call fails; rank 0 never reaches the collective (it waits for rank 1's result file), so rank
# 1's all-reduce fails when its short gloo timeout fires. Rank 1 must still raise its own line.
RANKS = r'''
import datetime, json, os, sys, time
import torch.distributed as dist

rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=300))  # the start-up waits for a late peer
from dschat.errors import UserError
from dschat.rlhf.experience import raise_together
from dschat.runtime.dist import use_collective_timeout

use_collective_timeout(datetime.timedelta(seconds=3))

result = {}
if rank == 1:
    def fails():
        raise UserError("environment e: step raised ValueError: boom on row 3 (turn 2); fix the environment")
    try:
        raise_together(fails, "an environment")
    except BaseException as err:
        cause = err.__cause__
        result = {"type": type(err).__name__, "line": str(err), "cause": None if cause is None else type(cause).__name__}
    with open(f"{out}/rank1.json", "w") as f:
        json.dump(result, f)
else:
    while not os.path.exists(f"{out}/rank1.json"):  # rank 1 stops, as a stuck rank's peers would, alone
        time.sleep(0.1)
    with open(f"{out}/rank0.json", "w") as f:
        json.dump({}, f)
sys.stdout.flush()
os._exit(0)  # no teardown: the group is broken
'''


def test_a_rank_whose_collective_fails_after_its_own_failure_raises_its_own_line(tmp_path):
    _, failed = run_gloo_ranks(RANKS, tmp_path)
    assert failed["type"] == "UserError", failed
    assert failed["line"] == "environment e: step raised ValueError: boom on row 3 (turn 2); fix the environment"
    assert failed["cause"] is not None and failed["cause"] != "UserError"  # the collective's own error


def _args(**flags) -> argparse.Namespace:
    return argparse.Namespace(**{"dist_timeout": 5.0, **flags})


class TestCollectiveTimeout:
    def test_steps_1_and_2_and_a_step_3_without_user_code_ask_for_nothing_more(self):
        assert collective_timeout_minutes(argparse.Namespace()) == 0.0  # no flag at all
        # The timeouts count only with the code they bound; 'gold' and reward-model judges run none.
        assert collective_timeout_minutes(_args(env=None, env_timeout=600.0, reward_fn=None, eval_judge=["gold"],
                                                reward_fn_timeout=600.0, reward_url=None)) == 0.0

    def test_the_longest_stretch_of_user_code_plus_the_margin(self):
        assert USER_CALL_MARGIN_MINUTES >= 2
        env = _args(env="m:f", env_timeout=600.0, reward_fn=None, reward_fn_timeout=900.0)
        assert longest_user_call_seconds(env) == 600.0
        assert collective_timeout_minutes(env) == 10.0 + USER_CALL_MARGIN_MINUTES
        fn = _args(env="m:f", env_timeout=600.0, reward_fn=["m:g"], reward_fn_timeout=900.0)
        assert collective_timeout_minutes(fn) == 15.0 + USER_CALL_MARGIN_MINUTES
        judge = _args(eval_judge=["m:g", "gold"], reward_fn_timeout=1200.0)
        assert collective_timeout_minutes(judge) == 20.0 + USER_CALL_MARGIN_MINUTES

    def test_a_batchs_reward_terms_run_one_after_another_so_their_limits_add_up(self):
        two = _args(reward_fn=["m:g", "m:h"], reward_fn_timeout=300.0)
        assert longest_user_call_seconds(two) == 600.0
        url = _args(reward_fn=["m:g"], reward_fn_timeout=300.0, reward_url="http://127.0.0.1:1/get_reward",
                    reward_url_timeout=60.0, reward_url_retries=3)
        assert longest_user_call_seconds(url) == 300.0 + worst_case_seconds(60.0, 3)
        assert longest_user_call_seconds(_args(reward_fn=["m:g"], reward_fn_timeout=0.0, env="m:f",
                                               env_timeout=60.0)) == 60.0  # an unbounded stretch adds nothing

    def test_the_reward_url_client_s_worst_case(self):
        # 4 attempts of 60 s to connect and 60 s for the reply, and backoffs of 0.5 + 1 + 2 s.
        assert worst_case_seconds(60.0, 3) == 4 * 120.0 + 3.5
        url = _args(reward_url="http://127.0.0.1:1/get_reward", reward_url_timeout=300.0, reward_url_retries=3)
        assert collective_timeout_minutes(url) == pytest.approx(worst_case_seconds(300.0, 3) / 60 + USER_CALL_MARGIN_MINUTES)
        assert collective_timeout_minutes(url) > 40.0

    @pytest.mark.parametrize("timeout", [0.0, -1.0, float("nan"), float("inf")])
    def test_no_limit_or_a_bad_one_adds_nothing(self, timeout):
        assert collective_timeout_minutes(_args(env="m:f", env_timeout=timeout)) == 0.0

    def test_a_huge_limit_is_bounded(self):
        assert collective_timeout_minutes(_args(env="m:f", env_timeout=1e300)) == 30 * 24 * 60.0
        assert collective_timeout_minutes(_args(reward_url="http://127.0.0.1:1/x", reward_url_timeout=60.0,
                                                reward_url_retries=10**6)) == 30 * 24 * 60.0

    def test_setup_run_keeps_dist_timeout_for_start_up_and_gives_collectives_the_longer_wait(self, monkeypatch):
        asked = []

        def init_distributed(timeout_minutes, collective_minutes):
            asked.append((timeout_minutes, collective_minutes))
            raise RuntimeError("stop here")

        monkeypatch.setattr(run_setup, "init_distributed", init_distributed)
        with pytest.raises(RuntimeError, match="stop here"):
            run_setup.setup_run(_args(env="m:f", env_timeout=600.0))
        assert asked == [(5.0, 10.0 + USER_CALL_MARGIN_MINUTES)]

    def test_collectives_wait_at_least_the_longer_time(self):
        import datetime

        from dschat.runtime.dist import _collective_timeout

        rendezvous = datetime.timedelta(minutes=5)
        assert _collective_timeout(rendezvous, datetime.timedelta(minutes=15)) == datetime.timedelta(minutes=15)
        assert _collective_timeout(datetime.timedelta(minutes=60), datetime.timedelta(minutes=15)) == \
            datetime.timedelta(minutes=60)
