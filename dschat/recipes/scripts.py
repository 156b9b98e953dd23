"""The shell scripts and READMEs generated from the recipes (``training/*/training_scripts``)."""
from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Mapping

from dschat.recipes.loading import find_repo_root, load_all
from dschat.recipes.recipe import Recipe
from dschat.recipes.steps import SHELL_NAMES, STEPS, StepSpec

# -------------------------------------------------------------------------------------------------
# Generated shell scripts and READMEs
# -------------------------------------------------------------------------------------------------
GENERATED_MARK = "# Generated from configs/"


def script_path(recipe: Recipe, root: Path) -> Path:
    return root / recipe.step.folder / "training_scripts" / recipe.script


def _comment(text: str, width: int = 96) -> list[str]:
    return ["# " + line if line else "#" for line in textwrap.wrap(" ".join(text.split()), width - 2)] or ["#"]


def render_script(recipe: Recipe) -> str:
    """The thin bash wrapper around ``python -m dschat.launch`` for one recipe."""
    params = recipe.step.params
    usage_args = " ".join(f"[{SHELL_NAMES[p]}]" for p in params)
    defaults = " ".join(
        f"{SHELL_NAMES[p]}={recipe.defaults[p] if recipe.defaults[p] is not None else '(required)'}"
        for p in params
    )
    ups = "/".join([".."] * (len(Path(recipe.script).parts) - 1 + 3))
    name = Path(recipe.script).name
    lines = [
        "#!/bin/bash",
        f"{GENERATED_MARK}{recipe.step.key}.yaml (recipe {recipe.id}) by",
        "# `python -m dschat.recipes write-scripts`: edit the recipe, not this file.",
        "#",
        *_comment(recipe.description),
    ]
    if recipe.upstream:
        lines.append(f"# Re-creates upstream's {recipe.upstream}.")
    lines += [
        "#",
        f"# Usage: bash {name} {usage_args} [--main_py_flag VALUE ...]",
        f"#   Empty or missing positionals take the defaults: {defaults}",
        "#   Flags after the positionals are added to main.py's (one given there replaces the recipe's),",
        "#   except --hostfile, --master_addr, --master_port, --num_nodes and --num_gpus: the launcher's.",
        "#   Output goes to the terminal and to OUTPUT/training.log.",
    ]
    for note in recipe.notes:
        lines += ["#", *_comment(note)]
    lines += [
        "",
        f'ROOT="$(cd "$(dirname "${{BASH_SOURCE[0]}}")/{ups}" && pwd)"',
        'export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"',
        f'exec "${{PYTHON:-python3}}" -m dschat.launch --repo-root "$ROOT" {recipe.step.key} {recipe.id} --script-args "$@"',
        "",
    ]
    return "\n".join(lines)


def render_readme(spec: StepSpec, recipes: Mapping[str, Recipe]) -> str:
    """``training/<step>/training_scripts/README.md``, generated from the recipes."""
    params = " ".join(SHELL_NAMES[p] for p in spec.params)
    lines = [
        f"# Step {spec.number}: {spec.title} — launch recipes" if spec.key != "dpo" else "# DPO — launch recipes",
        "",
        f"<!-- Generated from {spec.config_file} by `python -m dschat.recipes write-scripts`; edit the YAML. -->",
        "",
        f"Every `run_*.sh` here is a thin wrapper around `python -m dschat.launch {spec.key} <recipe>`,",
        f"which reads the recipe from [`{spec.config_file}`](../../../{spec.config_file}), builds the",
        f"`deepspeed` command for `{spec.main_py}` (an argument list, no shell) and streams its output",
        "to the terminal and to `OUTPUT/training.log` (upstream's scripts wrote only the log).",
        "",
        "```bash",
        f"bash training_scripts/{next(iter(recipes.values())).script} {params}  # any may be '' for the default",
        f"python -m dschat.launch {spec.key} <recipe> [--output_dir DIR] ... [-- --extra_flag value]  # same thing",
        f"python -m dschat.launch {spec.key} <recipe> --dry-run  # print the command only",
        "```",
        "",
        f"Positionals as upstream: {', '.join(f'`${i}` {SHELL_NAMES[p]}' for i, p in enumerate(spec.params, 1))}.",
        "Flags after the positionals go to `main.py`; one that the recipe also sets replaces it.",
        "",
        "| script | recipe | what | defaults |",
        "|---|---|---|---|",
    ]
    for recipe in recipes.values():
        defaults = ", ".join(
            f"{SHELL_NAMES[p]}={recipe.defaults[p] if recipe.defaults[p] is not None else '**required**'}"
            for p in spec.params
        )
        lines.append(f"| `{recipe.script}` | `{recipe.id}` | {recipe.description} | {defaults} |")
    noted = [r for r in recipes.values() if r.notes]
    if noted:
        lines += ["", "## Notes", ""]
        for recipe in noted:
            for note in recipe.notes:
                lines.append(f"- `{recipe.id}`: {' '.join(note.split())}")
    lines.append("")
    return "\n".join(lines)


def expected_generated_files(root: str | os.PathLike | None = None) -> dict[Path, str]:
    """Every generated file (scripts and READMEs) with the text it must have."""
    base = find_repo_root(root)
    out: dict[Path, str] = {}
    for key, recipes in load_all(base).items():
        spec = STEPS[key]
        for recipe in recipes.values():
            out[script_path(recipe, base)] = render_script(recipe)
        out[base / spec.folder / "training_scripts" / "README.md"] = render_readme(spec, recipes)
    return out


def _stale_scripts(base: Path, expected: Mapping[Path, str]) -> list[Path]:
    """Scripts under ``training_scripts/`` that no recipe generates. A hand-written script that a
    recipe names as its ``upstream`` path is not one: it keeps upstream's interface (the step-3
    sweep's ``run_single.sh`` and its 11 positionals) and runs that recipe's generated script."""
    wrappers = {base / recipe.upstream for recipes in load_all(base).values() for recipe in recipes.values()
                if recipe.upstream}
    stale = []
    for spec in STEPS.values():
        folder = base / spec.folder / "training_scripts"
        for path in sorted(folder.rglob("*.sh")) if folder.is_dir() else []:
            if path not in expected and path not in wrappers:
                stale.append(path)
    return stale


def check_generated(root: str | os.PathLike | None = None) -> list[str]:
    """Problems (one line each) between ``configs/`` and the committed scripts; empty when in sync."""
    base = find_repo_root(root)
    expected = expected_generated_files(base)
    problems = []
    for path, text in expected.items():
        rel = path.relative_to(base)
        if not path.is_file():
            problems.append(f"missing {rel}")
        elif path.read_text(encoding="utf-8") != text:
            problems.append(f"out of date {rel}")
        elif path.suffix == ".sh" and not os.access(path, os.X_OK):
            problems.append(f"not executable {rel}")
    for path in _stale_scripts(base, expected):
        problems.append(f"not generated from any recipe {path.relative_to(base)}")
    return problems


def write_generated(root: str | os.PathLike | None = None) -> list[Path]:
    """Write every generated file (executable scripts), delete generated scripts no recipe makes."""
    base = find_repo_root(root)
    expected = expected_generated_files(base)
    written = []
    for path, text in expected.items():
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            written.append(path)
        if path.suffix == ".sh":
            path.chmod(0o755)
    for path in _stale_scripts(base, expected):
        # Only scripts this generator wrote are deleted; a hand-written one is left (and reported).
        if GENERATED_MARK in path.read_text(encoding="utf-8", errors="replace"):
            path.unlink()
            written.append(path)
    return written
