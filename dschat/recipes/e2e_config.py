"""``configs/e2e.yaml``: which recipe serves which model in each ``e2e_rlhf.py --deployment-type``,
and the settings of e2e's end-of-run report; read with every key and type checked.

A key that is not known, a value of the wrong type (a list where a name belongs, text where a
mapping belongs), a key given twice or a missing required key is one :class:`UserError` line naming
the file and the key; every recipe it names must exist (:func:`~dschat.recipes.loading.get_recipe`).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from dschat.errors import UserError
from dschat.recipes.loading import find_repo_root, get_recipe, yaml_text_load

__all__ = ["Deployment", "E2EConfig", "ReportSettings", "load_e2e_config"]

E2E_FILE = "configs/e2e.yaml"


@dataclass(frozen=True)
class Deployment:
    """One --deployment-type: which recipe serves which model."""

    name: str
    aliases: tuple[str, ...]
    description: str
    actor: dict[str, str]
    reward: dict[str, str]
    other_actor: str
    other_reward: str
    unavailable: dict[str, str]
    default_actor: str | None = None
    default_reward: str | None = None


@dataclass(frozen=True)
class ReportSettings:
    """The ``report:`` part: what e2e's end-of-run report evaluates (None: all of them)."""

    seed: int = 1234
    max_prompts: int | None = None
    max_pairs: int | None = None
    batch_size: int = 16
    generation_batch_size: int | None = None
    eta_seconds: float = 0.0  # rough time of the evaluation, for the ETA e2e prints


@dataclass(frozen=True)
class E2EConfig:
    deployments: dict[str, Deployment]
    default_deployment: str
    default_actor: str
    default_reward: str
    report: ReportSettings = field(default_factory=ReportSettings)

    def deployment(self, name: str) -> Deployment:
        """Resolve a name or alias (``singlenode``, ``multinode``)."""
        key = _deployment_key(name)
        for dep in self.deployments.values():
            if key == dep.name or key in dep.aliases:
                return dep
        raise UserError(f"unknown deployment type {name!r}; use one of: {', '.join(self.choices())}")

    def choices(self) -> list[str]:
        return [n for dep in self.deployments.values() for n in (dep.name, *dep.aliases)]


def _deployment_key(name: str) -> str:
    """How a --deployment-type value, a deployment's name and its aliases are compared
    (``Single-Node`` is ``single_node``)."""
    return name.strip().lower().replace("-", "_")


class _Reader:
    """Typed reads of one mapping of the file; each refusal names the file and the key's place."""

    def __init__(self, path: Path, where: str, raw: Any, known: set[str], required: set[str] = frozenset()) -> None:
        self.path, self.where = path, where
        if not isinstance(raw, dict):
            self.fail(f"{where or 'the file'} must be a mapping")
        unknown = sorted(k for k in raw if k not in known and not str(k).startswith("_"))
        if unknown:
            self.fail(f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} in "
                      f"{where or 'the top level'} (known: {', '.join(sorted(known))})")
        missing = sorted(required - set(raw))
        if missing:
            self.fail(f"{where or 'the top level'} lacks {', '.join(map(repr, missing))}")
        self.raw = raw

    def fail(self, problem: str) -> None:
        raise UserError(f"{self.path}: {problem}; see the comments at the top of {E2E_FILE}")

    def _place(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def text(self, key: str, default: str | None = None) -> str | None:
        value = self.raw.get(key, default)
        if value is not None and not (isinstance(value, str) and value.strip() and "\n" not in value):
            self.fail(f"{self._place(key)} must be one line of text, got {value!r}")
        return value

    def names(self, key: str) -> tuple[str, ...]:
        value = self.raw.get(key, [])
        if not (isinstance(value, list) and all(isinstance(v, str) and v.strip() for v in value)):
            self.fail(f"{self._place(key)} must be a list of names (such as [singlenode]), got {value!r}")
        return tuple(value)

    def table(self, key: str) -> dict[str, str]:
        value = self.raw.get(key, {})
        if not (isinstance(value, dict) and all(isinstance(v, str) and v.strip() for v in value.values())):
            self.fail(f"{self._place(key)} must map names to text (or be {{}}), got {value!r}")
        return dict(value)

    def number(self, key: str, default: float | None, *, whole: bool = True, low: float = 1) -> Any:
        value = self.raw.get(key)
        if value is None:
            return default
        try:
            number = int(value) if whole else float(value)
        except (TypeError, ValueError):
            number = None
        if number is None or not math.isfinite(number) or number < low:
            kind = "a whole number" if whole else "a number"
            self.fail(f"{self._place(key)} must be {kind} of at least {low:g}, got {value!r}")
        return number


_DEPLOYMENT_KEYS = {"aliases", "description", "actor", "reward", "other_actor", "other_reward", "unavailable",
                    "default_actor", "default_reward"}
_REPORT_KEYS = {"seed", "max_prompts", "max_pairs", "batch_size", "generation_batch_size", "eta_seconds"}


def _deployment(path: Path, name: str, raw: Any) -> Deployment:
    read = _Reader(path, f"deployment_types.{name}", raw, _DEPLOYMENT_KEYS, {"other_actor", "other_reward"})
    return Deployment(name=name, aliases=read.names("aliases"), description=read.text("description", "") or "",
                      actor=read.table("actor"), reward=read.table("reward"), other_actor=read.text("other_actor"),
                      other_reward=read.text("other_reward"), unavailable=read.table("unavailable"),
                      default_actor=read.text("default_actor"), default_reward=read.text("default_reward"))


def _report(path: Path, raw: Any) -> ReportSettings:
    read = _Reader(path, "report", raw, _REPORT_KEYS)
    return ReportSettings(seed=read.number("seed", 1234, low=0), max_prompts=read.number("max_prompts", None),
                          max_pairs=read.number("max_pairs", None), batch_size=read.number("batch_size", 16),
                          generation_batch_size=read.number("generation_batch_size", None),
                          eta_seconds=read.number("eta_seconds", 0.0, whole=False, low=0))


def load_e2e_config(root: str | os.PathLike | None = None) -> E2EConfig:
    """Read and check ``configs/e2e.yaml`` of the checkout ``root`` (found as the recipes find it);
    every recipe it names must exist."""
    base = find_repo_root(root)
    path = base / E2E_FILE
    if not path.is_file():
        raise UserError(f"missing {path}: the file that maps e2e's models to recipes")
    read = _Reader(path, "", yaml_text_load(path),
                   {"deployment_types", "default_deployment", "default_actor", "default_reward", "report"},
                   {"deployment_types", "default_deployment", "default_actor", "default_reward"})
    types = read.raw["deployment_types"]
    if not (isinstance(types, dict) and types):
        read.fail(f"deployment_types must be a non-empty mapping, got {types!r}")
    deployments = {name: _deployment(path, name, raw) for name, raw in types.items()}
    for dep in deployments.values():
        for rid in {*dep.actor.values(), dep.other_actor}:
            get_recipe("step1", rid, base)
            get_recipe("step3", rid, base)
        for rid in {*dep.reward.values(), dep.other_reward}:
            get_recipe("step2", rid, base)
    config = E2EConfig(deployments, read.text("default_deployment"), read.text("default_actor"),
                       read.text("default_reward"), _report(path, read.raw.get("report", {})))
    _check_names(read, config, deployments)
    return config


def _check_names(read: _Reader, config: E2EConfig, deployments: Mapping[str, Deployment]) -> None:
    """Each name and alias chooses one deployment, and the default deployment is one of them."""
    seen: dict[str, str] = {}
    for dep in deployments.values():
        for name in (dep.name, *dep.aliases):
            key = _deployment_key(name)
            if key in seen:
                read.fail(f"{name!r} names both deployment_types.{seen[key]} and deployment_types.{dep.name}")
            seen[key] = dep.name
    if _deployment_key(config.default_deployment) not in seen:
        read.fail(f"default_deployment {config.default_deployment!r} is not one of deployment_types "
                  f"({', '.join(deployments)})")
