"""Step 3 with ``--env`` on two real ranks (gloo, CPU): every rank plays the same number of turns (with
dschat's loop, continuing its episodes' KV cache), and an environment that fails on one rank stops
both together.

Each rank is started as the DeepSpeed launcher starts it (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_SIZE``, ``MASTER_ADDR``, a free ``MASTER_PORT``), but on its own: the launcher kills the other
ranks as soon as one exits non-zero, so only separate processes show that each rank exits by itself,
and with which code. Both run step 3's ``main`` with turns that end with EOS after 5 or 6 tokens
(``test_step3_envs.EndTurnAfter``; a random tiny model rarely ends a turn by itself), or, for dschat's
loop, with EOS after a position 4 mod 5 (a forward hook; on dschat's Hybrid Engine, the same rule
around its decode model's prefill and step). A rank left
waiting in a collective fails the test by its timeout and is killed."""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO
from helpers.step3 import base_argv, subprocess_env
from helpers.steps import free_port

pytestmark = pytest.mark.slow

TIMEOUT = 300  # seconds for both ranks of one run; a hang fails the test here

SCRIPT = r'''
import json
import os
import sys
from pathlib import Path

import torch
from transformers import LogitsProcessorList

from dschat.errors import cli_main
from dschat.rlhf.rollout.generator import RolloutGenerator
from dschat.rlhf.scoring_passes import ScoringPasses
from helpers.decode_hooks import edit_decode_logits
from helpers.step3 import step3_main
from test_step3_envs import TURN, EndTurnAfter

folder, rank, argv = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
original = RolloutGenerator.__init__


def end_turns(eos):
    """A forward hook for decoding with a KV cache: the token after a position 4 mod 5 is EOS."""
    def hook(module, args, kwargs, out):
        if kwargs.get("past_key_values") is not None and kwargs.get("position_ids") is not None:
            logits = out.logits[:, -1]
            end = kwargs["position_ids"][:, -1] % 5 == 4
            logits[end] = -float("inf")  # sampled or greedy, the token is EOS
            logits[end, eos] = 0.0
        return out
    return hook


def engine_end_turns(eos):
    """The same rule on dschat's Hybrid Engine, which decodes with its own decode model."""
    def end(logits, position):
        end = position % 5 == 4
        logits[end] = -float("inf")
        logits[end, eos] = 0.0

    edit_decode_logits(end)


def init(self, *args, **kwargs):
    original(self, *args, **kwargs)
    if os.environ.get("END_TURNS") == "engine":  # dschat's Hybrid Engine decodes
        engine_end_turns(self.tokenizer.eos_token_id)
        return
    if os.environ.get("END_TURNS") == "hook":  # dschat's loop decodes (it takes no logits processor)
        self.actor.module.register_forward_hook(end_turns(self.tokenizer.eos_token_id), with_kwargs=True)
        return
    self.extra_generate_kwargs = {
        "logits_processor": LogitsProcessorList([EndTurnAfter(self.tokenizer.eos_token_id, TURN)])}


RolloutGenerator.__init__ = init
if os.environ.get("NO_LOGPROBS_ON_RANK") == rank:  # this rank's decoder keeps no log-probs (e.g. a fallback)
    decode = RolloutGenerator.rollout
    RolloutGenerator.rollout = lambda self, *a, **k: decode(self, *a, **k)._replace(logprobs=None)
actor_scorings = []  # the experience's actor scoring passes (no gradients): one per batch scored again
score = ScoringPasses.token_log_probs


def counted(self, name, *args, **kwargs):
    if name == "actor" and not torch.is_grad_enabled():
        actor_scorings.append(1)
    return score(self, name, *args, **kwargs)


ScoringPasses.token_log_probs = counted
reward_prompts = []  # --reward_url: the prompts of each request this rank sent
from dschat.remote_reward import RemoteReward
post = RemoteReward._post
RemoteReward._post = lambda self, payload: (reward_prompts.extend(payload["prompts"]), post(self, payload))[1]
runs = []
code = cli_main(lambda args: runs.append(step3_main().main(args)), argv)
if code == 0:
    records = {"history": runs[0].history, "evaluations": runs[0].evaluations, "actor_scorings": len(actor_scorings),
               "reward_prompts": reward_prompts}
    (folder / f"records{rank}.json").write_text(json.dumps(records, default=str))
sys.exit(code)
'''


def _two_ranks(folder: Path, argv: list[str], **environ: str) -> list[tuple[int, str, str]]:
    """Step 3's ``main`` with ``argv`` on ranks 0 and 1: each rank's (exit code, stdout, stderr). Fails
    the test when either has not exited within :data:`TIMEOUT` seconds (both are killed then)."""
    script = folder / "rank.py"
    script.write_text(SCRIPT)
    tests = REPO / "tests"
    path = os.pathsep.join([str(REPO), str(tests), str(tests / "fixtures"), str(tests / "rlhf")])
    port = str(free_port())
    procs, logs = [], []
    for rank in (0, 1):
        env = subprocess_env()
        env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_SIZE": "2",
                    "CROSS_RANK": "0", "CROSS_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                    "PYTHONPATH": os.pathsep.join(p for p in (path, env.get("PYTHONPATH")) if p),
                    "PYTHONUNBUFFERED": "1", **environ})
        out, err = folder / f"stdout{rank}", folder / f"stderr{rank}"
        logs.append((out, err))
        with out.open("w") as stdout, err.open("w") as stderr:
            procs.append(subprocess.Popen([sys.executable, str(script), str(folder), str(rank), *argv], cwd=folder,
                                          env=env, stdout=stdout, stderr=stderr, start_new_session=True))
    deadline = time.monotonic() + TIMEOUT
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        tails = [f"rank {r} (exit {p.returncode}):\n{logs[r][1].read_text()[-1500:]}" for r, p in enumerate(procs)]
        pytest.fail(f"the ranks did not finish within {TIMEOUT} s (a rank waiting in a collective):\n" + "\n".join(tails))
    return [(proc.returncode, out.read_text(), err.read_text()) for proc, (out, err) in zip(procs, logs)]


def _argv(data: Path, out: Path, *extra: str) -> list[str]:
    argv = base_argv("tiny-opt", Path("unused"), data, "--max_answer_seq_len", "40", "--algorithm", "rloo",
                     "--num_generations", "2", "--output_dir", str(out), *extra, steps=2)
    i = argv.index("--critic_model_name_or_path")
    del argv[i:i + 2]
    return argv


@pytest.mark.parametrize("zero", [
    ("--actor_zero_stage", "0"),
    ("--actor_zero_stage", "3"),
    ("--actor_zero_stage", "3", "--zero3_gather_for_generation", "off"),
], ids=["zero0", "zero3", "zero3-fetched"])
def test_ranks_whose_episodes_take_different_turns_finish_together(zero, tmp_path, data_cache):
    """Rank 0's episodes end after one turn, rank 1's after 2 or 3 (``env_fixtures:turns_by_rank``):
    rank 0 decodes placeholder rows until rank 1's episodes are done. Under ZeRO-0 and ZeRO-3 (whose
    rollouts gather the actor's partitions once, or fetch every layer for every token: collectives
    either way) both ranks finish, train and save, with the
    same records on both (means over both ranks' episodes) and finite losses; the held-out episodes
    (``--eval_interval``), dealt to both ranks, are played the same way."""
    out = tmp_path / "out"
    ranks = _two_ranks(tmp_path, _argv(data_cache, out, *zero, "--env", "env_fixtures:turns_by_rank",
                                       "--max_turns", "3", "--eval_interval", "2", "--eval_prompts", "8"))
    for rank, (code, stdout, stderr) in enumerate(ranks):
        assert code == 0, (rank, stdout[-2000:], stderr[-3000:])
    records = [json.loads((tmp_path / f"records{rank}.json").read_text()) for rank in (0, 1)]
    histories = [r["history"] for r in records]
    keys = ("reward", "turns", "observation_tokens", "cut_share", "actor_loss")
    assert [[r[k] for k in keys] for r in histories[0]] == [[r[k] for k in keys] for r in histories[1]]
    assert len(histories[0]) == 2, histories[0]
    for record in histories[0]:
        # The records are means over both ranks' episodes: rank 0's single turns (reward 1.0) and rank
        # 1's 2 or 3 turns (0.5 per turn before the last, 1.0 for it), none of them cut.
        turns = float(record["turns"])
        assert 1.5 <= turns <= 2.0 and float(record["cut_share"]) == 0.0, record
        assert math.isclose(float(record["reward"]), 0.5 + 0.5 * turns, rel_tol=1e-6), record
        assert float(record["observation_tokens"]) > 0 and math.isfinite(float(record["actor_loss"])), record
    # Held-out episodes: batch 0 (prompts 0-3) is played on rank 0, batch 1 on rank 1 (its own lengths).
    evaluations = [[(e["global_step"], e["per_prompt"]["proxy"]) for e in r["evaluations"]] for r in records]
    assert evaluations[0] == evaluations[1] and [step for step, _ in evaluations[0]] == [0, 2], evaluations
    for _, proxy in evaluations[0]:
        assert proxy[:4] == [1.0] * 4 and all(p in (1.5, 2.0) for p in proxy[4:]), proxy
    assert "Episodes: " in ranks[0][1]
    assert (out / "actor" / "config.json").exists()


@pytest.mark.parametrize("zero, loop", [
    (("--actor_zero_stage", "0"), "dschat"),
    (("--actor_zero_stage", "3"), "dschat"),
    (("--actor_zero_stage", "3", "--enable_hybrid_engine"), "dschat-he"),
], ids=["zero0", "zero3", "zero3-dschat-he"])
def test_ranks_continue_their_kv_caches_and_finish_together(zero, loop, tmp_path, data_cache):
    """With dschat's loop decoding (turns ended by a forward hook, not a logits processor), or dschat's
    Hybrid Engine (the same rule on its decode model), each rank keeps its episodes' KV cache between
    turns (under ZeRO-3 the actor is gathered again for every turn); rank 0, whose episodes end after
    one turn, decodes its ended rows as placeholders until rank 1's are done, and both finish with the
    same records."""
    out = tmp_path / "out"
    ranks = _two_ranks(tmp_path, _argv(data_cache, out, *zero, "--env", "env_fixtures:turns_by_rank",
                                       "--max_turns", "3"), END_TURNS="engine" if loop == "dschat-he" else "hook")
    for rank, (code, stdout, stderr) in enumerate(ranks):
        assert code == 0, (rank, stdout[-2000:], stderr[-3000:])
    assert f"Multi-turn episodes: the conversation's KV cache is kept between turns ({loop} loop)" in ranks[0][1]
    histories = [json.loads((tmp_path / f"records{rank}.json").read_text())["history"] for rank in (0, 1)]
    keys = ("reward", "turns", "observation_tokens", "cut_share", "actor_loss")
    assert [[r[k] for k in keys] for r in histories[0]] == [[r[k] for k in keys] for r in histories[1]]
    assert len(histories[0]) == 2, histories[0]
    for record in histories[0]:
        turns = float(record["turns"])
        assert 1.5 <= turns <= 2.0 and float(record["cut_share"]) == 0.0, record
        assert math.isclose(float(record["reward"]), 0.5 + 0.5 * turns, rel_tol=1e-6), record


def test_ranks_agree_to_score_the_actor_again_when_one_rank_has_no_log_probs(tmp_path, data_cache):
    """Rank 1's decoder keeps no log-probs (as after a fallback on that rank alone), rank 0's does
    (dschat's loop): the actor must score the episodes again on both ranks, since that pass is
    collective under ZeRO-3. Both ranks score every batch (one per PPO step), finish and agree."""
    out = tmp_path / "out"
    argv = _argv(data_cache, out, "--actor_zero_stage", "3", "--env", "env_fixtures:turns_by_rank", "--max_turns", "3")
    ranks = _two_ranks(tmp_path, argv, END_TURNS="hook", NO_LOGPROBS_ON_RANK="1")
    for rank, (code, stdout, stderr) in enumerate(ranks):
        assert code == 0, (rank, stdout[-2000:], stderr[-3000:])
    records = [json.loads((tmp_path / f"records{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["actor_scorings"] for r in records] == [2, 2], [r["actor_scorings"] for r in records]
    keys = ("reward", "turns", "actor_loss")
    histories = [[[h[k] for k in keys] for h in r["history"]] for r in records]
    assert histories[0] == histories[1] and len(histories[0]) == 2, histories


def test_an_environment_failing_on_one_rank_stops_both(tmp_path, data_cache):
    """Rank 1's environment raises on turn 2 (``env_fixtures:fails_on_rank_one``), while rank 0, its
    episodes done after one turn, decodes a placeholder row: both ranks exit with code 2 and no traceback; rank 1 prints the one line naming the environment, the row and the turn,
    rank 0 one line saying an environment failed on another rank; nothing is saved."""
    out = tmp_path / "out"
    ranks = _two_ranks(tmp_path, _argv(data_cache, out, "--actor_zero_stage", "3", "--env",
                                       "env_fixtures:fails_on_rank_one", "--max_turns", "3"))
    lines = []
    for rank, (code, stdout, stderr) in enumerate(ranks):
        assert code == 2 and "Traceback" not in stderr, (rank, code, stderr[-3000:])
        errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, (rank, stderr[-3000:])
        lines.append(errors[0])
    assert lines[0] == "error: an environment failed on another rank (its line is in that rank's log)", lines
    assert re.fullmatch(r"error: environment env_fixtures:fails_on_rank_one: step raised RuntimeError: the tool broke "
                        r"on rank 1 on row \d+ \(prompt ' Human: .*', turn 2\); fix the environment", lines[1]), lines
    assert not (out / "actor").exists()
