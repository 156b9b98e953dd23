"""The HTTP app of ``python -m dschat.serve`` (FastAPI; run by uvicorn in :mod:`dschat.serve.cli`).

Routes:

- ``GET /health``: ``{"status": "ok", "model": folder, "kind": "reward"}`` (an actor:
  ``{"status": "ok", "model": name, "kind": "actor", "waiting": n, "decoding": n}``, its jobs waiting
  and being decoded now).
- ``POST /get_reward``: OpenRLHF's remote reward protocol. Body ``{"query": [str, ...], "prompts":
  [str, ...], "labels": [str, ...]}`` (``prompts`` and ``labels`` optional, unused by a reward model);
  reply ``{"rewards": [float, ...]}``, one per query, in order. A body that is not JSON, has a field of
  the wrong type, an empty ``query`` list, a query of no tokens (``{"detail": "query[i] has no
  tokens ..."}``) or a query the tokenizer cannot encode (a lone surrogate such as JSON's
  ``"\\ud800"``: ``{"detail": "query[i] holds a lone surrogate ..."}``) gets HTTP 422
  ``{"detail": ...}``; an unknown route 404 and a wrong method 405, both JSON. The server goes on
  serving after each.

:func:`build_app` serves a reward model; :func:`build_actor_app` an actor, on the OpenAI-compatible
routes of :mod:`dschat.serve.openai_api` (``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``), whose refusals carry OpenAI's error body instead of ``{"detail": ...}``.

With an ``api_key`` (the server reads ``DSCHAT_SERVE_API_KEY``) every route but ``GET /health``
answers HTTP 401 unless the request carries ``Authorization: Bearer <api_key>`` (what the ``openai``
client sends for its ``api_key``, and step 3's ``--reward_url`` client when the variable is set).
"""
from __future__ import annotations

import asyncio
import hmac
import sys
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from dschat.serve.actor import ActorEngine, Batcher
from dschat.serve.openai_api import add_actor_routes, error_body
from dschat.serve.reward_scorer import BadQuery, NonFiniteScore, RewardScorer

__all__ = ["ApiKeyGate", "RewardRequest", "RewardReply", "build_actor_app", "build_app", "add_reward_routes"]

#: The one route that answers without the API key (a liveness probe; it names the model and its kind).
OPEN_PATH = "/health"
_WRONG_KEY = "a missing or wrong API key: send the header Authorization: Bearer <DSCHAT_SERVE_API_KEY>"


class ApiKeyGate:
    """ASGI middleware: an HTTP request to any path but :data:`OPEN_PATH` without the header
    ``Authorization: Bearer <key>`` gets 401 with ``body`` (the app's error body), compared in
    constant time; other requests pass to the app untouched (streams and disconnects included)."""

    def __init__(self, app: Any, key: str, body: Callable[[str], dict[str, Any]]) -> None:
        self.app, self.expected, self.body = app, f"Bearer {key}".encode(), body

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] != OPEN_PATH:
            given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                response = JSONResponse(self.body(_WRONG_KEY), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RewardRequest(BaseModel):
    """One ``/get_reward`` body. Strict: a number is not taken for a string."""

    model_config = ConfigDict(strict=True)
    query: list[str] = Field(min_length=1, description="prompt + answer texts to score")
    prompts: list[str] | None = Field(default=None, description="the prompts (unused by a reward model)")
    labels: list[str] | None = Field(default=None, description="reference answers (unused by a reward model)")


class RewardReply(BaseModel):
    rewards: list[float]


def add_reward_routes(app: FastAPI, scorer: RewardScorer) -> None:
    """``POST /get_reward`` scored by ``scorer``, one request at a time: requests wait their turn on the
    event loop (which keeps answering ``/health``), a request whose client has gone away by its turn
    is not scored (a client that timed out and retried does not make the queue longer), and the
    scoring runs in a worker thread. A query of no tokens or one the tokenizer cannot encode
    (:class:`~dschat.serve.reward_scorer.BadQuery`) gets a 422 naming its index, and none of the
    request's queries is scored; a query the model scores NaN or infinite
    (:class:`~dschat.serve.reward_scorer.NonFiniteScore`) a 500 naming it."""
    turn = asyncio.Lock()

    @app.post("/get_reward", response_model=RewardReply)
    async def get_reward(request: RewardRequest, client: Request) -> Any:
        async with turn:
            if await client.is_disconnected():
                return JSONResponse({"detail": "the client went away before its turn"}, status_code=499)
            try:
                return RewardReply(rewards=await run_in_threadpool(scorer.score, request.query))
            except BadQuery as err:
                return JSONResponse({"detail": str(err)}, status_code=422)
            except NonFiniteScore as err:  # the model's fault: said on the server too
                print(f"[serve] {err}", file=sys.stderr, flush=True)
                return JSONResponse({"detail": str(err)}, status_code=500)


def build_app(reward: RewardScorer, api_key: str | None = None) -> FastAPI:
    """The app serving ``reward`` (see the module docstring for its routes and ``api_key``)."""
    app = FastAPI(title="dschat.serve", docs_url=None, redoc_url=None, openapi_url=None)
    health: dict[str, Any] = {"status": "ok", "model": str(reward.folder), "kind": "reward"}

    @app.get("/health")
    def get_health() -> dict[str, Any]:
        return health

    add_reward_routes(app, reward)
    if api_key:
        app.add_middleware(ApiKeyGate, key=api_key, body=lambda message: {"detail": message})
    return app


def build_actor_app(engine: ActorEngine, batcher: Batcher, api_key: str | None = None) -> FastAPI:
    """The app serving ``engine``'s actor, its requests decoded by ``batcher`` (``api_key``: the module docstring)."""
    app = FastAPI(title="dschat.serve", docs_url=None, redoc_url=None, openapi_url=None)
    health: dict[str, Any] = {"status": "ok", "model": engine.name, "kind": "actor"}

    @app.get("/health")
    def get_health() -> dict[str, Any]:
        return {**health, **batcher.load()}

    add_actor_routes(app, engine, batcher)
    if api_key:
        app.add_middleware(ApiKeyGate, key=api_key,
                           body=lambda message: error_body(message, 401, code="invalid_api_key"))
    return app
