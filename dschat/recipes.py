"""Launch recipes: load the YAML files in ``configs/``, validate them, render a step's argv.

A *recipe* is what one upstream ``training_scripts/**/run_*.sh`` was: launcher options plus the
flags of one step's ``main.py``, with a few positional parameters (upstream's ``$1``..``$5``).
``configs/`` is the one source of truth; ``dschat.launch``, the generated shell scripts and
``e2e_rlhf.py`` all read it through this module. The format is described in ``configs/README.md``.

Also a small CLI (``python -m dschat.recipes``): ``list``, ``show``, ``validate``,
``write-scripts`` / ``check-scripts`` (the shell scripts and READMEs generated from the recipes).
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence, Union

from dschat.errors import UserError, cli_main
from dschat.runtime.fs import untrusted_reason

# -------------------------------------------------------------------------------------------------
# Steps
# -------------------------------------------------------------------------------------------------
PARAMS_1_2: tuple[str, ...] = ("output_dir", "zero_stage")
PARAMS_3: tuple[str, ...] = ("actor_model", "critic_model", "actor_zero_stage", "critic_zero_stage", "output_dir")
ZERO_STAGE_PARAMS = frozenset({"zero_stage", "actor_zero_stage", "critic_zero_stage"})
# Upstream's shell variable names for the positionals, used in the generated scripts' usage lines.
SHELL_NAMES: dict[str, str] = {
    "output_dir": "OUTPUT",
    "zero_stage": "ZERO_STAGE",
    "actor_model": "ACTOR_MODEL_PATH",
    "critic_model": "CRITIC_MODEL_PATH",
    "actor_zero_stage": "ACTOR_ZERO_STAGE",
    "critic_zero_stage": "CRITIC_ZERO_STAGE",
}


@dataclass(frozen=True)
class StepSpec:
    """One training step: its key, number, folder and positional parameters."""

    key: str
    number: int
    folder: str  # relative to the repository root
    params: tuple[str, ...]
    title: str

    @property
    def config_file(self) -> str:
        return f"configs/{self.key}.yaml"

    @property
    def main_py(self) -> str:
        return f"{self.folder}/main.py"


STEPS: dict[str, StepSpec] = {
    "step1": StepSpec("step1", 1, "training/step1_supervised_finetuning", PARAMS_1_2, "supervised fine-tuning (SFT)"),
    "step2": StepSpec("step2", 2, "training/step2_reward_model_finetuning", PARAMS_1_2, "reward model"),
    "dpo": StepSpec("dpo", 2, "training/step2_dpo_finetuning", PARAMS_1_2, "DPO"),
    "step3": StepSpec("step3", 3, "training/step3_rlhf_finetuning", PARAMS_3, "PPO (RLHF)"),
}
STEP_ALIASES: dict[str, str] = {
    "1": "step1", "sft": "step1", "2": "step2", "rm": "step2", "reward": "step2",
    "3": "step3", "ppo": "step3", "rlhf": "step3",
}


def step_spec(name: str) -> StepSpec:
    """The :class:`StepSpec` for ``step1``/``step2``/``dpo``/``step3`` (or ``1``/``2``/``3``, ``sft``, ``ppo``...)."""
    key = STEP_ALIASES.get(str(name).lower(), str(name).lower())
    if key not in STEPS:
        raise UserError(f"unknown step {name!r}; use one of: {', '.join(STEPS)} (or 1, 2, 3)")
    return STEPS[key]


# -------------------------------------------------------------------------------------------------
# Repository root (where configs/ and training/ live)
# -------------------------------------------------------------------------------------------------
def _is_repo_root(path: Path) -> bool:
    return (path / "configs" / "step1.yaml").is_file() and (path / "training").is_dir()


def _checked_root(label: str, path: Path) -> Path:
    # The checkout's configs/ and training/.../main.py decide what runs: it must be the user's (or
    # root's, for a system-wide install) and writable by nobody else.
    reason = untrusted_reason(path, root_may_own=True)
    if reason:
        raise UserError(f"{label} {path} is not safe to run: {reason}; a checkout that others can change could run their code: "
                        f"use your own clone, or chmod go-w {path}")
    return path


def find_repo_root(explicit: str | os.PathLike | None = None) -> Path:
    """The checkout that holds ``configs/`` and ``training/``.

    Only places the user chose are searched, in order: ``explicit`` (``--repo-root``; the shell
    scripts pass their own checkout), ``$DSCHAT_REPO_ROOT``, the checkout this package was imported
    from (an editable install, or ``PYTHONPATH`` pointing at a checkout), and the working directory
    itself. Its parents are not searched: a folder such as ``/tmp`` that others can write to could
    hold a planted checkout. The checkout must be the user's and writable by nobody else
    (:func:`dschat.runtime.fs.untrusted_reason`).
    """
    for label, value in (("--repo-root", explicit), ("DSCHAT_REPO_ROOT", os.environ.get("DSCHAT_REPO_ROOT"))):
        if value:
            path = Path(value).expanduser().resolve()
            if not _is_repo_root(path):
                raise UserError(f"{label} {path} is not a dschat checkout (no configs/step1.yaml and training/)")
            return _checked_root(label, path)
    package_checkout = Path(__file__).resolve().parent.parent
    for label, path in (("the checkout dschat was imported from", package_checkout),
                        ("the working directory", Path.cwd().resolve())):
        if _is_repo_root(path):
            return _checked_root(label, path)
    raise UserError(
        "cannot find the dschat checkout (a folder with configs/ and training/): dschat looks in the "
        "checkout it was imported from and in the working directory only; run from the checkout, or pass "
        "--repo-root / set DSCHAT_REPO_ROOT"
    )


# -------------------------------------------------------------------------------------------------
# Recipes
# -------------------------------------------------------------------------------------------------
FlagValue = Union[str, tuple, bool]  # "text", ("a", "b") for nargs flags, True for store_true

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$")
_FLAG_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_TEMPLATE_RE = re.compile(r"\{([^{}]*)\}")
_RECIPE_KEYS = frozenset(
    {"upstream", "description", "notes", "launcher", "env", "defaults", "flags", "script", "eta_seconds"}
)
_LAUNCHER_INT_KEYS = ("num_gpus", "num_nodes", "master_port")
_LAUNCHER_STR_KEYS = ("hostfile", "master_addr", "include", "exclude")
_TRUE = "true"


@dataclass(frozen=True)
class Launcher:
    """Options of the ``deepspeed`` launcher (``None``: the launcher's own default)."""

    num_gpus: int | None = None
    num_nodes: int | None = None
    hostfile: str | None = None
    master_port: int | None = None
    include: str | None = None
    exclude: str | None = None
    master_addr: str | None = None

    def argv(self) -> list[str]:
        """``--num_gpus 1 --master_port 12346 ...`` in a fixed order."""
        out: list[str] = []
        for name in ("hostfile", "include", "exclude", "num_nodes", "num_gpus", "master_addr", "master_port"):
            value = getattr(self, name)
            if value is not None:
                out += [f"--{name}", str(value)]
        return out

    def with_overrides(self, **overrides: object) -> "Launcher":
        """A copy where every non-``None`` override replaces the recipe's value."""
        values = {k: getattr(self, k) for k in self.__dataclass_fields__}
        for key, value in overrides.items():
            if key not in values:
                raise TypeError(f"unknown launcher option {key}")
            if value is not None:
                values[key] = value
        return Launcher(**values)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Recipe:
    """One launch recipe of one step (see ``configs/README.md``)."""

    step: StepSpec
    id: str
    description: str
    flags: tuple[tuple[str, FlagValue], ...]
    defaults: Mapping[str, str | None]
    launcher: Launcher = field(default_factory=Launcher)
    env: Mapping[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    upstream: str | None = None
    script: str = ""
    eta_seconds: int | None = None
    source: str = ""

    # -- lookup ------------------------------------------------------------------------------------
    def flag(self, name: str, default: FlagValue | None = None) -> FlagValue | None:
        """The raw value of flag ``--name`` (templates not filled), or ``default``."""
        for key, value in self.flags:
            if key == name:
                return value
        return default

    def has_flag(self, name: str) -> bool:
        return any(key == name for key, _ in self.flags)

    @property
    def label(self) -> str:
        return f"{self.step.key} recipe {self.id}"

    # -- parameters --------------------------------------------------------------------------------
    def resolve_params(self, overrides: Mapping[str, str | None] | None = None) -> dict[str, str]:
        """Positional parameters with defaults filled in; empty or ``None`` takes the default.

        Raises :class:`UserError` for a required parameter left empty and for a bad ZeRO stage.
        """
        overrides = dict(overrides or {})
        unknown = set(overrides) - set(self.step.params)
        if unknown:
            raise UserError(
                f"{self.label} has no parameter {', '.join(sorted(unknown))}; its parameters are "
                f"{', '.join(self.step.params)}"
            )
        out: dict[str, str] = {}
        for position, name in enumerate(self.step.params, start=1):
            value = overrides.get(name)
            value = None if value is None or str(value).strip() == "" else str(value).strip()
            if value is None:
                value = self.defaults.get(name)
            if value is None:
                raise UserError(
                    f"{self.label} needs {name} (positional ${position}, {SHELL_NAMES[name]}) and has no "
                    f"default (upstream left it empty to be filled in): {self._param_hint(name)}"
                )
            if name in ZERO_STAGE_PARAMS and value not in ("0", "1", "2", "3"):
                raise UserError(f"{name} must be 0, 1, 2 or 3, not {value!r}")
            out[name] = value
        return out

    def _param_hint(self, name: str) -> str:
        if name == "actor_model":
            return "pass the step-1 output folder (or a hub id) as the first argument"
        if name == "critic_model":
            return "pass the step-2 output folder as the second argument"
        return f"pass a value for {name}"

    def params_from_positionals(self, values: Sequence[str]) -> dict[str, str | None]:
        """Map upstream-style positionals (``$1 $2 ...``) to parameter names."""
        if len(values) > len(self.step.params):
            raise UserError(
                f"{self.label} takes at most {len(self.step.params)} positional values "
                f"({' '.join(SHELL_NAMES[p] for p in self.step.params)}), got {len(values)}: "
                f"{' '.join(shlex.quote(v) for v in values)}; put main.py flags after them as --flag value"
            )
        return {name: value for name, value in zip(self.step.params, values)}

    # -- rendering ---------------------------------------------------------------------------------
    def render(
        self,
        params: Mapping[str, str | None] | None = None,
        extra: Sequence[str] = (),
        unset: Iterable[str] = (),
    ) -> list[str]:
        """The ``main.py`` argv: the recipe's flags with parameters filled in, then ``extra``.

        A flag given in ``extra`` replaces the recipe's occurrence (so the command line has it once);
        ``unset`` drops recipe flags (e.g. ``enable_hybrid_engine``).
        """
        resolved = self.resolve_params(params)
        extra_groups = split_flag_groups(extra)
        overridden = {name for name, _ in extra_groups}
        unset = {u.lstrip("-") for u in unset}
        missing = sorted(unset - {name for name, _ in self.flags})
        if missing:
            raise UserError(f"{self.label} has no flag {', '.join('--' + m for m in missing)} to unset")
        argv: list[str] = []
        for name, value in self.flags:
            if name in overridden or name in unset:
                continue
            argv += _render_flag(name, value, resolved)
        for _, tokens in extra_groups:
            argv += tokens
        return argv

    def command_preview(self, params: Mapping[str, str | None] | None = None) -> str:
        """``deepspeed [launcher opts] training/<step>/main.py <flags>`` as one shell-quoted line."""
        argv = ["deepspeed", *self.launcher.argv(), self.step.main_py, *self.render(params)]
        return shlex.join(argv)


def _fill(text: str, params: Mapping[str, str]) -> str:
    return _TEMPLATE_RE.sub(lambda m: params[m.group(1)], text)


def _render_flag(name: str, value: FlagValue, params: Mapping[str, str]) -> list[str]:
    if value is True:
        return [f"--{name}"]
    if isinstance(value, tuple):
        return [f"--{name}", *(_fill(v, params) for v in value)]
    return [f"--{name}", _fill(str(value), params)]


def _is_flag_token(token: str) -> bool:
    """``--name`` or ``--name=value`` (a negative number such as ``-1`` is a value)."""
    return token.startswith("--") and len(token) > 2 and not token[2:3].isdigit()


def split_flag_groups(tokens: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Group ``["--a", "1", "--b", "--c", "x", "y"]`` into ``[("a", [...]), ("b", [...]), ...]``.

    Each group keeps its original tokens; ``--name=value`` is one token. A value before the first
    flag is an error (it would be a positional argument to ``main.py``, which takes none).
    """
    groups: list[tuple[str, list[str]]] = []
    for token in tokens:
        if _is_flag_token(token):
            name = token[2:].split("=", 1)[0]
            groups.append((name, [token]))
        elif not groups:
            raise UserError(
                f"unexpected argument {token!r}: extra arguments for main.py must be flags (--name value)"
            )
        else:
            groups[-1][1].append(token)
    return groups


# -------------------------------------------------------------------------------------------------
# Loading and validation
# -------------------------------------------------------------------------------------------------
def _yaml_load(path: Path) -> object:
    import yaml

    try:
        # BaseLoader keeps every scalar as the text written (9.65e-6 stays "9.65e-6", as in a shell
        # script); typed fields are converted explicitly below.
        return yaml.load(path.read_text(encoding="utf-8"), Loader=yaml.BaseLoader)
    except yaml.YAMLError as err:
        raise UserError(f"{path} is not valid YAML: {' '.join(str(err).split())}") from err


def _as_int(value: object, where: str) -> int:
    try:
        return int(str(value))
    except ValueError as err:
        raise UserError(f"{where}: expected an integer, got {value!r}") from err


def _as_str_list(value: object, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise UserError(f"{where}: expected a string or a list of strings")


def _parse_flag_value(value: object, where: str) -> FlagValue:
    if isinstance(value, list):
        if not value or not all(isinstance(v, str) and v != "" for v in value):
            raise UserError(f"{where}: a list value must hold non-empty strings")
        return tuple(value)
    if isinstance(value, str):
        if value == _TRUE:
            return True
        if value in ("", "false", "null", "~"):
            raise UserError(f"{where}: {value!r} is not a value; delete the line to leave the flag out")
        return value
    raise UserError(f"{where}: flag values are text, true, or a list of text")


def _parse_recipe(step: StepSpec, rid: str, raw: object, source: str) -> Recipe:
    where = f"{source}: recipe {rid}"
    if not _ID_RE.match(rid):
        raise UserError(f"{where}: a recipe id is path-like words (letters, digits, . _ -) separated by /")
    if not isinstance(raw, dict):
        raise UserError(f"{where}: expected a mapping")
    unknown = set(raw) - _RECIPE_KEYS
    if unknown:
        raise UserError(f"{where}: unknown keys {', '.join(sorted(unknown))}")
    for required in ("description", "flags", "defaults", "launcher"):
        if required not in raw:
            raise UserError(f"{where}: missing {required!r}")

    flags_raw = raw["flags"]
    if not isinstance(flags_raw, dict) or not flags_raw:
        raise UserError(f"{where}: flags must be a non-empty mapping")
    flags: list[tuple[str, FlagValue]] = []
    for name, value in flags_raw.items():
        if not _FLAG_RE.match(name):
            raise UserError(f"{where}: flag name {name!r} must be lower_snake_case without dashes")
        flags.append((name, _parse_flag_value(value, f"{where}: flag {name}")))

    defaults_raw = raw["defaults"]
    if not isinstance(defaults_raw, dict) or set(defaults_raw) != set(step.params):
        raise UserError(f"{where}: defaults must give exactly {', '.join(step.params)} (null when required)")
    defaults = {k: (None if v in ("null", "~", "") else v) for k, v in defaults_raw.items()}
    for name in ZERO_STAGE_PARAMS & set(defaults):
        if defaults[name] is None or defaults[name] not in ("0", "1", "2", "3"):
            raise UserError(f"{where}: default {name} must be 0, 1, 2 or 3")
    if defaults["output_dir"] is None:
        raise UserError(f"{where}: output_dir needs a default")

    launcher_raw = raw["launcher"]
    if not isinstance(launcher_raw, dict):
        raise UserError(f"{where}: launcher must be a mapping (use {{}} for the launcher's defaults)")
    unknown = set(launcher_raw) - set(_LAUNCHER_INT_KEYS) - set(_LAUNCHER_STR_KEYS)
    if unknown:
        raise UserError(f"{where}: unknown launcher options {', '.join(sorted(unknown))}")
    launcher = Launcher(
        **{k: _as_int(v, f"{where}: launcher {k}") for k, v in launcher_raw.items() if k in _LAUNCHER_INT_KEYS},
        **{k: str(v) for k, v in launcher_raw.items() if k in _LAUNCHER_STR_KEYS},
    )

    env_raw = raw.get("env", {})
    if not isinstance(env_raw, dict) or not all(isinstance(v, str) for v in env_raw.values()):
        raise UserError(f"{where}: env must map names to text")

    recipe = Recipe(
        step=step,
        id=rid,
        description=str(raw["description"]),
        flags=tuple(flags),
        defaults=defaults,
        launcher=launcher,
        env=dict(env_raw),
        notes=_as_str_list(raw.get("notes", []), f"{where}: notes") if raw.get("notes") else (),
        upstream=raw.get("upstream"),
        script=str(raw.get("script") or _default_script(rid)),
        eta_seconds=_as_int(raw["eta_seconds"], f"{where}: eta_seconds") if "eta_seconds" in raw else None,
        source=source,
    )
    _check_templates(recipe, where)
    return recipe


def _default_script(rid: str) -> str:
    head, _, name = rid.rpartition("/")
    return f"{head}/run_{name}.sh" if head else f"run_{name}.sh"


def _check_templates(recipe: Recipe, where: str) -> None:
    """Every ``{x}`` names a parameter; every parameter is used; ``--output_dir`` is ``{output_dir}``."""
    used: set[str] = set()
    for name, value in recipe.flags:
        texts = value if isinstance(value, tuple) else ((value,) if isinstance(value, str) else ())
        for text in texts:
            for ref in _TEMPLATE_RE.findall(text):
                if ref not in recipe.step.params:
                    raise UserError(f"{where}: flag {name} refers to unknown parameter {{{ref}}}")
                used.add(ref)
    unused = set(recipe.step.params) - used
    if unused:
        raise UserError(f"{where}: parameters {', '.join(sorted(unused))} are never used in flags")
    if recipe.flag("output_dir") != "{output_dir}":
        raise UserError(f"{where}: flags must contain output_dir: \"{{output_dir}}\" (the launcher logs there)")
    if not recipe.script.endswith(".sh") or recipe.script.startswith("/") or ".." in Path(recipe.script).parts:
        raise UserError(f"{where}: script must be a relative path ending in .sh")


_CACHE: dict[tuple[str, float], dict[str, Recipe]] = {}


def load_step_recipes(step: str | StepSpec, root: str | os.PathLike | None = None) -> dict[str, Recipe]:
    """All recipes of one step, by id, in file order."""
    spec = step if isinstance(step, StepSpec) else step_spec(step)
    path = find_repo_root(root) / spec.config_file
    if not path.is_file():
        raise UserError(f"missing recipe file {path}")
    key = (str(path), path.stat().st_mtime)
    if key in _CACHE:
        return _CACHE[key]
    data = _yaml_load(path)
    if not isinstance(data, dict) or not isinstance(data.get("recipes"), dict):
        raise UserError(f"{path}: expected a mapping with a 'recipes' mapping")
    if data.get("step") != spec.key:
        raise UserError(f"{path}: 'step' must be {spec.key!r}")
    unknown = {k for k in data if k not in ("step", "recipes") and not str(k).startswith("_")}
    if unknown:
        raise UserError(f"{path}: unknown top-level keys {', '.join(sorted(unknown))} (prefix helpers with _)")
    source = spec.config_file
    recipes = {rid: _parse_recipe(spec, rid, raw, source) for rid, raw in data["recipes"].items()}
    scripts = [r.script for r in recipes.values()]
    if len(set(scripts)) != len(scripts):
        raise UserError(f"{path}: two recipes map to the same script")
    _CACHE[key] = recipes
    return recipes


def load_all(root: str | os.PathLike | None = None) -> dict[str, dict[str, Recipe]]:
    """Every step's recipes: ``{"step1": {...}, "step2": {...}, "dpo": {...}, "step3": {...}}``."""
    return {key: load_step_recipes(key, root) for key in STEPS}


def get_recipe(step: str | StepSpec, recipe_id: str, root: str | os.PathLike | None = None) -> Recipe:
    """One recipe, or a :class:`UserError` listing the close matches."""
    spec = step if isinstance(step, StepSpec) else step_spec(step)
    recipes = load_step_recipes(spec, root)
    rid = recipe_id.strip().strip("/")
    if rid.endswith(".sh"):  # accept the script path too: opt/single_gpu/run_1.3b.sh
        by_script = {r.script: r for r in recipes.values()}
        if rid in by_script:
            return by_script[rid]
    if rid in recipes:
        return recipes[rid]
    close = difflib.get_close_matches(rid, list(recipes), n=3, cutoff=0.5)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise UserError(
        f"no {spec.key} recipe {recipe_id!r}{hint}; available: {', '.join(recipes)} "
        f"(python -m dschat.recipes list {spec.key})"
    )


# -------------------------------------------------------------------------------------------------
# Generated shell scripts and READMEs
# -------------------------------------------------------------------------------------------------
GENERATED_MARK = "# Generated from configs/"


def script_path(recipe: Recipe, root: Path) -> Path:
    return root / recipe.step.folder / "training_scripts" / recipe.script


def _comment(text: str, width: int = 96) -> list[str]:
    import textwrap

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


# -------------------------------------------------------------------------------------------------
# CLI
# -------------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dschat.recipes", description="List, show, validate and generate launch recipes."
    )
    parser.add_argument("--repo-root", default=None, help="the dschat checkout (default: found automatically)")
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="list recipes")
    p_list.add_argument("step", nargs="?", default=None, help="step1, step2, dpo or step3 (default: all)")
    p_show = sub.add_parser("show", help="print a recipe's deepspeed command")
    p_show.add_argument("step")
    p_show.add_argument("recipe")
    p_show.add_argument("positionals", nargs="*", help="upstream-style positional values")
    sub.add_parser("validate", help="load and validate every recipe")
    sub.add_parser("write-scripts", help="(re)write training/*/training_scripts from configs/")
    sub.add_parser("check-scripts", help="exit 1 if the committed scripts differ from configs/")
    args = parser.parse_args(argv)

    if args.command == "list":
        steps = [step_spec(args.step).key] if args.step else list(STEPS)
        for key in steps:
            print(f"{key} ({STEPS[key].title}):")
            for recipe in load_step_recipes(key, args.repo_root).values():
                print(f"  {recipe.id:28s} {recipe.description}")
    elif args.command == "show":
        recipe = get_recipe(args.step, args.recipe, args.repo_root)
        print(recipe.command_preview(recipe.params_from_positionals(args.positionals)))
    elif args.command == "validate":
        total = sum(len(r) for r in load_all(args.repo_root).values())
        print(f"{total} recipes OK")
    elif args.command == "write-scripts":
        written = write_generated(args.repo_root)
        base = find_repo_root(args.repo_root)
        for path in written:
            print(f"wrote {path.relative_to(base)}" if path.exists() else f"deleted {path.relative_to(base)}")
        print(f"{len(written)} file(s) changed")
    elif args.command == "check-scripts":
        problems = check_generated(args.repo_root)
        for line in problems:
            print(line)
        if problems:
            raise SystemExit(1)
        print("training_scripts are in sync with configs/")


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
