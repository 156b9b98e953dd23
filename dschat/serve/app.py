"""The HTTP app of ``python -m dschat.serve`` (FastAPI; run by uvicorn in :mod:`dschat.serve.cli`).

Routes:

- ``GET /health``: ``{"status": "ok", "model": folder, "kind": "reward"}`` (an actor:
  ``{"status": "ok", "model": name, "kind": "actor"}``).
- ``POST /get_reward``: OpenRLHF's remote reward protocol. Body ``{"query": [str, ...], "prompts":
  [str, ...], "labels": [str, ...]}`` (``prompts`` and ``labels`` optional, unused by a reward model);
  reply ``{"rewards": [float, ...]}``, one per query, in order. A body that is not JSON, has a field of
  the wrong type, or an empty ``query`` gets HTTP 422 ``{"detail": ...}``; an unknown route 404 and a
  wrong method 405, both JSON. The server goes on serving after each.

:func:`build_app` serves a reward model; :func:`build_actor_app` an actor, on the OpenAI-compatible
routes of :mod:`dschat.serve.openai_api` (``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``), whose refusals carry OpenAI's error body instead of ``{"detail": ...}``.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from dschat.serve.actor import ActorEngine, Batcher
from dschat.serve.openai_api import add_actor_routes
from dschat.serve.reward_scorer import RewardScorer

__all__ = ["RewardRequest", "RewardReply", "build_actor_app", "build_app", "add_reward_routes"]


class RewardRequest(BaseModel):
    """One ``/get_reward`` body. Strict: a number is not taken for a string."""

    model_config = ConfigDict(strict=True)
    query: list[str] = Field(min_length=1, description="prompt + answer texts to score")
    prompts: list[str] | None = Field(default=None, description="the prompts (unused by a reward model)")
    labels: list[str] | None = Field(default=None, description="reference answers (unused by a reward model)")


class RewardReply(BaseModel):
    rewards: list[float]


def add_reward_routes(app: FastAPI, scorer: RewardScorer) -> None:
    """``POST /get_reward`` scored by ``scorer`` (a sync route: FastAPI runs it in its thread pool, so
    the event loop keeps answering ``/health`` while a batch is scored)."""

    @app.post("/get_reward", response_model=RewardReply)
    def get_reward(request: RewardRequest) -> RewardReply:
        return RewardReply(rewards=scorer.score(request.query))


def build_app(reward: RewardScorer) -> FastAPI:
    """The app serving ``reward`` (see the module docstring for its routes)."""
    app = FastAPI(title="dschat.serve", docs_url=None, redoc_url=None, openapi_url=None)
    health: dict[str, Any] = {"status": "ok", "model": str(reward.folder), "kind": "reward"}

    @app.get("/health")
    def get_health() -> dict[str, Any]:
        return health

    add_reward_routes(app, reward)
    return app


def build_actor_app(engine: ActorEngine, batcher: Batcher) -> FastAPI:
    """The app serving ``engine``'s actor, its requests decoded by ``batcher``."""
    app = FastAPI(title="dschat.serve", docs_url=None, redoc_url=None, openapi_url=None)
    health: dict[str, Any] = {"status": "ok", "model": engine.name, "kind": "actor"}

    @app.get("/health")
    def get_health() -> dict[str, Any]:
        return health

    add_actor_routes(app, engine, batcher)
    return app
