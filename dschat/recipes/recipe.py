"""A launch recipe (:class:`Recipe`, :class:`Launcher`): its flags, its parameters, the argv it renders."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence, Union

from dschat.errors import UserError
from dschat.recipes.steps import SHELL_NAMES, ZERO_STAGE_PARAMS, StepSpec

FlagValue = Union[str, tuple, bool]  # "text", ("a", "b") for nargs flags, True for store_true

#: A ``{parameter}`` reference inside a flag value.
TEMPLATE_RE = re.compile(r"\{([^{}]*)\}")


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
        the flag that stands for a parameter (:func:`param_flag`: ``--output_dir`` for ``{output_dir}``)
        sets that parameter, so the recipe's other flags made from it (``--tensorboard_path
        "{output_dir}"``) follow it; ``unset`` drops recipe flags (e.g. ``enable_hybrid_engine``).
        """
        resolved = self.resolve_params(params)
        extra_groups = split_flag_groups(extra)
        for name, tokens in extra_groups:  # the last one given wins, as in main.py's parser
            value = tokens[0].split("=", 1)[1] if "=" in tokens[0] else tokens[1] if len(tokens) == 2 else None
            param = next((p for p in resolved if param_flag(p) == name), None)
            if value and param is not None and ("{" + param + "}") in [v for n, v in self.flags if n == name]:
                resolved[param] = value  # the recipe fills this flag from that parameter alone
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
    return TEMPLATE_RE.sub(lambda m: params[m.group(1)], text)


def param_flag(param: str) -> str:
    """The ``main.py`` flag that stands for a recipe parameter: ``output_dir`` and the ZeRO stages are
    their own; step 3's ``actor_model`` / ``critic_model`` are ``--actor_model_name_or_path`` /
    ``--critic_model_name_or_path``."""
    return f"{param}_name_or_path" if param.endswith("_model") else param


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
