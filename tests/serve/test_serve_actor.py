"""``python -m dschat.serve`` on an actor: a real server in a subprocess, asked by the official
``openai`` client (and by plain HTTP for what the client would not send). Greedy answers are the
model's own ``generate(do_sample=False)`` and step 3's own decoding of the same prompts (dschat's
Hybrid Engine, which ``auto`` serves tiny-opt with, and the sample loop of ``--decoding_engine loop``);
streams join to the plain answers and stop strings cut them, in both engines; bad requests (a prompt
the tokenizer cannot encode too) get OpenAI's error body and the server goes on; 32 concurrent clients
all get well-formed answers. In-process, in both engines: the batched decoding of prompts of different
lengths equals each prompt decoded alone, an answer ends on every EOS id of the model's generation
config as ``generate`` does, waiting jobs with equal settings share a batch, a cancelled job ends at its
next token."""
from __future__ import annotations

import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from dschat.errors import UserError
from dschat.models.registry import resolve_model_path
from dschat.rlhf.rollout.sampling import DecodingSettings
from dschat.rlhf.rollout.dschat_engine import DschatHybridEngine
from dschat.rlhf.rollout.sample_loop import sample_loop
from dschat.serve.actor import (Batcher, Delta, Done, Failed, HybridEngineDecoder, Job, LoopDecoder, load_actor_engine,
                                resolve_actor)

from helpers.serve import served_model

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPTS = ["Hello there, how are", "The capital of France is", "x", "One two three four five six seven eight"]
GREEDY = DecodingSettings(decoding="greedy")


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    """tiny-opt with a chat template in its tokenizer."""
    folder = tmp_path_factory.mktemp("serve_actor") / "chat-opt"
    shutil.copytree(resolve_model_path("tiny-opt"), folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def adapter_folder(tmp_path_factory):
    """A PEFT LoRA adapter (non-zero weights) on tiny-opt: its tokenizer (the base's) has no chat template."""
    base = resolve_model_path("tiny-opt")
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "v_proj"],
                        task_type="CAUSAL_LM")
    folder = tmp_path_factory.mktemp("serve_adapter") / "adapter"
    get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def server(chat_folder):
    with served_model(chat_folder, "--device", "cpu", "--max_batch_size", "8") as served:
        yield served


@pytest.fixture(scope="module")
def loop_server(chat_folder):
    with served_model(chat_folder, "--device", "cpu", "--max_batch_size", "8", "--decoding_engine", "loop") as served:
        yield served


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(params=["dschat", "loop"])
def engine_client(request):
    """``(engine, client)``: the ``auto`` server (dschat's Hybrid Engine on tiny-opt) or the ``loop`` one."""
    served = request.getfixturevalue("server" if request.param == "dschat" else "loop_server")
    return request.param, openai.OpenAI(base_url=served.api_url, api_key="unused", max_retries=0, timeout=120)


def _reference(model, tokenizer, ids: list[int], max_new_tokens: int) -> tuple[str, int, str]:
    """(text, completion tokens, finish reason) of ``model.generate(do_sample=False)`` on ``ids`` alone."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    answer = out[0, len(ids):].tolist()
    finish = "stop" if answer and answer[-1] == tokenizer.eos_token_id else "length"
    return tokenizer.decode(answer, skip_special_tokens=True), len(answer), finish


@pytest.fixture(scope="module")
def own(chat_folder):
    model = AutoModelForCausalLM.from_pretrained(chat_folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(chat_folder)
    return model, tokenizer


def test_models_lists_the_served_name(client, chat_folder):
    assert [m.id for m in client.models.list().data] == [str(chat_folder)]
    assert client.models.retrieve(str(chat_folder)).id == str(chat_folder)  # a folder's slashes in the path
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        client.models.retrieve("gpt-4o")


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_greedy_completion_is_the_models_own_generate(client, chat_folder, own, prompt):
    model, tokenizer = own
    reply = client.completions.create(model=str(chat_folder), prompt=prompt, max_tokens=12, temperature=0)
    ids = tokenizer(prompt)["input_ids"]
    text, count, finish = _reference(model, tokenizer, ids, 12)
    assert reply.object == "text_completion" and len(reply.choices) == 1
    assert reply.choices[0].text == text and text
    assert reply.choices[0].finish_reason == finish
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), count)
    assert reply.usage.total_tokens == len(ids) + count


def test_greedy_chat_is_the_models_own_generate_on_the_chat_template(client, chat_folder, own):
    model, tokenizer = own
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    reply = client.chat.completions.create(model=str(chat_folder), messages=messages, max_tokens=10, temperature=0)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert tokenizer.decode(ids).endswith("user: What is 2 + 2?\nassistant:")
    text, count, finish = _reference(model, tokenizer, ids, 10)
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content == text
    assert reply.choices[0].finish_reason == finish
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), count)


def test_a_list_of_prompts_gets_one_choice_each_in_order(client, chat_folder, own):
    model, tokenizer = own
    reply = client.completions.create(model=str(chat_folder), prompt=PROMPTS, max_tokens=8, temperature=0)
    expected = [_reference(model, tokenizer, tokenizer(p)["input_ids"], 8) for p in PROMPTS]
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == [e[0] for e in expected]
    assert reply.usage.completion_tokens == sum(e[1] for e in expected)
    assert reply.usage.prompt_tokens == sum(len(tokenizer(p)["input_ids"]) for p in PROMPTS)


def _step3_answers(model, tokenizer, prompts: list[str], max_new_tokens: int, engine: str) -> list[tuple[str, int, str]]:
    """(text, completion tokens, finish reason) of each prompt in step 3's own greedy decoding of the
    left-padded batch: dschat's Hybrid Engine or the sample loop."""
    rows = [tokenizer(p)["input_ids"] for p in prompts]
    width, pad, eos = max(map(len, rows)), tokenizer.pad_token_id, tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad():
        if engine == "dschat":
            he = DschatHybridEngine(model.config, decoding=GREEDY, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                    pad_token_id=pad)
            sequences = he.rollout(model, ids, mask, keep_logprobs=False).sequences
        else:
            sequences = sample_loop(model, ids, mask, decoding=GREEDY, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                    pad_token_id=pad, keep_logprobs=False).sequences
    answers = []
    for row in sequences[:, width:].tolist():
        count = row.index(eos) + 1 if eos in row else len(row)
        finish = "stop" if eos in row else "length"
        answers.append((tokenizer.decode(row[:count], skip_special_tokens=True), count, finish))
    return answers


def test_greedy_answers_are_step3s_own_decoding_in_both_engines(engine_client, chat_folder, own):
    engine, client = engine_client
    model, tokenizer = own
    reply = client.completions.create(model=str(chat_folder), prompt=PROMPTS, max_tokens=24, temperature=0)
    served = [(c.text, c.finish_reason) for c in reply.choices]
    expected = _step3_answers(model, tokenizer, PROMPTS, 24, engine)
    assert served == [(text, finish) for text, _, finish in expected]
    assert reply.usage.completion_tokens == sum(count for _, count, _ in expected)


def test_the_startup_line_names_the_decoding_engine_and_why(server, loop_server):
    line = next(x for x in server.output if x.startswith("serving actor"))
    assert line.endswith("decoding with dschat Hybrid Engine (eager decode step), layout opt (fused qkv, fc1): "
                         "its decode model covers this family"), line
    line = next(x for x in loop_server.output if x.startswith("serving actor"))
    assert line.endswith("decoding with dschat's sample loop (dschat/rlhf/rollout/sample_loop.py, on the Hugging "
                         "Face model): asked by --decoding_engine loop"), line


@pytest.mark.parametrize("max_tokens", [1, 7])
def test_max_tokens_ends_the_answer_in_both_engines(engine_client, chat_folder, own, max_tokens):
    _, client = engine_client
    model, tokenizer = own
    reply = client.completions.create(model=str(chat_folder), prompt=PROMPTS[2], max_tokens=max_tokens, temperature=0)
    expected = _reference(model, tokenizer, tokenizer(PROMPTS[2])["input_ids"], max_tokens)
    assert (reply.choices[0].text, reply.usage.completion_tokens, reply.choices[0].finish_reason) == expected
    assert expected[1:] == (max_tokens, "length")


def test_a_streamed_completion_joins_to_the_plain_answer(engine_client, chat_folder):
    _, client = engine_client
    kwargs = dict(model=str(chat_folder), prompt=PROMPTS[0], max_tokens=12, temperature=0)
    plain = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len([t for t in texts if t]) > 1  # it did stream, piece by piece
    assert "".join(texts) == plain.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == plain.choices[0].finish_reason and set(finishes[:-1]) == {None}
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert all(c.id == chunks[0].id and c.object == "text_completion" for c in chunks)


def test_a_streamed_chat_joins_to_the_plain_answer(client, chat_folder):
    kwargs = dict(model=str(chat_folder), messages=[{"role": "user", "content": "hi"}], max_tokens=12, temperature=0)
    plain = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_a_stream_is_server_sent_events_ending_with_done(server, chat_folder):
    # Greedy: a sampled answer (OpenAI's default temperature is 1) may end on EOS within 4 tokens.
    body = {"model": str(chat_folder), "prompt": "abc", "max_tokens": 4, "temperature": 0}
    plain = requests.post(server.api_url + "/completions", json=body, timeout=60).json()
    with requests.post(server.api_url + "/completions", json={**body, "stream": True}, stream=True,
                       timeout=60) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        events = [line for line in reply.iter_lines(decode_unicode=True) if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    finish = json.loads(events[-2][6:])["choices"][0]["finish_reason"]
    assert finish == plain["choices"][0]["finish_reason"] and finish in ("length", "stop")
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]) == plain["choices"][0]["text"]


def test_a_stop_string_cuts_the_text_before_it(engine_client, chat_folder):
    _, client = engine_client
    kwargs = dict(model=str(chat_folder), prompt=PROMPTS[1], max_tokens=16, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    stop = full[4:7]
    assert len(full) > 8 and stop.strip()
    cut = full[:full.find(stop)]
    for streamed in (False, True):
        for stops in (stop, ["never-there", stop]):
            if streamed:
                chunks = list(client.completions.create(**kwargs, stop=stops, stream=True))
                text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
            else:
                reply = client.completions.create(**kwargs, stop=stops)
                text, finish = reply.choices[0].text, reply.choices[0].finish_reason
                assert reply.usage.completion_tokens < 16
            assert (text, finish) == (cut, "stop"), (streamed, stops)


def test_two_stop_strings_cut_at_the_earlier_one(client, chat_folder):
    kwargs = dict(model=str(chat_folder), prompt=PROMPTS[1], max_tokens=16, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    # Both end at the same character, so they appear at the same token: the one that starts first cuts.
    at = next(i for i in range(len(full) - 2)
              if full[i + 1:i + 3].strip() and (full.find(full[i:i + 3]), full.find(full[i + 1:i + 3])) == (i, i + 1))
    reply = client.completions.create(**kwargs, stop=[full[at + 1:at + 3], full[at:at + 3]])
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == (full[:at], "stop")


def test_chat_max_completion_tokens_and_the_completions_default_of_16(client, server, chat_folder):
    messages = [{"role": "user", "content": "hi"}]
    capped = client.chat.completions.create(model=str(chat_folder), messages=messages, max_completion_tokens=3,
                                            temperature=0)
    with_max_tokens = client.chat.completions.create(model=str(chat_folder), messages=messages, max_tokens=3,
                                                     temperature=0)
    assert capped.usage.completion_tokens <= 3
    assert (capped.choices[0].message.content, capped.usage.completion_tokens) == (
        with_max_tokens.choices[0].message.content, with_max_tokens.usage.completion_tokens)
    # Without max_tokens a completion gets OpenAI's 16 tokens, not the model's whole context.
    body = {"model": str(chat_folder), "prompt": PROMPTS[0], "temperature": 0}
    reply = requests.post(server.api_url + "/completions", json=body, timeout=60).json()
    sixteen = client.completions.create(model=str(chat_folder), prompt=PROMPTS[0], max_tokens=16, temperature=0)
    assert reply["choices"][0]["text"] == sixteen.choices[0].text and reply["usage"]["completion_tokens"] <= 16


def test_the_sampling_settings_reach_the_decoder():
    from dschat.serve.openai_api import ChatRequest, CompletionRequest, _settings

    request = CompletionRequest(model="m", prompt="a", temperature=0.3, top_p=0.5, top_k=7)
    assert _settings(request) == DecodingSettings(decoding="sample", temperature=0.3, top_k=7, top_p=0.5)
    chat = ChatRequest(model="m", messages=[{"role": "user", "content": "a"}], temperature=1.5, top_k=-1)
    assert _settings(chat) == DecodingSettings(decoding="sample", temperature=1.5, top_k=0, top_p=1.0)
    assert _settings(CompletionRequest(model="m", prompt="a", temperature=0.0, top_p=0.5)) == GREEDY
    # Below 1e-5 the logits divided by it overflow: greedy, as vLLM (a 500 blaming the model before).
    assert _settings(CompletionRequest(model="m", prompt="a", temperature=1e-40)) == GREEDY
    assert _settings(CompletionRequest(model="m", prompt="a", temperature=2e-5)).decoding == "sample"


def test_a_field_sent_as_null_takes_its_default(client, chat_folder):
    """OpenAI's API takes ``null`` for its optional fields, and the ``openai`` client sends it for an
    argument passed as None: a 400 before."""
    kwargs = dict(model=str(chat_folder), max_tokens=4, temperature=None, top_p=None, n=None, stream=None,
                  presence_penalty=None, frequency_penalty=None, stop=None, seed=None)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **kwargs)
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens <= 4
    done = client.completions.create(prompt=PROMPTS[0], echo=None, best_of=None, **kwargs)
    assert done.usage.completion_tokens <= 4


def test_a_prompt_too_long_to_fit_whatever_its_tokens_is_refused_before_tokenising(server, chat_folder):
    """More characters than the positions times the longest token's string cannot fit: a 400 at once,
    without tokenising it (which holds the tokenizer the decoding worker shares, for seconds)."""
    from transformers import AutoTokenizer

    from dschat.serve.actor import ActorEngine

    tokenizer = AutoTokenizer.from_pretrained(chat_folder)
    engine = ActorEngine("m", str(chat_folder), None, tokenizer, max_positions=512, eos_ids=frozenset())
    longest = max(len(token) for token in tokenizer.get_vocab())
    assert engine.max_prompt_chars == 512 * longest
    too_long = "a" * (engine.max_prompt_chars + 1)
    for route, body, param in (("/completions", {"prompt": too_long}, "prompt"),
                               ("/completions", {"prompt": ["a", too_long]}, "prompt"),
                               ("/chat/completions", {"messages": [{"role": "user", "content": too_long[:-2]},
                                                                  {"role": "user", "content": "ab"}]}, "messages")):
        reply = requests.post(server.api_url + route, json={"model": str(chat_folder), **body}, timeout=60)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert (error["param"], error["code"]) == (param, "context_length_exceeded")
        assert "characters, more than the model's 512 positions can hold" in error["message"]
    assert server.proc.poll() is None


def test_a_seed_repeats_a_sampled_answer(client, chat_folder):
    kwargs = dict(model=str(chat_folder), prompt=PROMPTS[0], max_tokens=16, temperature=1.0, top_p=0.9,
                  extra_body={"top_k": 50})
    first = [client.completions.create(**kwargs, seed=s).choices[0].text for s in (1, 2)]
    assert [client.completions.create(**kwargs, seed=s).choices[0].text for s in (1, 2)] == first
    assert first[0] != first[1]
    for seed in (2**64 - 1, -2**63):  # the ends of what torch.manual_seed takes
        assert client.completions.create(**kwargs, seed=seed).usage.completion_tokens == 16
    # A seeded list of prompts: each answer is the one its prompt gets alone (decoded alone, never
    # sharing a random stream with what else was waiting).
    together = client.completions.create(**{**kwargs, "prompt": PROMPTS[:3]}, seed=3)
    alone = [client.completions.create(**{**kwargs, "prompt": p}, seed=3).choices[0].text for p in PROMPTS[:3]]
    assert [c.text for c in sorted(together.choices, key=lambda c: c.index)] == alone


@pytest.mark.parametrize("route, body, status, param", [
    ("/completions", b"{not json", 400, None),
    ("/completions", {"model": "M", "prompt": 5}, 400, "prompt"),
    ("/completions", {"model": "M", "prompt": "a", "max_tokens": "8"}, 400, "max_tokens"),
    ("/completions", {"model": "M", "prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ("/completions", {"model": "M", "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/completions", {"model": "M"}, 400, "prompt"),
    ("/completions", {"model": "M", "prompt": []}, 400, "prompt"),
    ("/completions", {"model": "M", "prompt": "a", "n": 2}, 400, "n"),
    ("/completions", {"model": "M", "prompt": "a", "logprobs": 3}, 400, "logprobs"),
    ("/completions", {"model": "M", "prompt": "a", "logprobs": 0}, 400, "logprobs"),  # each token's: not returned
    ("/completions", {"model": "M", "prompt": "a", "stop": [""]}, 400, "stop"),
    ("/completions", {"model": "M", "prompt": "a", "stop": ["x", "y", "z", "w", "v"]}, 400, "stop"),
    ("/completions", {"model": "M", "prompt": "a", "seed": 2**64}, 400, "seed"),
    ("/completions", {"model": "M", "prompt": "a", "seed": -2**63 - 1}, 400, "seed"),
    ("/completions", {"model": "M", "prompt": "word " * 300, "max_tokens": 300}, 400, "max_tokens"),
    ("/completions", {"model": "M", "prompt": "a", "max_tokens": 600}, 400, "max_tokens"),
    ("/completions", {"model": "other", "prompt": "a"}, 404, "model"),
    ("/completions", {"model": "M", "prompt": "a\ud800b"}, 400, "prompt"),
    ("/completions", {"model": "M", "prompt": ["a", "\udfff"]}, 400, "prompt"),
    ("/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages"),
    ("/chat/completions", {"model": "M", "messages": []}, 400, "messages"),
    ("/chat/completions", {"model": "M", "messages": [{"role": "wizard", "content": "a"}]}, 400, "messages"),
    ("/chat/completions", {"model": "M", "messages": [{"role": "user", "content": 1}]}, 400, "messages"),
    ("/nowhere", {}, 404, None),
])
def test_a_bad_request_gets_an_openai_error_and_the_server_goes_on(server, chat_folder, route, body, status, param):
    if isinstance(body, dict) and body.get("model") == "M":
        body["model"] = str(chat_folder)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = requests.post(server.api_url + route, data=data, headers={"Content-Type": "application/json"}, timeout=60)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    ok = requests.post(server.api_url + "/completions", json={"model": str(chat_folder), "prompt": "a",
                                                               "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None
    assert server.proc.poll() is None


def test_text_the_tokenizer_cannot_encode_is_a_400_naming_it(server, chat_folder):
    """A lone surrogate (JSON's ``"\\ud800"`` without its pair: no Unicode text) in a prompt or a message
    is a 400 in OpenAI's error format whose one-line message names where it is; no traceback in the log."""
    for route, body, start in (
            ("/completions", {"prompt": "a\ud800b"}, "prompt holds a lone surrogate, U+D800 at character 1"),
            ("/completions", {"prompt": ["a", "\udfff"]}, "prompt[1] holds a lone surrogate, U+DFFF at character 0"),
            ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": [
                {"type": "text", "text": "x"}, {"type": "text", "text": "\ud800"}]}]},
             "messages[1].content holds a lone surrogate, U+D800 at character 1")):
        reply = requests.post(server.api_url + route, data=json.dumps({"model": str(chat_folder), **body}),
                              headers={"Content-Type": "application/json"}, timeout=60)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["message"].startswith(start) and "\n" not in error["message"], error
        assert error["type"] == "invalid_request_error"
    assert server.proc.poll() is None and not any("Traceback" in line for line in server.output)


def _wait_for_load(url: str, load: dict[str, int], limit_s: float = 60.0) -> dict:
    """The actor server's ``GET /health`` once it reports ``load`` (polled; an AssertionError after ``limit_s``)."""
    deadline = time.monotonic() + limit_s
    while (health := requests.get(url + "/health", timeout=10).json()) | load != health:
        assert time.monotonic() < deadline, f"the server never reported {load}: {health}"
        time.sleep(0.01)
    return health


def test_health_reports_the_jobs_waiting_and_decoding(chat_folder):
    """An actor's ``GET /health`` counts the prompts waiting for a batch and those being decoded (two
    in a batch: the first alone, or with the second, then two more; or two, then two)."""
    with served_model(chat_folder, "--device", "cpu", "--max_batch_size", "2", "--max_wait_ms", "0") as served:
        assert requests.get(served.url + "/health", timeout=10).json() == {
            "status": "ok", "model": str(chat_folder), "kind": "actor", "waiting": 0, "decoding": 0}
        body = {"model": str(chat_folder), "prompt": PROMPTS[0], "max_tokens": 480, "temperature": 0}
        with ThreadPoolExecutor(4) as pool:
            replies = [pool.submit(requests.post, served.api_url + "/completions", json={**body, "prompt": p},
                                   timeout=300) for p in PROMPTS]
            _wait_for_load(served.url, {"decoding": 2})
            assert all(reply.result().status_code == 200 for reply in replies)
        assert _wait_for_load(served.url, {"waiting": 0, "decoding": 0})["kind"] == "actor"


def test_requests_open_when_the_server_stops_get_a_503_with_openai_error_body(chat_folder):
    """SIGTERM while one answer streams and two more wait: each is answered at once with 503 and
    OpenAI's error body (the stream: an error chunk, then [DONE]), not cancelled at the grace limit
    with a plain-text 500 and a traceback in the log."""
    import signal

    with served_model(chat_folder, "--device", "cpu", "--max_batch_size", "1", "--max_wait_ms", "0") as served:
        body = {"model": str(chat_folder), "prompt": PROMPTS[0], "max_tokens": 480, "temperature": 0}
        stream = requests.post(served.api_url + "/completions", json={**body, "stream": True}, stream=True,
                               timeout=120)
        lines = stream.iter_lines()
        assert next(line for line in lines if line).startswith(b"data: {")  # decoding has begun
        with ThreadPoolExecutor(2) as pool:
            waiting = [pool.submit(requests.post, served.api_url + "/completions", json={**body, "prompt": p},
                                   timeout=120) for p in PROMPTS[1:3]]
            # Both wait behind the stream (one prompt per batch), which still decodes: a fixed sleep let
            # the stream end first on a quiet machine.
            _wait_for_load(served.url, {"waiting": 2, "decoding": 1})
            served.proc.send_signal(signal.SIGTERM)
            replies = [future.result() for future in waiting]
        rest = [line for line in lines if line]
        served.proc.wait(timeout=120)
    for reply in replies:
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["message"].startswith("the server is shutting down")
    errors = [json.loads(line[6:]) for line in rest if line.startswith(b"data: {") and b'"error"' in line]
    assert errors and errors[0]["error"]["message"].startswith("the server is shutting down") and rest[-1] == b"data: [DONE]"
    assert not any("Traceback" in line or "CancelledError" in line for line in served.output)


def test_a_wrong_method_gets_an_openai_error(server):
    reply = requests.get(server.api_url + "/completions", timeout=30)
    assert reply.status_code == 405 and reply.json()["error"]["message"] == "Method Not Allowed"


def test_a_step3_output_root_means_its_actor_and_a_folder_without_a_model_is_refused(tmp_path, chat_folder):
    (tmp_path / "step3").mkdir()
    shutil.copytree(chat_folder, tmp_path / "step3" / "actor")
    assert resolve_actor(str(tmp_path / "step3")) == str(tmp_path / "step3" / "actor")
    with pytest.raises(UserError, match="is not a model folder"):
        resolve_actor(str(tmp_path))


def test_the_openai_client_raises_on_a_4xx(client, chat_folder):
    with pytest.raises(openai.BadRequestError, match="n=3 is not supported"):
        client.completions.create(model=str(chat_folder), prompt="a", n=3)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-4o", prompt="a")


def test_32_concurrent_clients_all_get_well_formed_answers(client, server, chat_folder, own):
    """Mixed requests (plain and streamed, completions and chat, greedy and sampled) from 32 threads at
    once: none is dropped, every answer is well formed, and each greedy answer is the one it gets alone."""
    model, tokenizer = own
    name = str(chat_folder)
    start = threading.Barrier(32)

    def ask(i: int) -> tuple[int, str, str, int]:
        prompt, max_tokens = PROMPTS[i % 4], 4 + i % 5
        temperature = 0 if i % 2 == 0 else 0.8
        start.wait()
        if i % 4 < 2:
            if i % 8 < 4:
                reply = client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens,
                                                  temperature=temperature)
                return i, reply.choices[0].text, reply.choices[0].finish_reason, reply.usage.completion_tokens
            chunks = list(client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens,
                                                    temperature=temperature, stream=True,
                                                    stream_options={"include_usage": True}))
            return (i, "".join(c.choices[0].text for c in chunks if c.choices),
                    chunks[-2].choices[0].finish_reason, chunks[-1].usage.completion_tokens)
        reply = client.chat.completions.create(model=name, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=max_tokens, temperature=temperature)
        return i, reply.choices[0].message.content, reply.choices[0].finish_reason, reply.usage.completion_tokens

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, range(32)))
    assert sorted(a[0] for a in answers) == list(range(32))
    for i, text, finish, count in answers:
        max_tokens = 4 + i % 5
        assert isinstance(text, str) and finish in ("stop", "length") and 1 <= count <= max_tokens
        assert (finish == "length") == (count == max_tokens) or finish == "stop"
        if i % 2 == 0 and i % 4 < 2:  # greedy completions: what the prompt gets alone
            ids = tokenizer(PROMPTS[i % 4])["input_ids"]
            assert (text, count, finish) == _reference(model, tokenizer, ids, max_tokens), i
    assert server.proc.poll() is None


def test_an_adapter_folder_is_served_merged_and_refused_for_chat(adapter_folder):
    base = resolve_model_path("tiny-opt")
    tokenizer = AutoTokenizer.from_pretrained(base)
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                       str(adapter_folder)).merge_and_unload().eval()
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    ids = tokenizer(PROMPTS[0])["input_ids"]
    expected = _reference(merged, tokenizer, ids, 12)
    assert expected != _reference(plain, tokenizer, ids, 12)  # the adapter changes the answer
    with served_model(adapter_folder, "--device", "cpu") as served:
        client = openai.OpenAI(base_url=served.api_url, api_key="unused", max_retries=0, timeout=120)
        reply = client.completions.create(model=str(adapter_folder), prompt=PROMPTS[0], max_tokens=12, temperature=0)
        assert (reply.choices[0].text, reply.usage.completion_tokens, reply.choices[0].finish_reason) == expected
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError, match="has no chat template") as err:
                client.chat.completions.create(model=str(adapter_folder), messages=[{"role": "user", "content": "hi"}],
                                               stream=stream)
            assert err.value.status_code == 400 and err.value.body["code"] == "no_chat_template"
        assert requests.get(served.url + "/health", timeout=10).json()["kind"] == "actor"


# ------------------------------------------------------------------------------------------------
# In-process: the batch decoding and the batcher
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    return load_actor_engine("tiny-llama", device="cpu")


@pytest.fixture(params=["dschat", "loop"])
def decoder(request, engine):
    return HybridEngineDecoder(engine, 8) if request.param == "dschat" else LoopDecoder(engine)


def _job(engine, prompt: str, max_tokens: int, out: list, settings: DecodingSettings = GREEDY) -> Job:
    return Job(engine.encode(prompt), max_tokens, (), settings, out.append)


def _text(events: list) -> tuple[str, Done]:
    return "".join(e.text for e in events if isinstance(e, Delta)), events[-1]


def test_a_left_padded_batch_decodes_as_each_prompt_alone(engine, decoder):
    """Prompts of different lengths and max_tokens in one batch (tiny-llama: rotary positions from the
    mask) give each prompt's own generate answer."""
    outs = [[] for _ in PROMPTS]
    jobs = [_job(engine, p, 5 + 3 * i, out) for i, (p, out) in enumerate(zip(PROMPTS, outs))]
    decoder.decode(jobs)
    for i, (prompt, events) in enumerate(zip(PROMPTS, outs)):
        text, done = _text(events)
        assert isinstance(done, Done) and sum(isinstance(e, Done) for e in events) == 1
        expected = _reference(engine.model, engine.tokenizer, engine.encode(prompt), 5 + 3 * i)
        assert (text, done.completion_tokens, done.finish_reason) == expected, prompt


@pytest.fixture(scope="module")
def eot_folder(engine, tmp_path_factory):
    """tiny-llama whose generation_config.json ends an answer on EOS or on another id (as a chat
    model's end-of-turn id): the third token greedy decoding writes for PROMPTS[1]. Returns the
    folder and that id."""
    ids = engine.encode(PROMPTS[1])
    with torch.no_grad():
        out = engine.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    do_sample=False, max_new_tokens=3, pad_token_id=engine.tokenizer.pad_token_id)
    answer = out[0, len(ids):].tolist()
    end, eos = answer[2], engine.tokenizer.eos_token_id
    assert end not in answer[:2] and end != eos
    folder = tmp_path_factory.mktemp("serve_eot") / "eot-llama"
    shutil.copytree(resolve_model_path("tiny-llama"), folder)
    config = GenerationConfig.from_pretrained(folder)
    config.eos_token_id = [eos, end]
    config.save_pretrained(folder)
    return folder, end


@pytest.mark.parametrize("engine_name", ["dschat", "loop"])
def test_an_answer_ends_on_every_eos_id_of_the_generation_config_as_generate_does(eot_folder, engine_name):
    folder, end = eot_folder
    eot = load_actor_engine(str(folder), device="cpu")
    decoder = HybridEngineDecoder(eot, 8) if engine_name == "dschat" else LoopDecoder(eot)
    outs = [[] for _ in PROMPTS]
    decoder.decode([_job(eot, p, 8, out) for p, out in zip(PROMPTS, outs)])
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt, events in zip(PROMPTS, outs):
        ids = eot.encode(prompt)
        with torch.no_grad():  # generate stops on every id of the folder's generation config
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=8, pad_token_id=eot.tokenizer.pad_token_id)
        answer = out[0, len(ids):].tolist()
        ended = answer[-1] in (end, eot.tokenizer.eos_token_id)
        expected = (eot.decode(answer[:-1] if ended else answer), len(answer), "stop" if ended else "length")
        text, done = _text(events)
        assert (text, done.completion_tokens, done.finish_reason) == expected, prompt
    assert _text(outs[1])[1].completion_tokens == 3 and _text(outs[1])[1].finish_reason == "stop"
    assert eot.eos_ids == {eot.tokenizer.eos_token_id, end}


def test_waiting_jobs_with_equal_settings_share_a_batch_others_wait(engine, decoder):
    batcher = Batcher(decoder, max_batch_size=3, max_wait_s=0.5)
    outs = [[] for _ in range(5)]
    sampled = DecodingSettings(decoding="sample", temperature=0.7)
    settings = [GREEDY, sampled, GREEDY, GREEDY, GREEDY]
    jobs = [_job(engine, "Hello", 3, out, s) for out, s in zip(outs, settings)]
    with batcher._ready:  # re-entrant: the worker takes no job until all five wait
        for job in jobs:
            batcher.submit(job)
    deadline = time.monotonic() + 120
    while not all(out and isinstance(out[-1], Done) for out in outs):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # the first greedy job waits and fills its batch of 3 with greedy ones; then the sampled one; then the rest
    assert list(batcher.batch_sizes) == [3, 1, 1]
    greedy = {_text(outs[i])[0] for i in (0, 2, 3, 4)}
    assert len(greedy) == 1


def test_a_batch_that_cannot_be_chosen_answers_its_requests_and_the_worker_goes_on(engine, decoder, monkeypatch):
    """An exception while choosing a batch ended the only decoding thread: every later request hung
    while /health said ok. The waiting requests are answered 500, and the next ones decode."""
    import dschat.serve.actor as actor

    batcher = Batcher(decoder, max_batch_size=2, max_wait_s=0.0)
    real, calls = actor.select_batch, []

    def failing_once(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise OverflowError("timestamp out of range for platform time_t")
        return real(*a, **k)

    monkeypatch.setattr(actor, "select_batch", failing_once)
    first, second = [], []
    batcher.submit(_job(engine, "Hello", 3, first))
    deadline = time.monotonic() + 60
    while not first:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert first == [Failed("batching failed: OverflowError: timestamp out of range for platform time_t")]
    batcher.submit(_job(engine, "Hello", 3, second))
    while not (second and isinstance(second[-1], Done)):
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_short_name_wins_over_a_same_named_folder_in_the_working_directory(tmp_path, chat_folder, monkeypatch):
    """As every other tool takes them: ./tiny-opt is the folder, tiny-opt the registry's model (a
    folder of that name in a directory others can write served their weights under the name)."""
    shutil.copytree(chat_folder, tmp_path / "tiny-opt" / "actor")
    monkeypatch.chdir(tmp_path)
    assert resolve_actor("tiny-opt") == resolve_model_path("tiny-opt")
    assert Path(resolve_actor("./tiny-opt")).resolve() == tmp_path / "tiny-opt" / "actor"


def test_a_cancelled_job_ends_at_its_next_token_and_the_others_go_on(engine, decoder):
    events: list = []
    other: list = []

    def emit(event) -> None:  # the client goes away after the first piece of text
        events.append(event)
        jobs[0].cancelled = True

    ids = engine.encode(PROMPTS[0])
    jobs = [Job(ids, 40, (), GREEDY, emit), _job(engine, PROMPTS[1], 12, other)]
    decoder.decode(jobs)
    with torch.no_grad():
        answer = engine.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                       do_sample=False, max_new_tokens=40,
                                       pad_token_id=engine.tokenizer.pad_token_id)[0, len(ids):].tolist()
    # The first piece is sent once the answer decodes to whole characters; the row ends on the token after it.
    first = next(n for n in range(1, len(answer) + 1) if engine.decode(answer[:n]).rstrip("\ufffd"))
    ended = answer[:first + 1]
    assert len(ended) < 40 and not set(ended) & engine.eos_ids  # so it can only have ended on the cancel
    text, done = _text(events)
    assert isinstance(done, Done) and sum(isinstance(e, Done) for e in events) == 1
    assert (text, done.completion_tokens, done.finish_reason) == (engine.decode(ended), len(ended), "length")
    expected = _reference(engine.model, engine.tokenizer, engine.encode(PROMPTS[1]), 12)
    text, finished = _text(other)
    assert (text, finished.completion_tokens, finished.finish_reason) == expected


def test_a_chat_answer_ends_at_the_special_token_its_template_closes_turns_with(engine, tmp_path):
    """A template whose assistant turns end with a special token that is neither the tokenizer's EOS nor in
    the generation config (a base model's tokenizer with ChatML's <|im_end|>): a chat answer ends there
    (``stop``, the token counted, not shown), as the chat CLI's does; a completion goes on past it."""
    messages = [{"role": "user", "content": "The capital of France is"}]
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if m['role'] == 'assistant' %}CLOSE"
                "{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny-llama"))
    tokenizer.chat_template = template
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    with torch.no_grad():
        out = engine.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    do_sample=False, max_new_tokens=8, pad_token_id=tokenizer.pad_token_id)
    answer = out[0, len(ids):].tolist()
    close = answer[2]  # the third token greedy decoding writes becomes the template's close of turn
    assert close not in answer[:2] and tokenizer.eos_token_id not in answer[:3]
    folder = tmp_path / "turn-llama"
    shutil.copytree(resolve_model_path("tiny-llama"), folder)
    piece = tokenizer.convert_ids_to_tokens(close)
    tokenizer.add_special_tokens({"additional_special_tokens": [piece]})
    assert tokenizer.convert_tokens_to_ids(piece) == close and len(tokenizer) == engine.model.config.vocab_size
    tokenizer.chat_template = template.replace("CLOSE", piece)
    tokenizer.save_pretrained(folder)
    with served_model(folder, "--device", "cpu") as served:
        client = openai.OpenAI(base_url=served.api_url, api_key="unused", max_retries=0, timeout=120)
        chat = client.chat.completions.create(model=str(folder), messages=messages, max_tokens=8, temperature=0)
        text = client.completions.create(model=str(folder), prompt=tokenizer.decode(ids), max_tokens=8,
                                         temperature=0)
    assert (chat.choices[0].finish_reason, chat.usage.completion_tokens) == ("stop", 3)
    assert chat.choices[0].message.content == tokenizer.decode(answer[:2], skip_special_tokens=True)
    assert text.usage.completion_tokens > 3 or text.choices[0].finish_reason == "length"
