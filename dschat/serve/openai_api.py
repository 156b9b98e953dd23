"""OpenAI-compatible routes for a served actor: ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (each with ``stream: true`` too), answered by a :class:`Batcher`.

Bodies are checked by pydantic, strictly (a number is not taken for a string, nor a string for a
number); fields OpenAI defines that are not listed in :class:`_Common` and the two request models are
ignored. Every refusal is an OpenAI error body ``{"error": {"message", "type", "param", "code"}}``:
400 for a bad body (not JSON, a wrong type, a value out of range, ``n`` other than 1, more than
:data:`MAX_STOPS` stop strings, a prompt or a message the tokenizer cannot encode -- a lone surrogate,
such as JSON's ``"\\ud800"`` --, a prompt that leaves no room for ``max_tokens`` within the model's
positions, or has more characters than those positions can hold (checked before tokenising), chat on
a tokenizer without a chat template, an unsupported option such as ``logprobs``), 404 for an unknown
model name or route, 405 for a wrong method, 500 when decoding fails. A streamed answer is server-sent events, one
``data: {chunk}`` per piece of text in OpenAI's chunk format (the last chunk of a choice carries its
``finish_reason``), then ``data: [DONE]``. A field sent as ``null`` takes its default; a temperature
below :data:`GREEDY_BELOW` decodes greedily. Prompts are tokenised in a worker thread.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from dschat.rlhf.rollout.sampling import DecodingSettings
from dschat.serve.actor import ActorEngine, Batcher, Delta, Done, Failed, Job
from dschat.serve.reward_scorer import UnencodableText, check_unicode

__all__ = ["ApiError", "ChatRequest", "CompletionRequest", "add_actor_routes", "error_body"]


class ApiError(Exception):
    """A refused request: HTTP ``status`` with an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


#: The seeds ``torch.manual_seed`` takes (a signed or an unsigned 64-bit integer); others are a 400.
SEED_MIN, SEED_MAX = -2**63, 2**64 - 1
#: The most stop strings a request may give (OpenAI's limit): each is looked for at every token.
MAX_STOPS = 4
#: A temperature below this decodes greedily (as vLLM): dividing the logits by it would overflow.
GREEDY_BELOW = 1e-5


class _StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    """The fields both endpoints take."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="0: greedy decoding")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, description="an extension; 0 or -1: off")
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX, description="what torch.manual_seed takes")
    stream: bool = False
    stream_options: _StreamOptions | None = None
    # OpenAI options this server does not implement: refused unless left at their defaults.
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """A field given as ``null`` takes its default, as OpenAI's API (the ``openai`` client sends
        ``null`` for an argument passed as ``None``)."""
        return {key: value for key, value in data.items() if value is not None} if isinstance(data, dict) else data


class CompletionRequest(_Common):
    prompt: str | list[str] = Field(description="one prompt, or several (one choice each)")
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class _Part(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class _Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[_Part]

    def as_template_message(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(_Common):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None


def _settings(request: _Common) -> DecodingSettings:
    if request.temperature < GREEDY_BELOW:
        return DecodingSettings(decoding="greedy")
    return DecodingSettings(decoding="sample", temperature=request.temperature, top_k=max(request.top_k, 0),
                            top_p=request.top_p)


def _refuse_unsupported(request: _Common) -> None:
    if request.n != 1:
        raise ApiError(400, f"n={request.n} is not supported: this server returns one choice per prompt (n=1)", "n")
    # logprobs: 0 asks the completions route for each token's log-probability (no alternatives), which
    # is not returned either: only null / false pass (0 == False in Python, so compare by identity).
    unsupported = {"logprobs": not (request.logprobs is None or request.logprobs is False),
                   "logit_bias": bool(request.logit_bias),
                   "presence_penalty": request.presence_penalty != 0.0,
                   "frequency_penalty": request.frequency_penalty != 0.0}
    if isinstance(request, CompletionRequest):
        unsupported |= {"echo": request.echo, "best_of": request.best_of not in (None, 1),
                        "suffix": request.suffix is not None}
    if isinstance(request, ChatRequest):
        unsupported["tools"] = bool(request.tools)
    for name, given in unsupported.items():
        if given:
            raise ApiError(400, f"{name} is not supported by this server; leave it out", name)


def _stops(request: _Common) -> tuple[str, ...]:
    stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if any(not stop for stop in stops):
        raise ApiError(400, "stop strings must not be empty", "stop")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"{len(stops)} stop strings: at most {MAX_STOPS} (as OpenAI's API)", "stop")
    return tuple(stops)


class _Answer:
    """The jobs of one request, whose worker reports arrive on one asyncio queue as ``(index, event)``."""

    def __init__(self, engine: ActorEngine, batcher: Batcher, request: _Common, prompts: list[list[int]],
                 max_tokens: int | None, chat: bool) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Delta | Done | Failed]] = asyncio.Queue()
        stops, settings = _stops(request), _settings(request)
        self.jobs = []
        for index, ids in enumerate(prompts):
            if not ids:
                raise ApiError(400, "the prompt is empty (no tokens); give some text", "prompt")
            room = engine.max_positions - len(ids)
            wanted = max_tokens if max_tokens is not None else room
            if wanted > room or room < 1:
                raise ApiError(400, f"the prompt has {len(ids)} tokens and max_tokens is {wanted}: together more "
                                    f"than the model's {engine.max_positions} positions; shorten the prompt or "
                                    "lower max_tokens", "max_tokens", "context_length_exceeded")
            # No max_tokens: as many as fit, which its batch may cap (dschat.serve.actor.select_batch).
            self.jobs.append(Job(ids, wanted, stops, settings, self._emitter(index), request.seed,
                                 fill=max_tokens is None, turn_end=engine.turn_end if chat else None))
        for job in self.jobs:
            batcher.submit(job)

    def _emitter(self, index: int) -> Any:
        def emit(event: Delta | Done | Failed) -> None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))
        return emit

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancelled = True

    async def events(self) -> AsyncIterator[tuple[int, Delta | Done | Failed]]:
        """Every report until each job has ended (Done or Failed)."""
        open_jobs = set(range(len(self.jobs)))
        while open_jobs:
            index, event = await self.queue.get()
            if index not in open_jobs:
                continue
            if not isinstance(event, Delta):
                open_jobs.discard(index)
            yield index, event


def _usage(done: list[Done]) -> dict[str, int]:
    prompt, completion = sum(d.prompt_tokens for d in done), sum(d.completion_tokens for d in done)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


#: Seconds between checks whether the client of a request that is not streamed has gone away.
DISCONNECT_POLL_SECONDS = 0.25


async def _collect(answer: _Answer, client: Request) -> tuple[list[str], list[Done]]:
    """The texts and ends of a request that is not streamed. While they decode, ``client`` is asked
    every :data:`DISCONNECT_POLL_SECONDS` whether it has gone away; if it has, the rows stop decoding
    at their next token (as a stream's do when its client goes)."""
    texts, done = [""] * len(answer.jobs), [None] * len(answer.jobs)

    async def watch() -> None:
        while not await client.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_SECONDS)
        answer.cancel()

    watcher = asyncio.create_task(watch())
    try:
        async for index, event in answer.events():
            if isinstance(event, Failed):
                raise ApiError(event.status, event.message)
            if isinstance(event, Delta):
                texts[index] += event.text
            else:
                done[index] = event
    finally:  # a failure, or the client went away: rows still decoding stop at their next token
        watcher.cancel()
        answer.cancel()
    return texts, done  # type: ignore[return-value]


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def _stream(answer: _Answer, head: dict[str, Any], chat: bool, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events of ``answer``: chunks in OpenAI's format, an optional usage chunk, ``[DONE]``."""
    def chunk(index: int, text: str | None, finish: str | None, first: bool = False) -> str:
        if chat:
            delta = ({"role": "assistant", "content": ""} if first else {"content": text} if text is not None else {})
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
        return _sse({**head, "choices": [choice]})

    done: list[Done] = []
    try:
        if chat:
            for index in range(len(answer.jobs)):
                yield chunk(index, None, None, first=True)
        async for index, event in answer.events():
            if isinstance(event, Delta):
                yield chunk(index, event.text, None)
            elif isinstance(event, Done):
                done.append(event)
                yield chunk(index, None, event.finish_reason)
            else:
                answer.cancel()
                yield _sse(error_body(event.message, event.status))
                break
        else:
            if include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(done)})
        yield "data: [DONE]\n\n"
    finally:  # the client went away (or the stream ended): rows still decoding stop at their next token
        answer.cancel()


def add_actor_routes(app: FastAPI, engine: ActorEngine, batcher: Batcher) -> None:
    """The three routes above and the error handlers that give every refusal OpenAI's error body."""

    @app.exception_handler(ApiError)
    async def api_error(_: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(error_body(err.message, err.status, err.param, err.code), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid body", "type": ""}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON ({first['msg']})"
        else:
            message = f"invalid request body: {'.'.join(loc) or 'body'}: {first['msg']}"
        return JSONResponse(error_body(message, 400, loc[0] if loc and first.get("type") != "json_invalid" else None),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(err.detail), err.status_code), status_code=err.status_code,
                            headers=getattr(err, "headers", None))

    created = int(time.time())

    served = {"id": engine.name, "object": "model", "created": created, "owned_by": "dschat"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [served]}

    @app.get("/v1/models/{model_id:path}")  # the id is a folder: slashes in it
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != engine.name:
            raise ApiError(404, f"model {model_id!r} is not served here; this server serves {engine.name!r}",
                           "model", "model_not_found")
        return served

    def check_model(request: _Common) -> None:
        if request.model != engine.name:
            raise ApiError(404, f"model {request.model!r} is not served here; this server serves {engine.name!r}",
                           "model", "model_not_found")
        _refuse_unsupported(request)

    async def respond(request: _Common, prompts: list[list[int]], max_tokens: int | None, chat: bool,
                      client: Request) -> Any:
        answer = _Answer(engine, batcher, request, prompts, max_tokens, chat)
        kind = "chat.completion" if chat else "text_completion"
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": engine.name}
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return StreamingResponse(_stream(answer, {**head, "object": kind + (".chunk" if chat else "")}, chat,
                                             include_usage), media_type="text/event-stream")
        texts, done = await _collect(answer, client)
        if chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                        "finish_reason": d.finish_reason} for i, (text, d) in enumerate(zip(texts, done))]
        else:
            choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": d.finish_reason}
                       for i, (text, d) in enumerate(zip(texts, done))]
        return {**head, "object": kind, "choices": choices, "usage": _usage(done)}

    def check_length(characters: int, name: str, param: str) -> None:
        """A 400 for text too long to fit in the model's positions whatever its tokens, before the
        tokenizer (which the decoding worker shares) spends seconds on it."""
        if characters > engine.max_prompt_chars:
            raise ApiError(400, f"{name} has {characters} characters, more than the model's {engine.max_positions} "
                                "positions can hold; shorten it", param, "context_length_exceeded")

    def encode_prompt(prompt: str, name: str) -> list[int]:
        """``prompt``'s ids; a 400 (param ``prompt``) whose message starts with ``name`` (``prompt``, or
        ``prompt[i]`` of a list) when it is too long or the tokenizer cannot encode it."""
        check_length(len(prompt), name, "prompt")
        try:
            return engine.encode(prompt)
        except UnencodableText as why:
            raise ApiError(400, f"{name} {why}", "prompt") from None

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, client: Request) -> Any:
        check_model(request)
        prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
        if not prompts:
            raise ApiError(400, "prompt is an empty list; give at least one prompt", "prompt")
        max_tokens = request.max_tokens if request.max_tokens is not None else 16  # OpenAI's default
        names = ["prompt"] if isinstance(request.prompt, str) else [f"prompt[{i}]" for i in range(len(prompts))]
        ids = await run_in_threadpool(lambda: [encode_prompt(p, name) for p, name in zip(prompts, names)])
        return await respond(request, ids, max_tokens, chat=False, client=client)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatRequest, client: Request) -> Any:
        check_model(request)
        if not engine.has_chat_template:
            raise ApiError(400, f"model {engine.name!r} has no chat template (its tokenizer defines none), so it "
                                "cannot chat; use /v1/completions with a plain prompt", "messages",
                           "no_chat_template")
        messages = [m.as_template_message() for m in request.messages]
        for index, message in enumerate(messages):
            try:
                check_unicode(message["content"])
            except UnencodableText as why:
                raise ApiError(400, f"messages[{index}].content {why}", "messages") from None
        check_length(sum(len(m["content"]) for m in messages), "messages", "messages")
        try:
            ids = await run_in_threadpool(engine.encode_chat, messages)
        except Exception as err:  # noqa: BLE001 - a template's own refusal (roles out of order, ...)
            raise ApiError(400, f"the chat template refused these messages: {err}", "messages") from None
        max_tokens = request.max_completion_tokens or request.max_tokens
        return await respond(request, [ids], max_tokens, chat=True, client=client)
