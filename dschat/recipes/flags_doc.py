"""``docs/flags.md``: every flag of every step script, generated from the parsers the scripts build.

Each step's parser is taken from its own ``main.py`` (``parse_args`` is called with parsing
intercepted, :func:`parser_of`), so the reference lists exactly what ``--help`` lists, however
``dschat/cli/`` groups the flags. Whether a flag is upstream's comes from
:mod:`dschat.recipes.upstream_flags`.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from dschat.paths import data_cache_dir
from dschat.recipes.loading import find_repo_root
from dschat.recipes.steps import STEPS
from dschat.recipes.upstream_flags import UPSTREAM_DEFAULTS, UPSTREAM_FLAGS

FLAGS_DOC = "docs/flags.md"
REGENERATE = "python -m dschat.recipes write-flags-doc"


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser captured")
        self.parser = parser


def _capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
    raise _Captured(self)


def parser_of(build: Callable[..., Any], *args: Any) -> argparse.ArgumentParser:
    """The first parser ``build(*args)`` asks to parse (``build`` stops there, having parsed nothing).

    ``build`` is a CLI's ``parse_args`` or ``main``: whatever builds its parser and then calls
    ``parse_args`` / ``parse_known_args`` on it.
    """
    original = argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_known_args = _capture  # type: ignore[method-assign]
    try:
        build(*args)
    except _Captured as captured:
        return captured.parser
    finally:
        argparse.ArgumentParser.parse_known_args = original  # type: ignore[method-assign]
    raise RuntimeError(f"{build!r} returned without parsing any arguments")


def load_script(path: str | os.PathLike) -> ModuleType:
    """Import a script of the checkout (``training/*/main.py``, ``e2e_rlhf.py``) as a module of its own."""
    path = Path(path).resolve()
    name = "dschat_script_" + re.sub(r"\W", "_", str(path.with_suffix("")))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses in the script look their module up there
    spec.loader.exec_module(module)
    return module


def step_parser(step: str, root: str | os.PathLike | None = None) -> argparse.ArgumentParser:
    """The parser of step ``step`` (``step1``, ``step2``, ``dpo``, ``step3``), as its ``main.py`` builds it."""
    base = find_repo_root(root)
    return parser_of(load_script(base / STEPS[step].main_py).parse_args, [])


# -------------------------------------------------------------------------------------------------
# Rendering
# -------------------------------------------------------------------------------------------------
def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    value = action.default
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off" if value is False else "on"
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return _cell(" ".join(f"`{v}`" for v in value)) if value else "empty"
    if str(value) == str(data_cache_dir()):
        return "`~/.cache/dschat/data_files` (see help)"
    return f"`{_cell(value)}`"


def _flag(action: argparse.Action) -> str:
    names = ", ".join(f"`{name}`" for name in action.option_strings)
    if action.choices:
        names += " " + "\\|".join(" ".join(str(c).split()) for c in action.choices)
    return names


def _origin(step: str, action: argparse.Action) -> str:
    if action.dest not in UPSTREAM_FLAGS[step]:
        return "dschat"
    before = UPSTREAM_DEFAULTS.get((step, action.dest))
    return f"upstream (default was {before})" if before else "upstream"


def _help(action: argparse.Action) -> str:
    return _cell((action.help or "").replace("%%", "%")) if action.help != argparse.SUPPRESS else ""


def _step_title(step: str) -> str:
    spec = STEPS[step]
    return "DPO (instead of steps 2 and 3)" if step == "dpo" else f"Step {spec.number}: {spec.title}"


def render_flags_doc(root: str | os.PathLike | None = None) -> str:
    """The text of ``docs/flags.md``."""
    lines = [
        "# Flags of the step scripts",
        "",
        f"<!-- Generated from the step scripts' parsers by `{REGENERATE}`; do not edit. -->",
        "",
        "Every flag of `training/*/main.py`, in `--help`'s groups. **from**: `upstream` for a flag",
        "upstream DeepSpeed-Chat's script of that step has (same name; same default unless said), `dschat`",
        "for dschat's additions, which are off or at upstream's behaviour unless their default says",
        "otherwise. The differences are explained in [upstream.md](upstream.md); the launchers' own",
        "options (`e2e_rlhf.py`, `python -m dschat.launch`) are in [launching.md](launching.md).",
        "",
    ]
    for step in STEPS:
        lines.append(f"- [{_step_title(step)}](#{_slug(_step_title(step))}): `{STEPS[step].main_py}`")
    for step in STEPS:
        parser = step_parser(step, root)
        lines += ["", f"## {_step_title(step)}", "", f"`python {STEPS[step].main_py} --help`", ""]
        for group in parser._action_groups:
            actions = [a for a in group._group_actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
            if not actions:
                continue
            lines += [f"**{group.title}**", "", "| flag | default | from | help |", "|---|---|---|---|"]
            for action in actions:
                lines.append(f"| {_flag(action)} | {_default(action)} | {_origin(step, action)} | {_help(action)} |")
            lines.append("")
        if lines[-1] == "":
            lines.pop()
    lines.append("")
    return "\n".join(lines)


def _slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def check_flags_doc(root: str | os.PathLike | None = None) -> list[str]:
    """One line when ``docs/flags.md`` differs from what the parsers give; empty when in sync."""
    path = find_repo_root(root) / FLAGS_DOC
    if not path.is_file():
        return [f"missing {FLAGS_DOC}: run {REGENERATE}"]
    if path.read_text(encoding="utf-8") != render_flags_doc(root):
        return [f"out of date {FLAGS_DOC}: run {REGENERATE}"]
    return []


def write_flags_doc(root: str | os.PathLike | None = None) -> Path:
    """Write ``docs/flags.md``; returns its path."""
    path = find_repo_root(root) / FLAGS_DOC
    path.write_text(render_flags_doc(root), encoding="utf-8")
    return path
