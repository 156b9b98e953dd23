"""Step 3's decoding loops followed row by row, as ``python -m dschat.serve`` decodes through them: the
``on_step`` callback of ``sample_loop`` and ``DschatHybridEngine.decode`` ends rows as an EOS would
(real tiny models, CPU); ``--decoding_engine`` picks, refuses and names the engine; a batch keeps
within the model's positions, and chat requests without ``max_tokens`` share one; text that may
start a stop string is held back behind an incomplete character too; a client that disconnects
mid-stream ends its row's decoding and the server goes on (a real uvicorn server on a socket, in this
process, so the test sees the worker)."""
from __future__ import annotations

import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import requests
import torch
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

from dschat.errors import UserError
from dschat.models.registry import resolve_model_path
from dschat.rlhf.rollout.dschat_engine import DschatHybridEngine
from dschat.rlhf.rollout.sample_loop import sample_loop
from dschat.rlhf.rollout.sampling import DecodingSettings
from dschat.serve import actor
from dschat.serve.actor import (Batcher, Delta, Done, Failed, HybridEngineDecoder, Job, LoopDecoder, RowFollower,
                                load_actor_engine, pick_decoder, start_batcher)
from dschat.serve.app import build_actor_app
from dschat.serve.cli import main

from helpers.serve import serving_in_process

GREEDY = DecodingSettings(decoding="greedy")
PROMPTS = ["Hello there, how are", "The capital of France is", "x"]
N = 12


@pytest.fixture(scope="module")
def llama():
    return load_actor_engine("tiny-llama", device="cpu")


def _batch(engine) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [engine.encode(p) for p in PROMPTS]
    width, pad = max(map(len, rows)), engine.tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _decode(engine, loop: str, ids, mask, **kwargs) -> torch.Tensor:
    """Step 3's greedy decoding of the batch (EOS suppressed, so only ``on_step`` ends rows early)."""
    eos, pad = engine.tokenizer.eos_token_id, engine.tokenizer.pad_token_id
    with torch.no_grad():
        if loop == "dschat":
            he = DschatHybridEngine(engine.model.config, decoding=GREEDY, max_new_tokens=N, eos_token_id=eos,
                                    pad_token_id=pad)
            return he.rollout(engine.model, ids, mask, min_new_tokens=N, keep_logprobs=False, **kwargs).sequences
        return sample_loop(engine.model, ids, mask, decoding=GREEDY, max_new_tokens=N, min_new_tokens=N,
                           eos_token_id=eos, pad_token_id=pad, keep_logprobs=False, **kwargs).sequences


@pytest.mark.parametrize("loop", ["dschat", "loop"])
def test_a_row_ended_by_on_step_is_padded_as_after_eos_and_the_others_are_unchanged(llama, loop):
    ids, mask = _batch(llama)
    P, pad = ids.shape[1], llama.tokenizer.pad_token_id
    plain = _decode(llama, loop, ids, mask)
    seen: list[torch.Tensor] = []

    def on_step(token: torch.Tensor) -> torch.Tensor:
        seen.append(token.clone())
        return torch.tensor([False, len(seen) == 3, False])  # row 1 ends at its third token

    followed = _decode(llama, loop, ids, mask, on_step=on_step)
    assert followed.shape == plain.shape == (3, P + N)
    assert torch.equal(followed[[0, 2]], plain[[0, 2]])
    assert torch.equal(followed[1, :P + 3], plain[1, :P + 3]) and bool((followed[1, P + 3:] == pad).all())
    assert torch.equal(torch.stack(seen, dim=1), followed[:, P:])  # every step's tokens, padding included


@pytest.mark.parametrize("loop", ["dschat", "loop"])
def test_ending_every_row_stops_decoding(llama, loop):
    ids, mask = _batch(llama)
    calls: list[int] = []

    def on_step(token: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return torch.full(token.shape, len(calls) == 2)

    assert _decode(llama, loop, ids, mask, on_step=on_step).shape[1] == ids.shape[1] + 2 and len(calls) == 2


# ------------------------------------------------------------------------------------------------
# --decoding_engine
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    """A tiny random GPT-2 (a family dschat's decode model does not cover) with tiny-opt's tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny-opt"))
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=1, n_head=2,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    folder = tmp_path_factory.mktemp("serve_gpt2") / "gpt2"
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_decoding_engine_dschat_on_a_family_it_does_not_cover_is_one_line_exit_2(gpt2_folder, capsys):
    assert main([str(gpt2_folder), "--port", "0", "--decoding_engine", "dschat"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --decoding_engine dschat: dschat Hybrid Engine cannot decode")
    assert "model type 'gpt2' has no inference layout" in err[0] and err[0].endswith("use --decoding_engine auto or loop")


def test_auto_serves_a_family_the_engine_does_not_cover_with_the_loop_and_says_why(gpt2_folder, llama):
    decoder, why = pick_decoder(load_actor_engine(str(gpt2_folder), device="cpu"), "auto", 4)
    assert isinstance(decoder, LoopDecoder) and why.startswith("dschat Hybrid Engine not used: model type 'gpt2'")
    decoder, why = pick_decoder(llama, "auto", 4)
    assert isinstance(decoder, HybridEngineDecoder) and why == "its decode model covers this family"


# ------------------------------------------------------------------------------------------------
# Batches within the model's positions
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine_name", ["dschat", "loop"])
def test_a_long_prompt_and_a_long_answer_are_not_batched_past_the_models_positions(engine_name):
    """tiny-opt has 512 learned positions. A 400-token prompt answered in 8 tokens and a short prompt
    answered in 300 fit alone; in one batch the first row would step to position ~700."""
    opt = load_actor_engine("tiny-opt", device="cpu")
    decoder = HybridEngineDecoder(opt, 4) if engine_name == "dschat" else LoopDecoder(opt)
    long_ids = opt.encode("word " * 300)[:400]
    outs: list[list] = [[], []]
    batcher = Batcher(decoder, max_batch_size=4, max_wait_s=2.0)
    batcher.submit(Job(long_ids, 8, (), GREEDY, outs[0].append))
    batcher.submit(Job(opt.encode(PROMPTS[0]), 300, (), GREEDY, outs[1].append))
    deadline = time.monotonic() + 300
    while not all(out and isinstance(out[-1], (Done, Failed)) for out in outs):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert [type(out[-1]) for out in outs] == [Done, Done], [out[-1] for out in outs]
    assert [out[-1].completion_tokens for out in outs] == [8, 300] and list(batcher.batch_sizes) == [1, 1]


class _Recorder:
    """A decoder that decodes nothing: it records each batch as (prompt tokens, max_tokens) per job and
    ends every job after ``max_tokens`` tokens (``length``)."""

    name = "recorder"

    def __init__(self, engine) -> None:
        self.engine, self.batches = engine, []

    def describe(self) -> str:
        return self.name

    def warm_up(self) -> None:
        """Nothing to prepare."""

    def decode(self, jobs) -> None:
        self.batches.append([(len(job.prompt_ids), job.max_tokens) for job in jobs])
        for job in jobs:
            job.emit(Done("length", len(job.prompt_ids), job.max_tokens))


def test_chat_requests_without_max_tokens_share_a_batch_each_capped_to_the_room_left():
    """Without ``max_tokens`` a chat answer takes as many tokens as fit: four such requests of
    different lengths share one batch (tiny-opt: 512 positions), each row capped to the room the
    batch's widest prompt leaves. The batch closes when four wait (``max_wait_s`` is a ceiling)."""
    opt = load_actor_engine("tiny-opt", device="cpu")
    opt.tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                   "{% if add_generation_prompt %}assistant:{% endif %}")
    recorder = _Recorder(opt)
    batcher = Batcher(recorder, max_batch_size=4, max_wait_s=10.0)
    texts = ["hi", "word " * 20, "word " * 80, "word " * 40]
    widest = max(len(opt.encode_chat([{"role": "user", "content": t}])) for t in texts)
    replies: dict[int, requests.Response] = {}
    with serving_in_process(build_actor_app(opt, batcher)) as url:
        def ask(i: int) -> None:
            replies[i] = requests.post(url + "/v1/chat/completions", timeout=120, json={
                "model": "tiny-opt", "messages": [{"role": "user", "content": texts[i]}], "temperature": 0})

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(texts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    assert list(batcher.batch_sizes) == [4]
    assert sorted(tokens for _, tokens in recorder.batches[0]) == [512 - widest] * 4
    assert [replies[i].json()["usage"]["completion_tokens"] for i in range(4)] == [512 - widest] * 4


def test_a_job_without_max_tokens_does_not_make_an_asked_max_tokens_fit():
    """select_batch: a job whose ``max_tokens`` was asked for keeps the rule widest prompt + largest
    ``max_tokens`` <= positions; ``fill`` jobs join where one token fits and they keep at least half of
    their own room, and are capped to the room the batch leaves."""
    fill = [Job(list(range(n)), 512 - n, (), GREEDY, print, fill=True) for n in (10, 400, 100)]
    asked = Job(list(range(10)), 500, (), GREEDY, print)
    assert actor.select_batch([fill[0], asked, fill[1]], 4, 512) == [fill[0], asked]
    assert fill[0].max_tokens == 502 and fill[1].max_tokens == 112  # the one left out is not capped
    # A 400-token prompt would leave the 10-token one 112 of its 502 positions: it is not cut short so.
    assert actor.select_batch([fill[1], fill[0], asked], 4, 512) == [fill[1]]
    assert fill[0].max_tokens == 502
    # A 100-token prompt leaves it 412 of 502: they share a batch, both capped to 412.
    assert actor.select_batch([fill[0], fill[2]], 4, 512) == [fill[0], fill[2]]
    assert fill[0].max_tokens == fill[2].max_tokens == 412


def _bytes_engine(pieces: dict[int, bytes]) -> SimpleNamespace:
    """An engine whose tokens are byte strings (UTF-8 characters may span two tokens); EOS is 0."""
    def decode(ids: list[int]) -> str:
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    return SimpleNamespace(tokenizer=SimpleNamespace(eos_token_id=0), eos_ids=frozenset({0}), decode=decode)


def test_the_start_of_a_stop_string_is_held_back_behind_an_incomplete_character():
    """Stop ``a𝔸`` on ``x a 𝔸 y``: while ``𝔸`` is half decoded the text is ``xa\ufffd``; its ``a`` may
    start the stop string, so only ``x`` is sent, and the streamed pieces join to the final ``x``."""
    letter = "𝔸".encode()
    engine = _bytes_engine({0: b"", 1: b"x", 2: b"a", 3: letter[:2], 4: letter[2:], 5: b"y"})
    events: list = []
    follower = RowFollower(engine, [Job([1], 10, ("a𝔸",), GREEDY, events.append)], 1)
    for token in (1, 2, 3, 4, 5):
        if follower(torch.tensor([token]))[0]:
            break
    assert isinstance(events[-1], Done) and events[-1].finish_reason == "stop"
    assert "".join(e.text for e in events if isinstance(e, Delta)) == "x"
    assert actor._held_back("xa\ufffd", ("a𝔸",)) == 2 and actor._held_back("xy\ufffd\ufffd", ("a𝔸",)) == 2


# ------------------------------------------------------------------------------------------------
# A client that goes away
# ------------------------------------------------------------------------------------------------
def _slow_steps(monkeypatch) -> list:
    """Each decoding step takes at least 20 ms, so a row decoded to its end (400 tokens, tiny-llama
    writes no EOS for these prompts) would take 8 s: far longer than a disconnect. Returns the
    followers of the steps taken, in order."""
    step, steps = RowFollower.__call__, []

    def slow_step(self, token: torch.Tensor) -> torch.Tensor:
        steps.append(self)  # which batch stepped
        time.sleep(0.02)
        return step(self, token)

    monkeypatch.setattr(RowFollower, "__call__", slow_step)
    return steps


def _watched(batcher: Batcher, monkeypatch) -> tuple[list[Job], list[Done]]:
    """The jobs ``batcher`` is given and how each ends, as the test sees them."""
    jobs: list[Job] = []
    ends: list[Done] = []
    submit = batcher.submit

    def watched(job: Job) -> None:
        emit = job.emit
        job.emit = lambda event: (ends.append(event) if isinstance(event, Done) else None, emit(event))[1]
        jobs.append(job)
        submit(job)

    monkeypatch.setattr(batcher, "submit", watched)
    return jobs, ends


def _ended_early_and_the_server_goes_on(url: str, ends: list[Done], headers: dict[str, str]) -> None:
    deadline = time.monotonic() + 60
    while not ends:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # a row never cancelled runs to its 400 tokens; the bound leaves room for a slow server to notice
    assert ends[0].finish_reason == "length" and ends[0].completion_tokens < 300, ends[0]
    reply = requests.post(url + "/v1/completions", json={"model": "tiny-llama", "prompt": PROMPTS[1],
                                                         "max_tokens": 5, "temperature": 0}, timeout=60,
                          headers=headers)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("engine_name", ["dschat", "loop"])
def test_a_client_that_disconnects_mid_stream_ends_its_rows_decoding_and_the_server_goes_on(llama, engine_name,
                                                                                          monkeypatch):
    steps = _slow_steps(monkeypatch)
    decoder = HybridEngineDecoder(llama, 4) if engine_name == "dschat" else LoopDecoder(llama)
    batcher = Batcher(decoder, max_batch_size=4, max_wait_s=0.005)
    jobs, ends = _watched(batcher, monkeypatch)
    key = "k3y" if engine_name == "loop" else None  # the API key's gate passes the stream and its end through
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    with serving_in_process(build_actor_app(llama, batcher, api_key=key)) as url:
        body = json.dumps({"model": "tiny-llama", "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0,
                           "stream": True}).encode()
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=60) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           + b"".join(f"{k}: {v}\r\n".encode() for k, v in auth.items())
                           + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            received = b""
            while b'"text": "' not in received.replace(b'"text": ""', b""):  # a first piece of text
                chunk = client.recv(4096)
                assert chunk, received
                received += chunk
        assert len(jobs) == 1
        _ended_early_and_the_server_goes_on(url, ends, auth)
    assert list(batcher.batch_sizes) == [1, 1]
    assert sum(follower is steps[0] for follower in steps) < 300  # the first batch stopped decoding, too


def test_a_client_that_disconnects_before_its_answer_that_is_not_streamed_ends_its_row(llama, monkeypatch):
    """Not streamed: the server asks every 0.25 s whether the client is still there; a gone client's
    row stops decoding."""
    steps = _slow_steps(monkeypatch)
    batcher = Batcher(LoopDecoder(llama), max_batch_size=4, max_wait_s=0.005)
    _, ends = _watched(batcher, monkeypatch)
    with serving_in_process(build_actor_app(llama, batcher)) as url:
        body = json.dumps({"model": "tiny-llama", "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0}).encode()
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=60) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            deadline = time.monotonic() + 60
            while len(steps) < 5:  # decoding has begun
                assert time.monotonic() < deadline
                time.sleep(0.02)
        _ended_early_and_the_server_goes_on(url, ends, {})


def test_an_api_key_guards_every_actor_route_but_health(llama):
    """``DSCHAT_SERVE_API_KEY``: 401 with OpenAI's error body without ``Authorization: Bearer <key>``
    or with another key; /health stays open; the right key is served."""
    batcher = Batcher(LoopDecoder(llama), max_batch_size=4, max_wait_s=0.005)
    with serving_in_process(build_actor_app(llama, batcher, api_key="k3y")) as url:
        ask = {"model": "tiny-llama", "prompt": PROMPTS[1], "max_tokens": 3, "temperature": 0}
        for headers in ({}, {"Authorization": "Bearer other"}, {"Authorization": "k3y"}):
            for reply in (requests.get(url + "/v1/models", headers=headers, timeout=30),
                          requests.post(url + "/v1/completions", json=ask, headers=headers, timeout=30)):
                assert reply.status_code == 401 and reply.headers["WWW-Authenticate"] == "Bearer"
                error = reply.json()["error"]
                assert error["code"] == "invalid_api_key" and "DSCHAT_SERVE_API_KEY" in error["message"]
        assert requests.get(url + "/health", timeout=30).json()["kind"] == "actor"
        good = requests.post(url + "/v1/completions", json=ask, headers={"Authorization": "Bearer k3y"}, timeout=60)
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 3
    assert list(batcher.batch_sizes) == [1]


def test_a_hybrid_engine_that_fails_its_warm_up_leaves_auto_on_the_loop_and_refuses_dschat(llama, monkeypatch):
    def broken(self) -> None:  # as a decode step that does not compile would
        raise RuntimeError("the decode step did not compile\nsecond line")

    monkeypatch.setattr(HybridEngineDecoder, "warm_up", broken)
    batcher, why = start_batcher(llama, "auto", 4, 0.005)
    assert isinstance(batcher.decoder, LoopDecoder)
    assert why.endswith(": dschat Hybrid Engine failed its warm-up (RuntimeError: the decode step did not compile)")
    out: list = []
    batcher.submit(Job(llama.encode(PROMPTS[0]), 3, (), GREEDY, out.append))
    deadline = time.monotonic() + 60
    while not (out and isinstance(out[-1], Done)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(UserError, match=r"^--decoding_engine dschat: dschat Hybrid Engine failed its warm-up .*; "
                                        r"use --decoding_engine loop$"):
        start_batcher(llama, "dschat", 4, 0.005)


def test_the_served_hybrid_engine_keeps_its_cpu_packed_weights_while_the_batch_size_stays(llama):
    decoder = HybridEngineDecoder(llama, 4)
    model = decoder.he.model

    def decode(prompts: list[str]) -> list[str]:
        outs: list[list] = [[] for _ in prompts]
        decoder.decode([Job(llama.encode(p), 6, (), GREEDY, out.append) for p, out in zip(prompts, outs)])
        return ["".join(e.text for e in out if isinstance(e, Delta)) for out in outs]

    first = decode(PROMPTS[:2])
    packed = model.packed
    assert model.packed_rows == 2 and packed
    assert decode(PROMPTS[:2]) == first and model.packed is packed  # the same batch size: packed once
    decode(PROMPTS[:1])
    assert model.packed_rows == 1 and model.packed is not packed  # another batch size: packed again
    decoder.he.refresh(llama.model)
    assert model.packed == {}  # new weights: the old copies are dropped
    assert decode(PROMPTS[:2]) == first
