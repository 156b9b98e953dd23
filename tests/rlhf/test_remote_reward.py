"""The ``--reward_url`` client (dschat/remote_reward.py) against a real HTTP server started here
(``http.server`` on a free port, in a thread): the protocol, batching and order, retries, timeouts
(an attempt's limit in all, against a reply trickled byte by byte, and a limit passing as a whole
reply ends), replies of the wrong shape or size, the start-up warning and the step-3 flags; the API
key it sends, a loopback server of another account refused, the URL shown without its password."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

import pytest

from dschat import remote_reward
from dschat.errors import UserError, shown_url
from dschat.remote_reward import (API_KEY_ENV, RemoteReward, check_reward_url, plain_http_warning,
                                  remote_reward_function, worst_case_seconds)
from dschat.runtime.trust import listener_owners
from dschat.rewards import RewardMix

from helpers.step3 import step3_main

# What the server does with one request: a JSON-able reply body (HTTP 200), or a callable that
# handles the request itself (handler, payload) for errors, delays and dropped connections.
Behaviour = Any


class RewardServer:
    """A reward server on 127.0.0.1 (port 0: the OS picks a free one). ``script`` gives, request by
    request, what to do (see ``Behaviour``); past its end each query gets ``len(query)`` as reward.
    ``requests`` records each request's JSON body and ``connections`` the client ports seen."""

    def __init__(self, script: list[Behaviour] | None = None) -> None:
        self.script = list(script or [])
        self.requests: list[dict] = []
        self.authorization: list[str | None] = []  # each request's Authorization header
        self.connections: set[int] = set()
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with owner.lock:
                    owner.requests.append(payload)
                    owner.authorization.append(self.headers.get("Authorization"))
                    owner.connections.add(self.client_address[1])
                    action = owner.script.pop(0) if owner.script else None
                if callable(action):
                    action(self, payload)
                    return
                lengths = {"rewards": [float(len(q)) for q in payload["query"]]}
                self.reply(200, action if action is not None else lengths)

            def reply(self, status: int, body: Any, raw: bytes | None = None) -> None:
                data = raw if raw is not None else json.dumps(body).encode()
                # A client that stopped its call at another request's failure may have gone away.
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/get_reward"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "RewardServer":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


def status(code: int) -> Callable:
    return lambda handler, payload: handler.reply(code, {"detail": "busy"})


def raw(data: bytes) -> Callable:
    return lambda handler, payload: handler.reply(200, None, raw=data)


def drop(handler: Any, payload: Any) -> None:
    handler.close_connection = True  # no reply at all: the client sees the connection close


def redirect(path: str, code: int = 307) -> Callable:
    def act(handler: Any, payload: Any) -> None:
        handler.send_response(code)
        handler.send_header("Location", path)
        handler.send_header("Content-Length", "0")
        handler.end_headers()
    return act


def slow(seconds: float) -> Callable:
    def act(handler: Any, payload: Any) -> None:
        time.sleep(seconds)
        handler.reply(200, {"rewards": [0.0] * len(payload["query"])})
    return act


PROMPTS = ["Human: a", "Human: bb", "Human: ccc", "Human: dddd", "Human: eeeee"]
ANSWERS = [" x", " yy", " zzz", " w", " vv"]


def _client(url: str, **kw: Any) -> RemoteReward:
    kw.setdefault("backoff", 0.01)
    return RemoteReward(url, **kw)


# ------------------------------------------------------------------------------------ protocol
def test_one_request_carries_query_prompts_and_labels_and_rewards_come_back_in_order():
    with RewardServer() as server:
        scores = _client(server.url)(PROMPTS, ANSWERS, answer=["1", "2", "3", "4", 5])
    assert scores == [float(len(p + a)) for p, a in zip(PROMPTS, ANSWERS)]
    assert server.requests == [{"query": [p + a for p, a in zip(PROMPTS, ANSWERS)], "prompts": PROMPTS,
                                "labels": ["1", "2", "3", "4", "5"]}]


def test_without_an_answer_column_the_labels_are_empty_strings():
    with RewardServer() as server:
        _client(server.url)(PROMPTS[:2], ANSWERS[:2], chosen=["c1", "c2"])
    assert server.requests[0]["labels"] == ["", ""]


def test_chunks_are_sent_concurrently_on_kept_alive_connections_and_joined_in_order():
    barrier = threading.Barrier(3, timeout=5)  # three chunks: each waits until all three are in flight

    def together(handler, payload):
        barrier.wait()
        handler.reply(200, {"rewards": [float(len(q)) for q in payload["query"]]})

    with RewardServer([together] * 3) as server:
        client = _client(server.url, chunk_size=2)
        assert client(PROMPTS, ANSWERS) == [float(len(p + a)) for p, a in zip(PROMPTS, ANSWERS)]
        assert sorted(len(r["query"]) for r in server.requests) == [1, 2, 2]
        seen = set(server.connections)
        client(PROMPTS[:2], ANSWERS[:2])  # the next call reuses a connection of the pool
        assert server.connections == seen


def test_a_failing_request_is_retried_with_backoff_then_succeeds():
    with RewardServer([status(503), drop, status(429)]) as server:
        start = time.monotonic()
        scores = _client(server.url, retries=3, backoff=0.1)(PROMPTS[:2], ANSWERS[:2])
        waited = time.monotonic() - start
    assert scores == [float(len(PROMPTS[i] + ANSWERS[i])) for i in range(2)]
    assert len(server.requests) == 4
    assert waited >= 0.1 + 0.2 + 0.4  # exponential: 0.1, 0.2, 0.4 s before retries 1-3


def test_spent_retries_stop_with_one_line_naming_the_url_and_the_last_error():
    with RewardServer([status(500)] * 3) as server:
        with pytest.raises(UserError) as err:
            _client(server.url, retries=2)(PROMPTS, ANSWERS)
    assert len(server.requests) == 3
    line = str(err.value)
    assert "\n" not in line and server.url in line and "failed 3 times" in line and "HTTP 500" in line


def test_an_unreachable_server_names_the_connection_error():
    with RewardServer() as server:
        url = server.url
    with pytest.raises(UserError, match=rf"--reward_url {url} failed 2 times .*last error: ConnectionError"):
        _client(url, retries=1)(PROMPTS, ANSWERS)


def test_a_request_past_its_timeout_is_retried_then_named():
    with RewardServer([slow(4.0), slow(4.0)]) as server:
        start = time.monotonic()
        with pytest.raises(UserError, match=r"failed 2 times .*no reply within --reward_url_timeout 0.3 s"):
            _client(server.url, timeout=0.3, retries=1)(PROMPTS[:1], ANSWERS[:1])
        assert time.monotonic() - start < 3.5  # less than one slow reply takes


@pytest.mark.parametrize("reply, what", [
    (raw(b"<html>oops</html>"), "with something that is not JSON"),
    (raw(b"[" * 100_000 + b"]" * 100_000), "with something that is not JSON"),  # nested past the parser's depth
    ({"scores": [1.0]}, 'JSON without a "rewards" key'),
    ({"rewards": "1.0"}, '"rewards" of type str, not a list'),
    ({"rewards": [1.0, 2.0, 3.0]}, "3 rewards for 2 queries"),
    (raw(b'{"rewards": [1.0, NaN]}'), "reward nan for query 1, not a finite number"),
    ({"rewards": [1.0, 1e39]}, "reward 1e+39 for query 1, not a finite number (in float32)"),
    ({"rewards": [1.0, "2"]}, "reward '2' for query 1"),
    ({"rewards": [True, 2]}, "reward True for query 0"),
    (raw(b'{"rewards": [1, 1' + b"0" * 400 + b']}'), "reward 1000000000"),
])
def test_a_reply_of_the_wrong_shape_is_one_line_naming_the_url_and_the_problem(reply, what):
    with RewardServer([reply]) as server:
        with pytest.raises(UserError) as err:
            _client(server.url)(PROMPTS[:2], ANSWERS[:2])
    assert len(server.requests) == 1  # not retried
    line = str(err.value)
    assert line.startswith(f"--reward_url {server.url} replied ") and what in line and "\n" not in line


def test_a_client_error_status_is_not_retried():
    with RewardServer([status(404)]) as server:
        with pytest.raises(UserError, match=r"answered HTTP 404"):
            _client(server.url)(PROMPTS[:2], ANSWERS[:2])
    assert len(server.requests) == 1


def test_in_the_reward_mix_it_is_one_weighted_term():
    with RewardServer() as server:
        term = remote_reward_function(server.url, weight=0.5, timeout=5, retries=0)
        mix = RewardMix((term,), model_weight=0.0)
        scores = mix.score(PROMPTS[:2], ANSWERS[:2], {"answer": ["1", "2"]})
    assert scores.tolist() == [0.5 * len(PROMPTS[i] + ANSWERS[i]) for i in range(2)]
    assert mix.describe() == f"reward = 0.5 x {server.url}"


# ------------------------------------------------------------------------------------ URL and flags
@pytest.mark.parametrize("url", ["127.0.0.1:5000", "ftp://host/x", "http://", "http://host:99999/x"])
def test_a_bad_url_is_one_line(url):
    with pytest.raises(UserError, match="--reward_url"):
        check_reward_url(url)


def test_plain_http_to_another_host_warns_loopback_and_https_do_not():
    assert plain_http_warning("http://10.0.0.5:5000/get_reward").startswith(
        "warning: --reward_url http://10.0.0.5:5000/get_reward is plain http://")
    for url in ("http://127.0.0.1:5000/x", "http://localhost/x", "http://[::1]:80/x", "https://rm.example.org/x"):
        assert plain_http_warning(url) is None


def test_step3_flags_defaults_and_the_reward_model_weight():
    module = step3_main()
    args = module.parse_args(["--actor_model_name_or_path", "a"])
    assert (args.reward_url, args.reward_url_weight, args.reward_url_timeout, args.reward_url_retries) == (
        None, 1.0, 60.0, 3)
    assert module.reward_mix(args).functions == ()  # nothing is sent without the flag
    args = module.parse_args(["--actor_model_name_or_path", "a", "--reward_url", "http://127.0.0.1:1/get_reward",
                              "--reward_url_weight", "2", "--reward_url_retries", "0"])
    mix = module.reward_mix(args)
    assert not mix.uses_model and [(f.name, f.weight) for f in mix.functions] == [
        ("http://127.0.0.1:1/get_reward", 2.0)]
    assert mix.functions[0].fn.retries == 0
    args.reward_model_weight = 1.0
    assert module.reward_mix(args).model_weight == 1.0


@pytest.mark.parametrize("flags, message", [
    (("--reward_url_timeout", "0"), "--reward_url_timeout must be a number of seconds above 0 and at most 1e9"),
    (("--reward_url_timeout", "1e10"), "--reward_url_timeout must be a number of seconds above 0 and at most 1e9"),
    (("--reward_url_retries", "-1"), "--reward_url_retries must be >= 0"),
    (("--reward_url_weight", "nan"), "--reward_url_weight must be a finite number"),
    # Finite in float64, not in the float32 reward: every reward inf, every rollout skipped.
    (("--reward_url_weight", "1e39"), r"--reward_url_weight must be a finite number \(within float32's range"),
    (("--reward_model_weight=-1e39",), r"--reward_model_weight must be a finite number \(within float32's range"),
    (("--reward_fn", "dschat.rewards:gold", "--reward_fn_weight", "1e39"),
     r"--reward_fn_weight for dschat.rewards:gold must be a finite number \(within float32's range"),
    # Every term weighted 0: every reward 0 (the server still called each step).
    (("--reward_url_weight", "0"), r"every reward term has weight 0 \(http://127.0.0.1:1/x 0, the reward model 0\)"),
    (("--reward_fn", "dschat.rewards:gold", "--reward_fn_weight", "0", "--reward_url_weight", "0"),
     r"every reward term has weight 0 \(dschat.rewards:gold 0, http://127.0.0.1:1/x 0, the reward model 0\)"),
])
def test_bad_reward_url_flags_are_one_line(flags, message):
    module = step3_main()
    args = module.parse_args(["--actor_model_name_or_path", "a", "--reward_url", "http://127.0.0.1:1/x", *flags])
    with pytest.raises(UserError, match=message):
        module.reward_mix(args)


# ------------------------------------------------------------------------------------ a shared machine
def test_the_api_key_is_not_sent_in_clear_to_another_host(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "k3y")
    assert RemoteReward("http://10.0.0.5:5000/get_reward").api_key is None
    assert RemoteReward("https://rm.example.org/get_reward").api_key == "k3y"
    assert RemoteReward("http://localhost:5000/get_reward").api_key == "k3y"
    assert plain_http_warning("http://10.0.0.5:5000/get_reward").endswith(
        f"unencrypted ({API_KEY_ENV} is not sent over it); use https:// or a loopback address")
    with RewardServer([status(401)]) as server:  # the same line a withheld key would get from another host
        client = _client(server.url)
        client.api_key = None
        with pytest.raises(UserError, match=f"{API_KEY_ENV} is set but not sent to a plain http:// URL of another "
                                            "host .* SSH tunnel"):
            client(PROMPTS[:1], ANSWERS[:1])


def test_the_api_key_is_sent_as_a_bearer_token_and_a_401_names_the_variable(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with RewardServer([None, status(401)]) as server:
        _client(server.url)(PROMPTS[:1], ANSWERS[:1])
        with pytest.raises(UserError, match=f"answered HTTP 401 .*; set {API_KEY_ENV} to the server's API key"):
            _client(server.url)(PROMPTS[:1], ANSWERS[:1])
        monkeypatch.setenv(API_KEY_ENV, "k3y")
        _client(server.url, chunk_size=2)(PROMPTS[:3], ANSWERS[:3])
    assert server.authorization == [None, None, "Bearer k3y", "Bearer k3y"]


def test_a_loopback_url_never_goes_through_a_proxy_of_the_environment_another_host_does(monkeypatch):
    """``HTTP_PROXY`` set (no ``NO_PROXY``): requests would send a loopback URL's key, prompts and
    answers to the proxy, and train on its rewards. A loopback URL goes straight to this machine's
    server; another host's still goes through the proxy."""
    for name in ("NO_PROXY", "no_proxy", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(API_KEY_ENV, "k3y")
    with RewardServer([redirect("/get_reward/")]) as server, RewardServer([{"rewards": [-7.0]}] * 2) as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url.rsplit("/", 1)[0])
        # The server answers a redirect first (a trailing slash): requests looks proxies up again for it.
        assert _client(server.url)(PROMPTS[:1], ANSWERS[:1]) == [float(len(PROMPTS[0] + ANSWERS[0]))]
        assert proxy.requests == [] and server.authorization == ["Bearer k3y", "Bearer k3y"]
        assert _client("http://rm.example.invalid/get_reward")(PROMPTS[:1], ANSWERS[:1]) == [-7.0]
    assert len(proxy.requests) == 1 and proxy.authorization == [None]


def test_a_redirect_that_turns_the_post_into_a_get_or_loops_is_one_line_and_not_retried():
    """A 302 made requests send a GET without the queries (then a confusing 405 or wrong count); a
    redirect loop was retried and blamed on the network."""
    with RewardServer([redirect("/moved?key=s3cret", 302)]) as server:
        with pytest.raises(UserError, match=r"answered HTTP 302 \(moved to /moved\?\*\*\*\), which turns the POST "
                                            r"into a GET; pass the URL it moved to"):
            _client(server.url)(PROMPTS[:1], ANSWERS[:1])
    with RewardServer([redirect("/get_reward")] * 100) as server:
        with pytest.raises(UserError, match=r"keeps redirecting \(TooManyRedirects\); pass the URL the server answers at"):
            _client(server.url, retries=3)(PROMPTS[:1], ANSWERS[:1])
        assert len(server.requests) == 31  # the request and requests' 30 redirects, once: not retried


def test_the_url_is_shown_without_its_password_or_query():
    url = "https://me:t0ken@rm.example.org:8443/get_reward?key=t0ken"
    assert shown_url(url) == "https://***@rm.example.org:8443/get_reward?***"
    assert shown_url("https://t0ken@rm.example.org/x") == "https://***@rm.example.org/x"
    assert shown_url("http://127.0.0.1:5000/get_reward") == "http://127.0.0.1:5000/get_reward"
    assert shown_url("sqlite:////tmp/a/b.db?x=1") == "sqlite:////tmp/a/b.db?***"  # an empty host keeps its //
    assert "t0ken" not in repr(RemoteReward(url)) and "t0ken" not in remote_reward_function(url).name
    assert "t0ken" not in plain_http_warning(url.replace("https", "http"))
    from dschat.training.trackers import run_config
    assert run_config(argparse.Namespace(reward_url=url, seed=1)) == {"reward_url": shown_url(url), "seed": 1}
    with RewardServer([status(400)]) as server:
        with pytest.raises(UserError) as err:
            _client(server.url.replace("http://", "http://me:t0ken@") + "?key=t0ken")(PROMPTS[:1], ANSWERS[:1])
    assert "t0ken" not in str(err.value) and "http://***@127.0.0.1:" in str(err.value)


def test_the_owners_of_listening_sockets_are_read_from_the_kernels_tables():
    with socket.socket() as listening, socket.socket() as bound:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        bound.bind(("127.0.0.1", 0))  # bound, not listening
        assert listener_owners(listening.getsockname()[1]) == {os.getuid()}
        assert listener_owners(bound.getsockname()[1]) == set()
    assert listener_owners(1, tables=("/no/such/table",)) == set()
    if socket.has_ipv6:  # ::1 (tcp6's four words) and every address
        for address in ("::1", "::"):
            with socket.socket(socket.AF_INET6) as six:
                try:
                    six.bind((address, 0))
                except OSError:  # no IPv6 on this machine's loopback
                    continue
                six.listen()
                assert listener_owners(six.getsockname()[1]) == {os.getuid()}


def test_a_table_line_is_read_by_address(tmp_path):
    """Lines of /proc/net/tcp and tcp6 (the kernel's format): listeners on 127.0.0.1, 0.0.0.0, ::1,
    ::ffff:127.0.0.1 and 10.1.2.3, and a connection that is not listening, all on port 5000 (0x1388)."""
    head = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    row = "   0: {address}:1388 00000000:0000 {state} 00000000:00000000 00:00000000 00000000  {uid}        0 1 1\n"
    four = tmp_path / "tcp"
    four.write_text(head + row.format(address="0100007F", state="0A", uid=1001)
                    + row.format(address="00000000", state="0A", uid=1002)
                    + row.format(address="0302010A", state="0A", uid=1003)
                    + row.format(address="0100007F", state="01", uid=1004))
    six = tmp_path / "tcp6"
    six.write_text(head + row.format(address="00000000000000000000000001000000", state="0A", uid=1005)
                   + row.format(address="0000000000000000FFFF00000100007F", state="0A", uid=1006))
    assert listener_owners(5000, tables=(str(four), str(six))) == {1001, 1002, 1005, 1006}
    assert listener_owners(5001, tables=(str(four), str(six))) == set()


def test_a_loopback_server_of_another_account_is_refused_before_anything_is_sent(monkeypatch):
    with RewardServer() as server:
        uid = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: uid + 1)  # as if we were another account
        port = server.server.server_address[1]
        with pytest.raises(UserError, match=rf"--reward_url {server.url}: the server listening on port {port} "
                                            rf"belongs to another account \(uid {uid}\)"):
            _client(server.url)(PROMPTS, ANSWERS)
    assert server.requests == []


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to listen as another account")
def test_a_server_that_another_account_really_runs_is_refused():
    """A listener that a child process made as ``nobody`` (uid 65534): the kernel's tables name the
    account that created the socket."""
    child = subprocess.Popen([sys.executable, "-c", (
        "import os, socket, sys, time\n"
        "os.setuid(65534); s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        "print(s.getsockname()[1], flush=True); time.sleep(120)")], stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        with pytest.raises(UserError, match=f"port {port} belongs to another account \\(uid 65534\\)"):
            _client(f"http://127.0.0.1:{port}/get_reward", retries=0, timeout=5)(PROMPTS[:1], ANSWERS[:1])
    finally:
        child.kill()
        child.wait()


def test_a_failed_chunk_does_not_wait_for_the_chunks_in_flight():
    """Three one-query chunks: the first fails (HTTP 400) once the other two have reached the server,
    which holds them until the test lets them go. The call raises while they are still held (waiting
    for them would take until the server's 30 s hold ran out and they had finished)."""
    release = threading.Event()
    held: list[str] = []
    lock = threading.Lock()

    def act(handler: Any, payload: Any) -> None:
        if payload["query"] == [PROMPTS[0] + ANSWERS[0]]:  # the first chunk: fails
            deadline = time.monotonic() + 10
            while len(held) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            handler.reply(400, {"detail": "bad"})
            return
        with lock:
            held.append(payload["query"][0])
        release.wait(30)
        with lock:
            held.remove(payload["query"][0])
        handler.reply(200, {"rewards": [0.0] * len(payload["query"])})

    with RewardServer([act, act, act]) as server:
        try:
            with pytest.raises(UserError, match="answered HTTP 400"):
                _client(server.url, chunk_size=1)(PROMPTS[:3], ANSWERS[:3])
            assert len(held) == 2  # raised with both still in flight
        finally:
            release.set()


def test_a_failed_chunk_stops_the_call_before_a_slow_earlier_chunk_and_the_queued_ones():
    """Two requests in flight at a time, one query each: chunk 0 is held by the server, chunk 1 fails
    (HTTP 404, not retried). The call raises chunk 1's line while chunk 0 is still held (waiting for it
    would end in chunk 0's own timeout line instead), and chunks 2-4, not yet sent, are never sent."""
    release, held_arrived = threading.Event(), threading.Event()

    def held(handler: Any, payload: Any) -> None:
        held_arrived.set()
        release.wait(60)
        handler.reply(200, {"rewards": [0.0]})

    def fails(handler: Any, payload: Any) -> None:
        held_arrived.wait(30)  # chunk 0 is in flight (and recorded) before chunk 1 fails
        status(404)(handler, payload)

    def act(handler: Any, payload: Any) -> None:
        (held if payload["prompts"] == [PROMPTS[0]] else fails)(handler, payload)

    with RewardServer([act] * 5) as server:
        try:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr("dschat.remote_reward.MAX_CONCURRENT_REQUESTS", 2)
                with pytest.raises(UserError, match="answered HTTP 404"):
                    _client(server.url, chunk_size=1, timeout=5, retries=0)(PROMPTS, ANSWERS)
            sent = sorted(r["prompts"][0] for r in server.requests)
        finally:
            release.set()
    assert sent == PROMPTS[:2]


EXITS_AFTER_A_FAILURE = r"""
import sys
from dschat.errors import cli_main
from dschat.remote_reward import RemoteReward
sys.exit(cli_main(lambda argv: RemoteReward(sys.argv[1], chunk_size=1, timeout=600, retries=0)(["a", "b"], ["x", "y"])))
"""


def test_the_process_exits_after_a_failure_with_a_request_still_in_flight():
    """The failing call returns while its other request waits on a server that holds it (for up to ten
    minutes, the client's timeout): the process prints its line and exits, not held by that request."""
    release = threading.Event()

    def act(handler: Any, payload: Any) -> None:
        if payload["prompts"] == ["a"]:
            release.wait(600)
            handler.reply(200, {"rewards": [0.0]})
        else:
            handler.reply(400, {"detail": "bad"})

    with RewardServer([act, act]) as server:  # run from the checkout: the dschat under test
        child = subprocess.Popen([sys.executable, "-c", EXITS_AFTER_A_FAILURE, server.url], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
        try:
            _, err = child.communicate(timeout=120)  # generous: it exits at once, or only when released
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            raise AssertionError("the process did not exit while a request was in flight") from None
        finally:
            release.set()
    assert child.returncode == 2 and err.splitlines()[-1].endswith("answered HTTP 400 {\"detail\": \"bad\"}; check the "
                                                                   "URL (a dschat server's route is /get_reward)")


def test_a_connection_error_shows_neither_the_query_nor_the_password():
    """requests' message quotes the URL's path and query (``?api_key=...``): the line gives the error's
    type and the socket's reason instead."""
    with RewardServer() as server:
        url = server.url
    for secret_url in (url + "?api_key=TOPSECRET", url.replace("http://", "http://me:TOPSECRET@")):
        with pytest.raises(UserError) as err:
            _client(secret_url, retries=0)(PROMPTS[:1], ANSWERS[:1])
        line = str(err.value)
        assert "TOPSECRET" not in line and "\n" not in line
        assert "last error: ConnectionError (ConnectionRefusedError: [Errno 111] Connection refused)" in line


@pytest.mark.parametrize("key", ["k3y\n", "k3y\r\n", " k3y", "k 3y", "k3y\x7f", "k3y\u00e9"])
def test_an_api_key_no_header_can_carry_is_refused_at_once_without_showing_it(monkeypatch, key):
    monkeypatch.setenv(API_KEY_ENV, key)
    with pytest.raises(UserError, match=f"{API_KEY_ENV} holds whitespace .*; set it to the key alone") as err:
        RemoteReward("http://127.0.0.1:5000/get_reward")
    assert "k3y" not in str(err.value)
    RemoteReward("http://10.0.0.5:5000/get_reward")  # not sent there, so not refused


def test_a_request_that_cannot_be_made_is_not_retried_and_its_headers_not_shown():
    with RewardServer() as server:
        client = _client(server.url, retries=3)
        client.session().headers["X-Token"] = "TOPSECRET\r\n"  # requests refuses the header: InvalidHeader
        with pytest.raises(UserError, match=r"the request cannot be made \(InvalidHeader\); check the URL") as err:
            client(PROMPTS[:1], ANSWERS[:1])
    assert "TOPSECRET" not in str(err.value) and "failed" not in str(err.value) and not server.requests



# ------------------------------------------------------------------------------------ one attempt's limit
def trickle(pause: float, part: str, padding: int = 400) -> Callable:
    """A reply of which one part arrives one byte every ``pause`` seconds: its status line and headers
    (``part`` "head", with a long header) or its body (``part`` "body", JSON after ``padding`` spaces;
    "unsized body": the same without Content-Length, so that it ends where the connection does)."""
    def act(handler: Any, payload: Any) -> None:
        slow_body = part in ("body", "unsized body")
        body = json.dumps({"rewards": [0.0] * len(payload["query"])}).encode()
        body = b" " * (padding if slow_body else 0) + body
        framing = "Connection: close" if part == "unsized body" else f"Content-Length: {len(body)}"
        head = (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{framing}\r\n"
                f"X-Padding: {'p' * (padding if part == 'head' else 0)}\r\n\r\n").encode()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client has given up
            for data, slowly in ((head, part == "head"), (body, slow_body)):
                for piece in ([data[i:i + 1] for i in range(len(data))] if slowly else [data]):
                    handler.wfile.write(piece)
                    time.sleep(pause if slowly else 0)
        handler.close_connection = True
    return act


@pytest.mark.parametrize("part", ["body", "head", "unsized body"])
def test_a_reply_trickled_byte_by_byte_ends_each_attempt_at_twice_the_timeout(part):
    """Each byte comes well within the 1 s timeout, so no read times out; the whole reply would take
    over 20 s an attempt. Each attempt ends at 2 s instead, is retried, and the line says so, also
    where the cut reply looks whole (a head ended early, a body that ends where the connection does)."""
    timeout, retries = 1.0, 1
    with RewardServer([trickle(0.05, part)] * 2) as server:
        client = _client(server.url, timeout=timeout, retries=retries)
        start = time.monotonic()
        with pytest.raises(UserError) as err:
            client(PROMPTS[:1], ANSWERS[:1])
        waited = time.monotonic() - start
        assert len(server.requests) == retries + 1
        assert client(PROMPTS[:1], ANSWERS[:1]) == [float(len(PROMPTS[0] + ANSWERS[0]))]  # the client goes on
    line = str(err.value)
    assert line.startswith(f"--reward_url {server.url} failed 2 times ") and "\n" not in line
    assert "last error: the reply did not arrive whole within 2 s (twice --reward_url_timeout 1 s)" in line
    assert waited >= (retries + 1) * 2 * timeout - 0.05
    assert waited < worst_case_seconds(timeout, retries, backoff=0.01) + 3.0  # slack for a loaded machine


def pieces(*parts: bytes, chunked: bool = False) -> Callable:
    """A reply whose body is written in ``parts``, a short pause between them (as chunks of
    ``Transfer-Encoding: chunked`` with ``chunked``)."""
    def act(handler: Any, payload: Any) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        if chunked:
            handler.send_header("Transfer-Encoding", "chunked")
        else:
            handler.send_header("Content-Length", str(sum(len(p) for p in parts)))
        handler.end_headers()
        for part in parts:
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
            handler.wfile.flush()
            time.sleep(0.05)
        if chunked:
            handler.wfile.write(b"0\r\n\r\n")
    return act


@pytest.mark.parametrize("chunked", [False, True])
def test_a_reply_that_arrives_in_pieces_is_read_whole(chunked):
    reply = pieces(b'{"rewards": [1.5, ', b'-2', b".25]}", chunked=chunked)
    with RewardServer([reply, reply]) as server:
        client = _client(server.url, retries=0)
        assert client(PROMPTS[:2], ANSWERS[:2]) == [1.5, -2.25]
        assert client(PROMPTS[:2], ANSWERS[:2]) == [1.5, -2.25]
    assert len(server.requests) == 2


def test_a_reply_over_the_size_limit_is_one_line_and_not_retried(monkeypatch):
    monkeypatch.setattr("dschat.remote_reward.MAX_REPLY_BYTES", 2**20)
    reply = {"rewards": [0.0], "padding": "x" * 2**20}
    with RewardServer([reply]) as server:
        with pytest.raises(UserError) as err:
            _client(server.url, retries=2)(PROMPTS[:1], ANSWERS[:1])
    assert len(server.requests) == 1
    line = str(err.value)
    assert line.startswith(f"--reward_url {server.url} replied with more than 1 MiB; ") and "\n" not in line


def test_an_oversized_reply_is_not_kept_but_an_error_status_keeps_its_first_bytes(monkeypatch):
    """A 200 reply over the limit is refused whole, so none of it is kept (no copy of up to the limit
    is made); an error status's reply keeps its first 4 KiB for its line."""
    monkeypatch.setattr("dschat.remote_reward.MAX_REPLY_BYTES", 2**20)
    detail = "d" * 10_000
    error = lambda handler, payload: handler.reply(500, {"detail": detail})  # noqa: E731
    with RewardServer([{"rewards": [0.0], "padding": "x" * 2**20}, error, error]) as server:
        client = _client(server.url, retries=0)
        payload = {"query": ["q"], "prompts": ["p"], "labels": [""]}
        assert client._exchange(payload) == (200, b"", False)
        status_code, body, whole = client._exchange(payload)
        assert (status_code, body, whole) == (500, json.dumps({"detail": detail}).encode()[:4096], False)
        with pytest.raises(UserError, match=r'last error: HTTP 500 \{"detail": "ddd'):
            client(PROMPTS[:1], ANSWERS[:1])


def _deadline_passes_as_each_attempt_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each attempt's limit passes after its whole reply was read, just before the attempt ends (its
    connection back in the pool by then)."""
    real_exit = remote_reward._Deadline.__exit__

    def passing_exit(self: Any, *exc: Any) -> None:
        self._pass()
        real_exit(self, *exc)

    monkeypatch.setattr(remote_reward._Deadline, "__exit__", passing_exit)


def test_a_whole_reply_counts_when_the_limit_passes_as_the_attempt_ends(monkeypatch):
    """The reply is read whole, so the call succeeds, and the connection, back in the pool, is left
    open: the next call reuses it, and calls of five requests (two at a time) reuse theirs."""
    _deadline_passes_as_each_attempt_ends(monkeypatch)
    monkeypatch.setattr("dschat.remote_reward.MAX_CONCURRENT_REQUESTS", 2)
    expected = [float(len(p + a)) for p, a in zip(PROMPTS, ANSWERS)]
    with RewardServer() as server:
        client = _client(server.url, retries=0, timeout=5)
        assert client(PROMPTS[:1], ANSWERS[:1]) == expected[:1]
        assert client(PROMPTS[1:2], ANSWERS[1:2]) == expected[1:2]
        assert len(server.connections) == 1  # the pooled connection was not shut: the next call reused it
        client.chunk_size = 1  # five requests, two at a time
        assert client(PROMPTS, ANSWERS) == expected
        assert client(PROMPTS, ANSWERS) == expected
    assert len(server.requests) == 2 + 5 + 5
    assert len(server.connections) <= 2  # one per request in flight, each reused


def test_a_pooled_connection_another_request_took_is_not_shut_by_the_limit_of_the_one_that_used_it(monkeypatch):
    """Request A has read its whole reply, so its connection is back in the pool; request B, on another
    thread, takes that connection and is about to send on it when A's limit passes, before A ends (the
    order is forced, not left to timing). Both requests succeed, with no retry to spare."""
    taken, passed = threading.Event(), threading.Event()
    other: dict[str, Any] = {}
    real_exit, real_request = remote_reward._Deadline.__exit__, remote_reward._Watched.request

    def exit_a(self: Any, *exc: Any) -> None:
        if threading.current_thread() is threading.main_thread() and "thread" not in other:  # A's end
            def request_b() -> None:
                try:
                    other["scores"] = client(PROMPTS[1:2], ANSWERS[1:2])
                except BaseException as err:  # noqa: BLE001 -- checked below
                    other["error"] = err
            other["thread"] = threading.Thread(target=request_b, daemon=True)
            other["thread"].start()
            try:
                assert taken.wait(10)
                self._pass()
            finally:
                passed.set()
                real_exit(self, *exc)
            return
        real_exit(self, *exc)

    def request(self: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is other.get("thread"):  # B, on A's connection, before it sends
            taken.set()
            passed.wait(10)
        return real_request(self, *args, **kwargs)

    monkeypatch.setattr(remote_reward._Deadline, "__exit__", exit_a)
    monkeypatch.setattr(remote_reward._Watched, "request", request)
    with RewardServer() as server:
        client = _client(server.url, retries=0, timeout=5)
        assert client(PROMPTS[:1], ANSWERS[:1]) == [float(len(PROMPTS[0] + ANSWERS[0]))]
        other["thread"].join(30)
    assert "error" not in other, other.get("error")
    assert other["scores"] == [float(len(PROMPTS[1] + ANSWERS[1]))]
    assert len(server.connections) == 1  # B did take A's connection


def test_the_limit_shuts_the_socket_under_a_tls_transport_of_an_https_proxy():
    """Through an https proxy to an https URL the connection's ``sock`` is urllib3's SSLTransport,
    which wraps the socket: that socket is shut down. A ``sock`` that leads to no socket is left as is."""
    from urllib3.util.ssltransport import SSLTransport

    ours, theirs = socket.socketpair()
    with ours, theirs:
        transport = SSLTransport.__new__(SSLTransport)  # its TLS is not needed here: only what it wraps
        transport.socket = ours
        deadline = remote_reward._Deadline(60)
        deadline.passed = True  # a connection taken past the limit is shut at once
        deadline.take(types.SimpleNamespace(sock=transport))
        theirs.settimeout(10)
        assert theirs.recv(1) == b""  # the other end sees the connection end
    looped = types.SimpleNamespace()
    looped.socket = looped
    for sock in (looped, types.SimpleNamespace(socket=None), object(), ours):  # ours: closed by now
        deadline.take(types.SimpleNamespace(sock=sock))


def test_a_limit_whose_timer_cannot_start_leaves_the_thread_without_one(monkeypatch):
    deadline = remote_reward._Deadline(60)

    def cannot_start() -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(deadline._timer, "start", cannot_start)
    try:
        with pytest.raises(RuntimeError, match="can't start new thread"):
            with deadline:
                pass
        assert getattr(remote_reward._running, "deadline", None) is None
    finally:
        remote_reward._running.deadline = None


def test_each_chunk_carries_the_labels_of_its_own_answers():
    def zeros(handler, payload):
        handler.reply(200, {"rewards": [0.0] * len(payload["query"])})

    labels = [f"label-{i}" for i in range(len(PROMPTS))]
    with RewardServer([zeros] * 3) as server:
        _client(server.url, chunk_size=2)(PROMPTS, ANSWERS, answer=labels)
    assert len(server.requests) == 3
    by_prompt = dict(zip(PROMPTS, labels))
    for request in server.requests:
        assert request["labels"] == [by_prompt[p] for p in request["prompts"]]


def test_a_missing_label_is_sent_as_an_empty_string(monkeypatch):
    """A row whose reference answer is None sends the label "" (not the text "None", which a verifier
    would score against)."""
    sent = []
    client = RemoteReward("http://127.0.0.1:9/get_reward")
    monkeypatch.setattr(client, "check_owner", lambda: None)
    monkeypatch.setattr(client, "_post", lambda payload, stop=None: sent.append(payload) or [0.0])
    client(["p"], ["a"], answer=[None])
    assert sent[0]["labels"] == [""]
