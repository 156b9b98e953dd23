"""Finding the checkout and loading its recipes: the YAML files in ``configs/``, validated.

The format is described in ``configs/README.md``.
"""
from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

import yaml

from dschat.errors import UserError
from dschat.recipes.recipe import TEMPLATE_RE, FlagValue, Launcher, Recipe
from dschat.recipes.steps import STEPS, ZERO_STAGE_PARAMS, StepSpec, step_spec
from dschat.runtime.trust import untrusted_inside, untrusted_reason

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$")
_FLAG_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_RECIPE_KEYS = frozenset(
    {"upstream", "description", "notes", "launcher", "env", "defaults", "flags", "script", "eta_seconds"}
)
_LAUNCHER_INT_KEYS = {"num_gpus": (1, None), "num_nodes": (1, None), "master_port": (1, 65535)}  # lowest, highest
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LAUNCHER_STR_KEYS = ("hostfile", "master_addr", "include", "exclude")
_TRUE = "true"


# -------------------------------------------------------------------------------------------------
# Repository root (where configs/ and training/ live)
# -------------------------------------------------------------------------------------------------
def _is_repo_root(path: Path) -> bool:
    return (path / "configs" / "step1.yaml").is_file() and (path / "training").is_dir()


def _checked_root(label: str, path: Path) -> Path:
    # The checkout's configs/ and training/.../main.py decide what runs: it must be the user's (or
    # root's, for a system-wide install) and writable by nobody else.
    reason, where = untrusted_reason(path, root_may_own=True), str(path)
    for part in ("configs", "training", "dschat"):  # the recipes, the step scripts, the package they import
        if not reason and (path / part).is_dir():
            reason = untrusted_reason(path / part, root_may_own=True) or untrusted_inside(path / part,
                                                                                           root_may_own=True)
            where = f"-R {path / part}"
    if reason:
        fix = "use your own clone" if "belongs to" in reason else f"use your own clone, or chmod go-w {where}"
        raise UserError(f"{label} {path} is not safe to run: {reason}; a checkout that others can change could "
                        f"run their code: {fix}")
    return path


def find_repo_root(explicit: str | os.PathLike | None = None) -> Path:
    """The checkout that holds ``configs/`` and ``training/``.

    Only places the user chose are searched, in order: ``explicit`` (``--repo-root``; the shell
    scripts pass their own checkout), ``$DSCHAT_REPO_ROOT``, the checkout this package was imported
    from (an editable install, or ``PYTHONPATH`` pointing at a checkout), and the working directory
    itself. Its parents are not searched: a folder such as ``/tmp`` that others can write to could
    hold a planted checkout. The checkout must be the user's and writable by nobody else
    (:func:`dschat.runtime.trust.untrusted_reason`).
    """
    for label, value in (("--repo-root", explicit), ("DSCHAT_REPO_ROOT", os.environ.get("DSCHAT_REPO_ROOT"))):
        if value:
            path = Path(value).expanduser().resolve()
            if not _is_repo_root(path):
                raise UserError(f"{label} {path} is not a dschat checkout (no configs/step1.yaml and training/)")
            return _checked_root(label, path)
    package_checkout = Path(__file__).resolve().parents[2]
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
# Loading and validation
# -------------------------------------------------------------------------------------------------
class _RepeatedKey(yaml.YAMLError):
    pass


class _TextLoader(yaml.BaseLoader):
    """YAML's BaseLoader (every scalar the text written: 9.65e-6 stays "9.65e-6", as in a shell
    script; typed fields are converted explicitly), refusing a key given twice in one mapping (the
    loader would keep the last silently: a recipe's second ``learning_rate``, or a second recipe of
    the same id)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise _RepeatedKey(f"line {key_node.start_mark.line + 1}: the key {key!r} is given twice in one "
                                   "mapping (YAML would keep only the last); keep one")
            seen.add(key if isinstance(key, str) else id(key_node))
        return super().construct_mapping(node, deep)


def yaml_text_load(path: Path) -> object:
    """``path``'s YAML, every scalar as text (:class:`_TextLoader`); bad YAML or a repeated key is one
    :class:`UserError` line."""
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_TextLoader)
    except _RepeatedKey as err:
        raise UserError(f"{path}, {err}") from err
    except yaml.YAMLError as err:
        raise UserError(f"{path} is not valid YAML: {' '.join(str(err).split())}") from err



def _as_int(value: object, where: str, low: int | None = None, high: int | None = None) -> int:
    try:
        number = int(str(value)) if isinstance(value, str) else None
    except ValueError:
        number = None
    if number is None or (low is not None and number < low) or (high is not None and number > high):
        span = f" from {low}" if low is not None else ""
        span += f" to {high}" if high is not None else ""
        raise UserError(f"{where}: expected a whole number{span}, got {value!r}")
    return number


def _as_text(value: object, where: str, *, one_line: bool = False) -> str:
    if not isinstance(value, str) or (one_line and ("\n" in value or "\r" in value)):
        raise UserError(f"{where}: expected {'one line of ' if one_line else ''}text, got {value!r}")
    return value


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
        if value.lower() in ("", "false", "null", "~"):
            raise UserError(f"{where}: {value!r} is not a value; delete the line to leave the flag out")
        if value.lower() == _TRUE:
            raise UserError(f"{where}: write {value!r} as true (a switch: --{where.rsplit(' ', 1)[-1]} alone)")
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
    defaults = {k: (None if v in ("null", "~", "") else _as_text(v, f"{where}: default {k}", one_line=True))
                for k, v in defaults_raw.items()}
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
        **{k: _as_int(v, f"{where}: launcher {k}", *_LAUNCHER_INT_KEYS[k])
           for k, v in launcher_raw.items() if k in _LAUNCHER_INT_KEYS},
        **{k: _as_text(v, f"{where}: launcher {k}", one_line=True)
           for k, v in launcher_raw.items() if k in _LAUNCHER_STR_KEYS},
    )

    env_raw = raw.get("env", {})
    if not isinstance(env_raw, dict) or not all(isinstance(v, str) for v in env_raw.values()):
        raise UserError(f"{where}: env must map names to text")
    for name in env_raw:
        if not _ENV_RE.match(name):
            raise UserError(f"{where}: env name {name!r} is not a variable name (letters, digits and _)")

    recipe = Recipe(
        step=step,
        id=rid,
        description=_as_text(raw["description"], f"{where}: description"),
        flags=tuple(flags),
        defaults=defaults,
        launcher=launcher,
        env=dict(env_raw),
        notes=_as_str_list(raw.get("notes", []), f"{where}: notes") if raw.get("notes") else (),
        upstream=_as_text(raw["upstream"], f"{where}: upstream", one_line=True) if raw.get("upstream") else None,
        script=_as_text(raw.get("script") or _default_script(rid), f"{where}: script", one_line=True),
        eta_seconds=_as_int(raw["eta_seconds"], f"{where}: eta_seconds", 0) if "eta_seconds" in raw else None,
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
            for ref in TEMPLATE_RE.findall(text):
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
    data = yaml_text_load(path)
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
