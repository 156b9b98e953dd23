"""Step 3 scored by a reward server (``--reward_url``) that is ``python -m dschat.serve`` on a tiny
reward model, started here on a free port: the run trains on exactly the server's rewards, which
are the reward model's own scores of the texts sent; a server that dies mid-run stops the run after
its retries with one line (exit 2), the checkpoint written before it intact, and a resumed run goes on
from it."""
from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest

from dschat.errors import EXIT_USAGE, cli_main
from dschat.remote_reward import RemoteReward
from dschat.training import checkpoint as ckpt

from helpers.serve import own_scores, served_reward_model
from helpers.step3 import base_argv, make_critic_folder, refused_in_process, step3_main

pytestmark = pytest.mark.usefixtures("one_thread")  # every test: tiny models on one thread


@pytest.fixture(scope="module")
def reward_folder(tmp_path_factory):
    return make_critic_folder("tiny-opt", tmp_path_factory.mktemp("remote_rm") / "rm", seed=5)


def _argv(data, url, *extra, steps=2):
    argv = base_argv("tiny-opt", Path("unused"), data, "--algorithm", "rloo", "--num_generations", "2",
                     "--reward_url", url, *extra, steps=steps)
    i = argv.index("--critic_model_name_or_path")
    del argv[i:i + 2]  # critic-free, and no reward model in-process: the server scores
    return argv


def _record(monkeypatch):
    """Every request the run's client sends, with the rewards it got back."""
    seen = []
    post = RemoteReward._post

    def recording(self, payload):
        rewards = post(self, payload)
        seen.append((payload, rewards))
        return rewards

    monkeypatch.setattr(RemoteReward, "_post", recording)
    return seen


@pytest.mark.slow
def test_a_run_trains_on_the_servers_rewards_which_are_the_reward_models_scores(reward_folder, data_cache,
                                                                                  monkeypatch, capsys):
    seen = _record(monkeypatch)
    with served_reward_model(reward_folder, "--device", "cpu") as server:
        result = step3_main().main(_argv(data_cache, server.reward_url))
    printed = capsys.readouterr().out
    assert "reward = 1 x " + server.reward_url in printed
    assert "warning: --reward_url" not in printed  # loopback: no warning
    assert len(result.history) == 2 and len(seen) == 2  # one request per rollout (4 answers)
    for record, (payload, rewards) in zip(result.history, seen):
        assert len(payload["query"]) == 4 and payload["labels"] == [""] * 4  # the embedded data has no answer column
        assert [q.startswith(p) for q, p in zip(payload["query"], payload["prompts"])] == [True] * 4
        assert math.isfinite(record["reward"])
        assert record["reward"] == pytest.approx(sum(rewards) / 4, abs=1e-5)  # the run's reward is the server's
        assert rewards == pytest.approx(own_scores(reward_folder, payload["query"]), abs=1e-5)
    assert all(math.isfinite(v) for r in result.history for k, v in r.items()
               if k in ("actor_loss", "kl_to_ref") and isinstance(v, float))


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_server_killed_mid_run_stops_it_after_the_retries_the_checkpoint_intact(reward_folder, data_cache,
                                                                                   monkeypatch, tmp_path, capsys):
    out = tmp_path / "out"
    saved: dict[str, dict[str, str]] = {}
    with served_reward_model(reward_folder, "--device", "cpu") as server:
        original = ckpt.Checkpointer.save  # every checkpoint step 3 writes

        def save_then_kill(self, position):  # the server dies right after the first checkpoint
            path = original(self, position)
            if path is not None and not saved:
                server.proc.kill()
                server.proc.wait()
                saved[str(path)] = _digest(path)
            return path

        monkeypatch.setattr(ckpt.Checkpointer, "save", save_then_kill)
        line = refused_in_process(_argv(data_cache, server.reward_url, "--output_dir", str(out), "--save_interval",
                                        "1", "--reward_url_retries", "2", "--reward_url_timeout", "5", steps=3), capsys)
    assert line.startswith(f"error: --reward_url {server.reward_url} failed 3 times (--reward_url_retries 2); "
                           "last error: ConnectionError")
    [(path, digest)] = saved.items()
    assert [str(p) for p in ckpt.complete_checkpoints(out / "checkpoints")] == [path]  # no later one
    assert _digest(Path(path)) == digest  # untouched
    assert not (out / "actor").exists()  # no model saved after the failure

    monkeypatch.undo()  # the server is back (on another port): --resume goes on from that checkpoint
    with served_reward_model(reward_folder, "--device", "cpu") as server:
        resumed = step3_main().main(_argv(data_cache, server.reward_url, "--output_dir", str(out), "--save_interval",
                                          "1", "--resume", steps=3))
    assert len(resumed.history) == 2 and (out / "actor").is_dir()


@pytest.mark.slow
def test_plain_http_to_another_host_warns_once_at_start_up(data_cache, capsys):
    """192.0.2.1 is TEST-NET-1 (RFC 5737), reserved for documentation: no server answers there, so
    the run stops at its first rollout, after the warning."""
    url = "http://192.0.2.1:9/get_reward"
    capsys.readouterr()
    code = cli_main(step3_main().main,
                    _argv(data_cache, url, "--reward_url_retries", "0", "--reward_url_timeout", "0.5"))
    out, err = capsys.readouterr()
    warned = [x for x in out.splitlines() if x.startswith("warning: --reward_url")]
    assert warned == [f"warning: --reward_url {url} is plain http:// to a host that is not this machine: the prompts "
                      "and answers cross the network unencrypted; use https:// or a loopback address"]
    errors = [x for x in err.splitlines() if x.startswith("error: ")]
    assert code == EXIT_USAGE and len(errors) == 1 and "Traceback" not in err, err[-2000:]
    assert errors[0].startswith(f"error: --reward_url {url} failed once (--reward_url_retries 0); last error: ")


@pytest.mark.slow
def test_two_ranks_each_score_their_own_answers_on_the_server(reward_folder, data_cache, tmp_path):
    """Step 3 on two real ranks (gloo) against one reward server: each rank sends its own prompts'
    answers (the two ranks' requests differ) and both finish with the same records (the rollout
    means are over both ranks' server rewards)."""
    import json

    from test_step3_envs_ranks import _two_ranks

    out = tmp_path / "out"
    with served_reward_model(reward_folder, "--device", "cpu") as server:
        ranks = _two_ranks(tmp_path, _argv(data_cache, server.reward_url, "--output_dir", str(out)))
    for rank, (code, stdout, stderr) in enumerate(ranks):
        assert code == 0, (rank, stdout[-2000:], stderr[-3000:])
    records = [json.loads((tmp_path / f"records{rank}.json").read_text()) for rank in (0, 1)]
    histories = [r["history"] for r in records]
    # Each rank sent its own prompts (its shard of the data): one request a rollout, 4 answers each.
    sent = [r["reward_prompts"] for r in records]
    assert [len(s) for s in sent] == [8, 8] and sent[0] != sent[1]
    keys = ("reward", "actor_loss", "kl_to_ref", "kept")
    assert [[r[k] for k in keys] for r in histories[0]] == [[r[k] for k in keys] for r in histories[1]]
    assert len(histories[0]) == 2 and all(r["kept"] + r["dropped"] == 8 for r in histories[0])  # 4 answers a rank
    assert all(math.isfinite(r["reward"]) for r in histories[0])
    assert (out / "actor" / "config.json").exists()
