"""The package's layering rules, checked on the source (AST), so the picture in docs/DESIGN.md cannot
drift from the code:

(a) no import cycles between dschat modules, counting imports inside functions (only imports under
    ``if TYPE_CHECKING:`` are exempt);
(b) floors: a module imports only its own package or units on a lower floor (FLOORS below);
(c) ``dschat/utils`` and ``dschat/testing`` are upstream / earlier import paths only: no definitions,
    and nothing else inside dschat imports them;
(d) a line cap per module, with today's larger modules named as explicit exceptions that may not grow;
(e) function-level imports: a ratchet on their number (it may only go down), and each one has a comment
    saying why ("lazy: <measured import-time cost>", or an optional package).
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

from helpers import REPO

PKG = REPO / "dschat"

# Units (a package under dschat/, a top-level module, or "dschat" itself for the package's
# __init__), lowest floor first. A unit may import its own modules and the units of lower floors.
FLOORS: list[tuple[str, ...]] = [
    # 0-2: the ground floor
    ("errors", "paths", "version"),  # 0: the one error type, file names, the version
    ("multinode",),  # 1: host, port and environment checks (torch-free; the launcher's and dist's defaults)
    ("runtime",),  # 2: distributed set-up, files, DeepSpeed config, optimizers, ZeRO-3, perf, averages
    ("dschat", "rl_math", "gold_judge", "cli", "recipes", "launch_log"),  # 3: pure RL math, the gold judge, flags,
    # recipes; the launcher's training.log (written as runtime.fs opens a file in an output folder)
    ("models", "rewards"),  # 4: model builders, reward functions
    ("data", "envs", "envs_examples", "remote_reward"),  # 5: datasets, tokenisation, cache, collators; environments,
    # the example; the reward server's client
    ("training", "eval"),  # 6: steps 1-2's loop, step 3's resume counters, checkpoints; the report
    ("rlhf",),  # 7: step 3
    ("launch", "plan", "serve"),  # 8: the launcher (entry point); the memory planner (reads step 3's configs); the server
    ("utils", "testing"),  # 9: alias modules only (rule c)
]
ALIAS_UNITS = ("utils", "testing")

# Lower rooms within a unit: a package that imports nothing else of its unit (the unit's other
# modules build on it, never the other way round).
LOWER_ROOMS: dict[str, str] = {
    "dschat.rlhf.rollout": "dschat.rlhf",  # step 3's decoding paths and the generator that asks them
}

# (d) A module should hold one idea and stay under SOFT_CAP lines. These were over it when the rule
# was written; each is to be split (see docs/DESIGN.md), and none may grow past the size it had then.
SOFT_CAP = 600
OVER_CAP = {
}

# (e) Imports inside functions hide a module's dependencies. Most of those left avoid an import-time
# cost for light entry points (the launcher, --help, the recipes, the tokenizer loader import no
# torch / transformers / matplotlib); others are plain leftovers. The number may only go down.
MAX_FUNCTION_LEVEL_IMPORTS = 50


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _unit(module: str) -> str:
    parts = module.split(".")
    return "dschat" if len(parts) == 1 else parts[1]


def _resolve(name: str) -> str | None:
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[tuple[ast.stmt, bool]]:
    """Every import statement with whether it sits inside a function; ``if TYPE_CHECKING:`` skipped."""
    found: list[tuple[ast.stmt, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub, in_function)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def _graph() -> tuple[dict[str, set[str]], int]:
    edges: dict[str, set[str]] = defaultdict(set)
    function_level = 0
    for module, path in MODULES.items():
        for node, in_function in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            function_level += in_function
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif node.level == 0 and node.module:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                names = []
            for name in names:
                target = _resolve(name) if name.startswith("dschat") else None
                if target and target != module:
                    edges[module].add(target)
    return edges, function_level


EDGES, FUNCTION_LEVEL_IMPORTS = _graph()


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(set(edges) | {w for targets in edges.values() for w in targets}):
        if v not in index:
            connect(v)
    return found


def test_the_checker_sees_function_level_imports_and_skips_type_checking():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import dschat.rlhf\n"
                     "def f():\n    from dschat.models import build\n")
    assert [(type(n).__name__, inside) for n, inside in _imports(tree)] == [("ImportFrom", False), ("ImportFrom", True)]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_a_no_import_cycles():
    assert _cycles(EDGES) == []


def test_b_every_unit_has_a_floor():
    placed = {unit for floor in FLOORS for unit in floor}
    assert {_unit(m) for m in MODULES} <= placed, "add the new package or module to FLOORS (and docs/DESIGN.md)"


def test_b_no_import_reaches_up_or_sideways():
    floor_of = {unit: i for i, floor in enumerate(FLOORS) for unit in floor}
    wrong = sorted(f"{m} (floor {floor_of[_unit(m)]}) imports {t} (floor {floor_of[_unit(t)]})"
                   for m, targets in EDGES.items() for t in targets
                   if _unit(m) != _unit(t) and floor_of[_unit(t)] >= floor_of[_unit(m)])
    assert not wrong, "\n".join(wrong)


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("room,unit", sorted(LOWER_ROOMS.items()))
def test_b_a_lower_room_imports_nothing_else_of_its_unit(room, unit):
    assert any(_inside(m, room) for m in MODULES), f"{room} is not a package of dschat"
    wrong = sorted(f"{m} imports {t}" for m, targets in EDGES.items() if _inside(m, room)
                   for t in targets if _inside(t, unit) and not _inside(t, room))
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("unit", ALIAS_UNITS)
def test_c_alias_packages_hold_no_definitions(unit):
    for path in sorted((PKG / unit).rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            allowed = (isinstance(node, (ast.Import, ast.ImportFrom))
                       or (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))  # docstring
                       or (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]))
            assert allowed, f"{path.relative_to(PKG.parent)}:{node.lineno} defines something; aliases only"


def test_c_nothing_inside_dschat_imports_the_alias_packages():
    wrong = sorted(f"{m} imports {t}" for m, targets in EDGES.items() for t in targets
                   if _unit(t) in ALIAS_UNITS and _unit(m) not in ALIAS_UNITS)
    assert not wrong, "\n".join(wrong)


def test_d_module_sizes():
    sizes = {str(p.relative_to(PKG.parent)): len(p.read_text(encoding="utf-8").splitlines()) for p in MODULES.values()}
    too_big = {name: n for name, n in sizes.items() if n > OVER_CAP.get(name, SOFT_CAP)}
    assert not too_big, f"over the line cap (split them): {too_big}"
    shrunk = {name: sizes.get(name, 0) for name, cap in OVER_CAP.items() if sizes.get(name, 0) <= SOFT_CAP}
    assert not shrunk, f"now under {SOFT_CAP} lines: drop them from OVER_CAP: {shrunk}"


def test_e_function_level_imports_only_go_down():
    assert FUNCTION_LEVEL_IMPORTS <= MAX_FUNCTION_LEVEL_IMPORTS, (
        f"{FUNCTION_LEVEL_IMPORTS} imports inside functions (cap {MAX_FUNCTION_LEVEL_IMPORTS}): put the new one at "
        "the top of its module, or measure its import-time cost and say so in a comment")


def _reason_for(lines: list[str], node: ast.stmt) -> str:
    """The comments that say why a function-level import is there: on the lines of the run of imports
    it belongs to, on the line just above that run when it is code ending in a comment (``try:  #
    lazy: ...``), and in the comment lines above the run."""
    comments = []
    j = node.lineno - 1
    while j >= 0 and (j == node.lineno - 1 or lines[j].lstrip().startswith(("import ", "from "))):
        if "#" in lines[j]:
            comments.append(lines[j].split("#", 1)[1])
        j -= 1  # the same run of imports
    if j >= 0 and "#" in lines[j] and not lines[j].lstrip().startswith("#"):
        comments.append(lines[j].split("#", 1)[1])
    while j >= 0 and lines[j].lstrip().startswith("#"):
        comments.append(lines[j].lstrip()[1:])
        j -= 1
    return " ".join(comments)


def test_e_every_function_level_import_says_why():
    """Rule (e): an import inside a function is there for a measured import-time cost (or an optional
    package), and a comment beside it says so; "see f" points at the comment that measured it."""
    unexplained = []
    for path in MODULES.values():
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for node, in_function in _imports(ast.parse(text)):
            reason = _reason_for(lines, node) if in_function else "module level"
            if not any(word in reason for word in ("lazy", "optional", "module level")):
                unexplained.append(f"{path.relative_to(PKG.parent)}:{node.lineno}")
    assert not unexplained, ("imports inside functions without a comment saying why (lazy: <measured cost>): "
                             + ", ".join(sorted(unexplained)))


def test_design_doc_lists_every_module():
    design = (PKG.parent / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    missing = sorted(str(p.relative_to(PKG.parent)) for m, p in MODULES.items()
                     if p.name != "__init__.py" and _unit(m) not in ALIAS_UNITS and m != "dschat.version"
                     and f"`{p.relative_to(PKG.parent)}`" not in design)
    assert not missing, f"docs/DESIGN.md has no line for {missing}"
