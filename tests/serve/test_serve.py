"""``python -m dschat.serve`` on a tiny step-2 reward model: a real server in a subprocess on a free
port, asked over HTTP. Its rewards are the reward model's own scores of the same texts (a step-2 LoRA
output's ``lora_adapter/`` folder too); bad requests (a query of no tokens, or one the tokenizer cannot
encode, too) get a 4xx JSON answer and the server goes on; SIGTERM or Ctrl-C stops it within its bounded
graceful shutdown while a client holds a half-sent request; a busy port, a folder that is no model and
a ``--max_seq_len`` past the position table are one line, exit 2. An actor served:
tests/serve/test_serve_actor.py."""
from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import threading
import time

import pytest
import requests
import torch
from dschat.errors import EXIT_USAGE, UserError
from dschat.models.tokenizer import load_hf_tokenizer
from dschat.remote_reward import API_KEY_ENV, RemoteReward
from dschat.serve.app import build_app
from dschat.serve.cli import GRACEFUL_SHUTDOWN_SECONDS
from dschat.serve.cli import main as serve_main
from dschat.serve.reward_scorer import load_reward_scorer

from helpers.serve import own_scores, served_reward_model, serving_in_process
from helpers.step3 import make_critic_folder, make_lora_inputs

TEXTS = ["Human: What is 2 + 2? Assistant: 4", "Human: hi Assistant: hello there, how are you today?",
         "Human: Name a colour. Assistant: blue", "Human: x Assistant:"]


@pytest.fixture(scope="module")
def reward_folder(tmp_path_factory):
    return make_critic_folder("tiny-opt", tmp_path_factory.mktemp("serve") / "rm", seed=3)


@pytest.fixture(scope="module")
def server(reward_folder):
    with served_reward_model(reward_folder, "--batch_size", "3", "--device", "cpu") as served:
        yield served


def test_get_reward_gives_the_reward_models_own_scores_in_order(server, reward_folder):
    reply = requests.post(server.reward_url, json={"query": TEXTS, "prompts": ["p"] * 4, "labels": [""] * 4},
                          timeout=60)
    assert reply.status_code == 200
    rewards = reply.json()["rewards"]
    assert rewards == pytest.approx(own_scores(reward_folder, TEXTS), abs=1e-5)
    assert len(set(rewards)) == len(TEXTS)  # distinct texts, distinct scores: order is checked
    # step 3's client reads the same; prompts and labels are optional
    assert RemoteReward(server.reward_url)(["", ""], TEXTS[:2]) == pytest.approx(rewards[:2], abs=1e-6)
    assert requests.post(server.reward_url, json={"query": TEXTS[:1]}, timeout=60).json()["rewards"] == \
        pytest.approx(rewards[:1], abs=1e-6)


def test_health(server, reward_folder):
    reply = requests.get(server.url + "/health", timeout=10)
    assert reply.status_code == 200
    assert reply.json() == {"status": "ok", "model": str(reward_folder), "kind": "reward"}
    assert f"note: no {API_KEY_ENV} set: every account on this machine can use the model through the port" in \
        server.output


def test_an_api_key_guards_every_route_but_health(reward_folder, monkeypatch):
    """``DSCHAT_SERVE_API_KEY``: 401 without ``Authorization: Bearer <key>`` or with another key (and no
    scoring); /health stays open; step 3's client sends the key from the same variable."""
    with served_reward_model(reward_folder, "--device", "cpu", api_key="k3y") as served:
        for headers in ({}, {"Authorization": "Bearer other"}):
            reply = requests.post(served.reward_url, json={"query": TEXTS[:1]}, headers=headers, timeout=60)
            assert reply.status_code == 401 and API_KEY_ENV in reply.json()["detail"]
        assert requests.get(served.url + "/health", timeout=10).json()["kind"] == "reward"
        with pytest.raises(UserError, match=f"answered HTTP 401 .* set {API_KEY_ENV}"):
            RemoteReward(served.reward_url)(["", ""], TEXTS[:2])
        monkeypatch.setenv(API_KEY_ENV, "k3y")
        assert RemoteReward(served.reward_url)(["", ""], TEXTS[:2]) == pytest.approx(
            own_scores(reward_folder, TEXTS[:2]), abs=1e-5)
        assert not any(API_KEY_ENV in line for line in served.output)


@pytest.mark.parametrize("method, route, body, code", [
    ("post", "/get_reward", b"{not json", 422),
    ("post", "/get_reward", b'{"query": [1, 2]}', 422),
    ("post", "/get_reward", b'{"query": "one text"}', 422),
    ("post", "/get_reward", b'{"query": []}', 422),
    ("post", "/get_reward", b'{"prompts": ["a"]}', 422),
    ("post", "/get_reward", b'{"query": ["a"], "labels": [3]}', 422),
    ("post", "/v1/completions", b'{"prompt": "a"}', 404),
    ("get", "/get_reward", None, 405),
])
def test_a_bad_request_gets_a_4xx_json_answer_and_the_server_goes_on(server, method, route, body, code):
    reply = getattr(requests, method)(server.url + route, data=body, timeout=30,
                                      headers={"Content-Type": "application/json"})
    assert reply.status_code == code
    assert "detail" in reply.json()
    ok = requests.post(server.reward_url, json={"query": TEXTS[:2]}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["rewards"]) == 2
    assert server.proc.poll() is None


def test_a_request_whose_client_left_before_its_turn_is_not_scored(reward_folder, monkeypatch):
    """Requests are scored one at a time; one whose client closed while another was being scored
    is skipped at its turn (a client that timed out and retried does not lengthen the queue)."""
    scorer = load_reward_scorer(reward_folder, device="cpu", batch_size=4)
    scored: list[list[str]] = []
    hold = threading.Event()
    score = scorer.score

    def held_first(texts):
        scored.append(list(texts))
        if len(scored) == 1:
            hold.wait(30)  # the first request keeps the turn until the test lets it go
        return score(texts)

    monkeypatch.setattr(scorer, "score", held_first)
    replies: list[requests.Response] = []
    with serving_in_process(build_app(scorer)) as url:
        first = threading.Thread(target=lambda: replies.append(
            requests.post(url + "/get_reward", json={"query": TEXTS[:1]}, timeout=60)))
        first.start()
        deadline = time.monotonic() + 30
        while not scored:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        body = json.dumps({"query": TEXTS[1:2]}).encode()
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30) as gone:
            gone.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            time.sleep(1.0)  # it reaches the route and waits for its turn
        hold.set()
        first.join(60)
        later = requests.post(url + "/get_reward", json={"query": TEXTS[2:3]}, timeout=60)
    assert replies[0].status_code == 200 and later.status_code == 200
    assert scored == [TEXTS[:1], TEXTS[2:3]]  # the gone client's text was never scored


def test_a_step2_lora_adapter_folder_is_served_as_the_reward_model(tmp_path):
    """A step-2 LoRA output's ``lora_adapter/`` (adapter + value head, no config.json) is the reward
    model of its parent folder: base built, adapter merged, value head loaded."""
    critic = make_lora_inputs("tiny-opt", tmp_path, seed=5)["critic"]
    assert not (critic / "lora_adapter" / "config.json").exists()
    with served_reward_model(critic / "lora_adapter", "--device", "cpu") as served:
        assert requests.get(served.url + "/health", timeout=10).json()["kind"] == "reward"
        reply = requests.post(served.reward_url, json={"query": TEXTS}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["rewards"] == pytest.approx(own_scores(critic, TEXTS), abs=1e-4)


@pytest.fixture(scope="module")
def no_bos_reward_folder(reward_folder, tmp_path_factory):
    """The reward model with a tokenizer that adds no BOS: ``""`` is no tokens."""
    folder = tmp_path_factory.mktemp("serve_no_bos") / "rm"
    shutil.copytree(reward_folder, folder)
    tokenizer_file = folder / "tokenizer.json"
    spec = json.loads(tokenizer_file.read_text())
    spec["post_processor"] = None
    tokenizer_file.write_text(json.dumps(spec))
    return folder


def test_a_query_of_no_tokens_is_a_422_naming_its_index(no_bos_reward_folder):
    scorer = load_reward_scorer(no_bos_reward_folder, device="cpu", batch_size=4)
    assert scorer.tokenizer("")["input_ids"] == [] and scorer.tokenizer("a")["input_ids"]
    with serving_in_process(build_app(scorer)) as url:
        for query, index in (([""], 0), ([TEXTS[0], "", TEXTS[1]], 1)):
            reply = requests.post(url + "/get_reward", json={"query": query}, timeout=60)
            assert reply.status_code == 422, reply.text
            assert reply.json()["detail"].startswith(f"query[{index}] has no tokens")
        ok = requests.post(url + "/get_reward", json={"query": TEXTS[:2]}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["rewards"]) == 2


def test_a_query_the_model_scores_nan_is_a_500_naming_it_and_step3s_client_says_so(reward_folder, tmp_path, capsys):
    """A reward model whose value head went NaN: a 500 naming the query and the model, said on the
    server too, not ``{"rewards": [null]}`` (a float was promised); step 3's client quotes that line."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "rm_nan"
    shutil.copytree(reward_folder, folder)
    head = folder / "v_head.safetensors"
    save_file({name: torch.full_like(value, float("nan")) for name, value in load_file(head).items()}, head)
    scorer = load_reward_scorer(folder, device="cpu", batch_size=4)
    with serving_in_process(build_app(scorer)) as url:
        reply = requests.post(url + "/get_reward", json={"query": TEXTS[:2]}, timeout=60)
        with pytest.raises(UserError) as refused:
            RemoteReward(url + "/get_reward", retries=0)(["", ""], TEXTS[:2])
    assert reply.status_code == 500, reply.text
    detail = reply.json()["detail"]
    assert detail.startswith("the reward model scored query[0] as nan") and "\n" not in detail
    assert "the reward model scored query[0] as nan" in str(refused.value)
    assert "[serve] the reward model scored query[0] as nan" in capsys.readouterr().err


def test_a_text_longer_than_max_seq_len_is_cut(reward_folder):
    long_text = TEXTS[1] * 8
    with served_reward_model(reward_folder, "--max_seq_len", "12", "--device", "cpu") as served:
        rewards = requests.post(served.reward_url, json={"query": [long_text, TEXTS[0]]}, timeout=60).json()["rewards"]
    assert rewards == pytest.approx(own_scores(reward_folder, [long_text, TEXTS[0]], max_len=12), abs=1e-5)


def test_a_query_the_tokenizer_cannot_encode_is_a_422_naming_it(server):
    """A lone surrogate (JSON's ``"\\ud800"`` without its pair: no Unicode text) is a 422 naming the query
    in one line, none of the request's queries scored, no traceback in the log; a pair is text."""
    for body, index, where in ((b'{"query": ["\\ud800"]}', 0, "U+D800 at character 0"),
                               (b'{"query": ["fine", "a\\udc00b"]}', 1, "U+DC00 at character 1")):
        reply = requests.post(server.reward_url, data=body, headers={"Content-Type": "application/json"}, timeout=60)
        assert reply.status_code == 422, reply.text
        detail = reply.json()["detail"]
        assert detail.startswith(f"query[{index}] holds a lone surrogate, {where}") and "\n" not in detail
    pair = requests.post(server.reward_url, data=b'{"query": ["\\ud83d\\ude00 ok"]}',
                         headers={"Content-Type": "application/json"}, timeout=60)
    assert pair.status_code == 200 and len(pair.json()["rewards"]) == 1
    assert server.proc.poll() is None and not any("Traceback" in line for line in server.output)


def test_a_text_longer_than_the_position_table_keeps_its_last_positions(server, reward_folder):
    """The default ``--max_seq_len`` is the model's 512 positions: a longer text is cut to them, not a 500."""
    long_text = TEXTS[1] * 60
    assert len(load_hf_tokenizer(str(reward_folder))(long_text)["input_ids"]) > 512
    reply = requests.post(server.reward_url, json={"query": [long_text]}, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["rewards"] == pytest.approx(own_scores(reward_folder, [long_text], max_len=512), abs=1e-5)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_half_sent_request_does_not_keep_the_server_from_stopping(reward_folder, stop):
    """SIGTERM (or Ctrl-C) while a client holds a request whose body never comes: the server cancels it
    after its bounded graceful shutdown and exits, instead of waiting for that client forever."""
    with served_reward_model(reward_folder, "--device", "cpu") as served:
        port = int(served.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as held:
            held.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{")  # 1 byte of the 100 promised, never the rest
            time.sleep(1.0)  # the request reaches the app, which waits for the rest of its body
            served.proc.send_signal(stop)
            started = time.monotonic()
            try:
                served.proc.wait(timeout=GRACEFUL_SHUTDOWN_SECONDS + 30)
            except subprocess.TimeoutExpired:
                pytest.fail("the server did not stop while a client held a half-sent request:\n"
                            + "\n".join(served.output[-10:]))
            took = time.monotonic() - started
    assert took >= GRACEFUL_SHUTDOWN_SECONDS - 1  # it gave the open request its grace period first


def test_a_max_seq_len_past_the_position_table_is_one_line_before_the_port_is_bound(reward_folder, capsys):
    """tiny-opt's positions are a 512-row table: ``--max_seq_len`` 513 is refused from the config, before
    the port is bound (a busy port would otherwise be the line) and any weight loads; 512 fits."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        line = _refused([str(reward_folder), "--max_seq_len", "4096", "--port", port, "--device", "cpu"], capsys)
        assert line == (f"error: --max_seq_len 4096 is longer than {reward_folder} can read: its opt position "
                        "embeddings have 512 positions, and a longer row would index past them; pass "
                        "--max_seq_len 512 or less")
        assert "is in use" in _refused([str(reward_folder), "--max_seq_len", "512", "--port", port], capsys)
    with pytest.raises(UserError, match="max_len 513 is longer than .* 512 positions"):
        load_reward_scorer(reward_folder, device="cpu", max_len=513)


@pytest.fixture(autouse=True)
def no_api_key(monkeypatch):
    """The in-process refusals read the environment: no API key unless a test sets one."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)


def _refused(argv, capsys):
    capsys.readouterr()
    code = serve_main(argv)
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error: ")]
    assert code == EXIT_USAGE and len(lines) == 1 and "Traceback" not in err, err
    warned = [x for x in err.splitlines() if x.startswith("warning: --host")]
    assert len(warned) == (0 if "0.0.0.0" not in argv else 1), err  # only another host than loopback warns
    if warned:
        assert "without TLS and without an API key (DSCHAT_SERVE_API_KEY)" in warned[0]
    return lines[0]


def test_a_busy_port_is_one_line_naming_the_port(reward_folder, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _refused([str(reward_folder), "--port", str(port)], capsys)
    assert f"--port {port} on 127.0.0.1 is in use" in line


@pytest.mark.parametrize("key", ["k3y\n", "k3y\r", " k3y", "k\x07y", "k\u00e9y"])
def test_an_api_key_no_client_could_send_is_one_line_before_the_port_is_bound(key, reward_folder, monkeypatch,
                                                                              capsys):
    monkeypatch.setenv(API_KEY_ENV, key)
    with socket.socket() as taken:  # were the key taken, the busy port would be the line
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        line = _refused([str(reward_folder), "--port", str(taken.getsockname()[1])], capsys)
    assert line.startswith(f"error: {API_KEY_ENV} holds whitespace") and key.strip() not in line[len("error: "):]


def test_another_host_than_loopback_warns(reward_folder, capsys):
    with socket.socket() as taken:  # bound, never listening: the port is taken, nothing is served
        taken.bind(("0.0.0.0", 0))
        port = taken.getsockname()[1]
        line = _refused([str(reward_folder), "--host", "0.0.0.0", "--port", str(port)], capsys)
    assert f"--port {port} on 0.0.0.0 is in use" in line


@pytest.mark.parametrize("device, message", [
    ("gpu", "--device 'gpu' is not a torch device; give cpu, cuda, cuda:N or auto"),
    ("meta", "--device 'meta': dschat runs models on cpu or cuda"),
    ("cuda:99", "this machine has no CUDA device" if not torch.cuda.is_available() else "CUDA device(s), cuda:0 to"),
])
def test_a_device_this_machine_lacks_is_one_line(reward_folder, capsys, device, message):
    assert message in _refused([str(reward_folder), "--device", device, "--port", "0"], capsys)


@pytest.mark.parametrize("wait", ["inf", "nan", "1e13", "-1", "60001"])
def test_a_max_wait_past_a_minute_or_not_a_number_is_one_line(reward_folder, capsys, wait):
    """inf started the server, then stopped its decoding thread at the first request (threading's wait
    takes no more than TIMEOUT_MAX): every request hung while /health said ok."""
    assert _refused([str(reward_folder), "--max_wait_ms", wait, "--port", "0"], capsys) == (
        f"error: --max_wait_ms must be a number from 0 to 60000 (a minute), got {float(wait)}")


def test_a_folder_that_is_no_model_is_one_line(tmp_path, capsys):
    assert "is not a model folder" in _refused([str(tmp_path), "--port", "0"], capsys)
