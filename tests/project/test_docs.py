"""The documentation holds together: links resolve, documented commands use flags that exist, paths
quoted in the code exist, and docs/flags.md is what the step scripts' parsers give.

Each check is a function of the text it reads, so a test below also feeds it a broken example and
expects the failure.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import io
import os
import re
import shlex
import shutil
import tokenize
from functools import lru_cache
from pathlib import Path

import pytest

from dschat.recipes.flags_doc import (
    FLAGS_DOC,
    REGENERATE,
    check_flags_doc,
    load_script,
    parser_of,
    render_flags_doc,
    step_parser,
)
from dschat.recipes.steps import STEPS, step_spec
from dschat.recipes.upstream_flags import UPSTREAM_DEFAULTS, UPSTREAM_FLAGS

from helpers import REPO

DOC_FILES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "training").glob("*/README.md"),
                    REPO / "benchmarks" / "README.md", REPO / "configs" / "README.md"])

# ---------------------------------------------------------------------------------------------
# Markdown: links and anchors
# ---------------------------------------------------------------------------------------------
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text without fenced blocks and code spans (a link there is an example, not a link)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: links reduced to their text, lower case, punctuation dropped
    (``-`` and ``_`` kept), each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor of a markdown text: its headings (``-1``, ``-2`` for repeats) and explicit ids."""
    seen: dict[str, int] = {}
    out = set(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    for match in _HEADING.finditer(_FENCE.sub("", text)):
        base = slug(match.group(2))
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def broken_links(path: Path, text: str) -> list[str]:
    """``path``'s relative links whose file (or heading) does not exist."""
    problems = []
    for target in _LINK.findall(_prose(text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{path.relative_to(REPO)}: link to {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
            problems.append(f"{path.relative_to(REPO)}: link to {target}: no such heading")
    return problems


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path):
    problems = broken_links(path, path.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


def test_a_broken_link_or_anchor_is_caught():
    readme = REPO / "README.md"
    assert broken_links(readme, "[a](docs/no-such-page.md)") == ["README.md: link to docs/no-such-page.md: no such file"]
    assert broken_links(readme, "[a](docs/flags.md#no-such-heading)") == [
        "README.md: link to docs/flags.md#no-such-heading: no such heading"]
    assert broken_links(readme, "[a](#no-such-heading)") == ["README.md: link to #no-such-heading: no such heading"]
    assert broken_links(readme, "[a](docs/flags.md#step-3-ppo-rlhf) `[b](nowhere.md)` [c](https://x.org/y)") == []


def test_slugs_follow_github():
    assert slug("Step 3: PPO (RLHF)") == "step-3-ppo-rlhf"
    assert slug("`--flag` and `e2e_rlhf.py`") == "--flag-and-e2e_rlhfpy"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def test_every_docs_page_is_reachable_from_the_readme():
    reached, todo = set(), [REPO / "README.md"]
    while todo:
        page = todo.pop()
        if page in reached or page.suffix != ".md" or not page.is_file():
            continue
        reached.add(page)
        for target in _LINK.findall(_prose(page.read_text(encoding="utf-8"))):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target) and target.partition("#")[0]:
                todo.append((page.parent / target.partition("#")[0]).resolve())
    unreached = sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md") if p.resolve() not in reached)
    assert not unreached, f"not reachable from README.md: {unreached}"


def test_readme_is_short():
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) <= 250


# ---------------------------------------------------------------------------------------------
# Commands in ```bash blocks: every --flag exists
# ---------------------------------------------------------------------------------------------
_LAUNCHER_OPTIONS = {"--hostfile", "--master_addr", "--master_port", "--num_nodes", "--num_gpus"}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    out = set()
    for action in parser._actions:
        out.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _options(sub)
    return out


@lru_cache(maxsize=None)
def _step_options(step: str) -> frozenset[str]:
    return frozenset(_options(step_parser(step, REPO)))


@lru_cache(maxsize=None)
def _program_options(program: str) -> frozenset[str]:
    """The options of a dschat program: ``e2e_rlhf.py``, ``chat.py``, ``dschat.launch``, a module or script."""
    if program.endswith(".py"):
        module = load_script(REPO / program)
    else:
        module = importlib.import_module(program)
        if hasattr(module, "__path__"):  # a package: `python -m` runs its __main__
            module = importlib.import_module(f"{program}.__main__")
    parser = module.build_parser() if hasattr(module, "build_parser") else parser_of(module.main, [])
    options = _options(parser)
    if program == "chat.py":  # passes the rest to inference/chatbot.py
        options |= _program_options("inference/chatbot.py")
    return frozenset(options)


def _step_of(path: str) -> str | None:
    for key, spec in STEPS.items():
        if path.startswith(spec.folder + "/") or path == spec.folder:
            return key
    return None


def _allowed(tokens: list[str], cwd: str) -> frozenset[str] | None:
    """The options a command may use, or None for a program that is not dschat's."""
    prog, rest = Path(tokens[0]).name, tokens[1:]
    if prog in ("python", "python3", "deepspeed"):
        args = [t for t in rest if not t.startswith("--") or t.endswith(".py")]
        if prog != "deepspeed" and rest[:1] == ["-m"]:
            module = rest[1]
            if module == "dschat.launch":
                step = next((t for t in rest[2:] if not t.startswith("-")), None)
                return _program_options(module) | _step_options(step_spec(step).key)
            if module == "dschat.plan" and "--step" in rest:  # the planned step's own flags
                from dschat.plan.cli import build_parser as plan_parser

                return frozenset(_options(plan_parser(int(rest[rest.index("--step") + 1]))))
            return _program_options(module) if module.startswith("dschat") else None
        script = next((t for t in args if t.endswith(".py")), None)
        if script is None:
            return None
        path = os.path.normpath(os.path.join(cwd, script))
        step = _step_of(path)
        if step and Path(path).name == "main.py":
            return _step_options(step)
        if not (REPO / path).is_file():
            raise AssertionError(f"{' '.join(tokens)}: no such script {path}")
        return _program_options(path)
    if prog == "bash" and rest and rest[0].endswith(".sh"):
        step = _step_of(rest[0])
        return _step_options(step) | _LAUNCHER_OPTIONS if step else None
    return None


def bad_flags(block: str, cwd: str = "") -> list[str]:
    """Flags in a ```bash block's dschat commands that their program does not define; relative paths
    from ``cwd`` (relative to the checkout), or from the folder a ``cd`` in the block names."""
    problems = []
    text = block.replace("\\\n", " ")
    for line in text.splitlines():
        for command in re.split(r"&&|\|\||;|\s\|\s", line):
            try:
                tokens = shlex.split(command, comments=True)
            except ValueError:
                tokens = command.split()
            tokens = [t.strip("[]") for t in tokens]
            while tokens and re.fullmatch(r"[A-Za-z_]\w*=.*", tokens[0], re.S):  # NAME=value settings
                tokens = tokens[1:]
            if not tokens:
                continue
            if tokens[0] == "cd" and len(tokens) > 1:
                cwd = os.path.normpath(os.path.join(cwd, tokens[1]))
                continue
            allowed = _allowed(tokens, cwd)
            if allowed is None:
                continue
            if Path(tokens[0]).name == "deepspeed":  # the launcher's own options precede the script
                tokens = tokens[next(i for i, t in enumerate(tokens) if t.endswith(".py")):]
            for token in tokens[1:]:
                flag = token.split("=", 1)[0]
                if flag.startswith("--") and flag != "--" and flag not in allowed:
                    problems.append(f"{flag} in: {' '.join(tokens)}")
    return problems


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_documented_commands_use_flags_that_exist(path):
    # A step's README runs its commands from the step's folder; every other page from the checkout.
    folder = str(path.parent.relative_to(REPO)) if path.parent.parent == REPO / "training" else ""
    problems = [p for block in _bash_blocks(path.read_text(encoding="utf-8")) for p in bad_flags(block, folder)]
    assert not problems, f"{path.relative_to(REPO)}:\n" + "\n".join(problems)


def test_a_misspelt_flag_is_caught():
    assert bad_flags("python training/step3_rlhf_finetuning/main.py --actor_lr 1e-5") == [
        "--actor_lr in: python training/step3_rlhf_finetuning/main.py --actor_lr 1e-5"]
    assert bad_flags("python e2e_rlhf.py --actor_model 1.3b")  # e2e spells it --actor-model
    assert bad_flags("DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python e2e_rlhf.py --actor_model 1.3b") == [
        "--actor_model in: python e2e_rlhf.py --actor_model 1.3b"]
    assert bad_flags("python -m dschat.launch step1 opt/single_gpu/1.3b --output_dir O -- --kl_ctl 0.1")  # step 3's
    assert bad_flags("cd training/step2_reward_model_finetuning && python main.py --beta 0.1")  # DPO's
    assert bad_flags("bash training/step1_supervised_finetuning/training_scripts/opt/single_gpu/run_1.3b.sh O 2 \\\n"
                     "    --hostfile h --lora_dim 8 --no_such_flag 1") == [
        "--no_such_flag in: bash training/step1_supervised_finetuning/training_scripts/opt/single_gpu/run_1.3b.sh "
        "O 2 --hostfile h --lora_dim 8 --no_such_flag 1"]
    assert bad_flags("pip install --no-such-pip-flag x && python -m pytest --whatever") == []
    assert bad_flags("deepspeed --num_gpus 2 main.py --zero_stage 2", "training/step1_supervised_finetuning") == []
    assert bad_flags("deepspeed --num_gpus 2 main.py --zero_stag 2", "training/step1_supervised_finetuning")


# ---------------------------------------------------------------------------------------------
# Paths quoted in the code
# ---------------------------------------------------------------------------------------------
_QUOTED_PATH = re.compile(
    r"(?<![\w/.])((?:tests|docs|benchmarks|dschat|training|configs|inference|\.ci)/[\w./*-]*\w\.(?:py|md|yaml|json|sh|png))"
    r"(?:#([\w-]+)|::(\w+))?")


def missing_paths(rel: str, text: str) -> list[tuple[str, str]]:
    """(file, path) for each repository path quoted in ``text`` that matches no file, whose
    ``#anchor`` names no heading of that markdown file, or whose ``::test`` names no function or
    class of that Python file."""
    out = []
    for path, anchor, test in _QUOTED_PATH.findall(text):
        if "..." in path or "{" in path:
            continue
        if not (list(REPO.glob(path)) if "*" in path else (REPO / path).exists()):
            out.append((rel, path))
        elif anchor and path.endswith(".md") and anchor not in anchors((REPO / path).read_text(encoding="utf-8")):
            out.append((rel, f"{path}#{anchor}"))
        elif test and path.endswith(".py") and not re.search(
                rf"^\s*(?:async\s+)?(?:def|class)\s+{test}\b", (REPO / path).read_text(encoding="utf-8"), re.M):
            out.append((rel, f"{path}::{test}"))
    return out


def test_paths_quoted_in_the_code_exist():
    files = [*sorted((REPO / "dschat").rglob("*.py")), REPO / "benchmarks" / "README.md"]
    found = {m for f in files for m in missing_paths(str(f.relative_to(REPO)), f.read_text(encoding="utf-8"))}
    assert not found, "no such file: " + ", ".join(f"{p} (quoted in {f})" for f, p in sorted(found))


_DOTTED = re.compile(r"(?<![\w./-])dschat(?:\.\w+)+")


@lru_cache(maxsize=None)
def _top_level_names(module_file: Path) -> dict[str, set[str] | None]:
    """A module's top-level names; for a class, the names defined in its body (else None)."""
    names: dict[str, set[str] | None] = {}
    for node in ast.parse(module_file.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                             ast.ClassDef))}
            names[node.name] |= {t.id for n in node.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                                 for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                                 if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = None
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(t, ast.Name):
                    names[t.id] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(a.asname or a.name).split(".")[0]: None for a in node.names})
        elif isinstance(node, (ast.If, ast.Try)):  # names defined under TYPE_CHECKING or a try: kept loosely
            names.update({n.name: None for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.ClassDef))})
    return names


def missing_names(rel: str, text: str, root: Path = REPO) -> list[tuple[str, str]]:
    """(file, name) for each dotted ``dschat.module.name`` in ``text``'s comments and docstrings that
    names no module of the checkout, or no top-level name of that module (no member of that class)."""
    out = []
    for _, s in prose_of(text):
        for dotted in _DOTTED.findall(s):
            parts = dotted.split(".")
            for i in range(len(parts), 0, -1):
                base = root.joinpath(*parts[:i])
                module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
                if module.is_file():
                    break
            rest = parts[i:]
            if rest:
                names = _top_level_names(module)
                if rest[0] not in names and not (root.joinpath(*parts[:i], rest[0]).with_suffix(".py").is_file()):
                    out.append((rel, dotted))
                elif len(rest) > 1 and names.get(rest[0]) is not None and rest[1] not in names[rest[0]]:
                    out.append((rel, dotted))
    return out


def test_modules_and_names_quoted_in_the_code_exist():
    found = [m for f in _code_files()
             for m in missing_names(str(f.relative_to(REPO)), f.read_text(encoding="utf-8"))]
    assert not found, "no such module or name: " + ", ".join(f"{n} (quoted in {f})" for f, n in found)


def test_a_missing_module_or_name_is_caught():
    text = ('"""See :func:`dschat.eval.report.reward_scores`, :mod:`dschat.no_such_module`,\n'
            ':func:`~dschat.eval.scoring.reward_scores`, :class:`dschat.errors.UserError` and\n'
            ':meth:`dschat.models.lora.LinearLayer_LoRA.fuse_lora_weight`,\n'
            'not ``dschat.models.lora.LinearLayer_LoRA.nope``."""\n'
            '# dschat.rlhf is a package; dschat.rlhf.ppo_update a module of it\n')
    assert missing_names("x.py", text) == [("x.py", "dschat.eval.report.reward_scores"),
                                           ("x.py", "dschat.no_such_module"),
                                           ("x.py", "dschat.models.lora.LinearLayer_LoRA.nope")]


def test_a_missing_quoted_path_is_caught():
    text = ("tested in ``tests/rlhf/test_no_such.py``; see docs/flags.md and tests/rlhf/test_tensor_parallel*.py; "
            "docs/upstream.md#pad-and-eos, docs/upstream.md#no-such-heading, "
            "tests/project/test_docs.py::test_slugs_follow_github, tests/project/test_docs.py::test_no_such_test")
    assert missing_paths("x.py", text) == [("x.py", "tests/rlhf/test_no_such.py"),
                                           ("x.py", "docs/upstream.md#no-such-heading"),
                                           ("x.py", "tests/project/test_docs.py::test_no_such_test")]


# ---------------------------------------------------------------------------------------------
# docs/flags.md
# ---------------------------------------------------------------------------------------------
def test_flags_doc_is_up_to_date():
    problems = check_flags_doc(REPO)
    assert not problems, "\n".join(problems)


def test_a_stale_flags_doc_is_caught(tmp_path):
    for part in ("configs", "training"):
        shutil.copytree(REPO / part, tmp_path / part)
    (tmp_path / "docs").mkdir()
    assert check_flags_doc(tmp_path) == [f"missing {FLAGS_DOC}: run {REGENERATE}"]
    (tmp_path / FLAGS_DOC).write_text(render_flags_doc(REPO).replace("| `0.1` |", "| `0.2` |", 1), encoding="utf-8")
    assert check_flags_doc(tmp_path) == [f"out of date {FLAGS_DOC}: run {REGENERATE}"]


@pytest.mark.parametrize("step", list(STEPS))
def test_every_upstream_flag_is_kept(step):
    dests = {a.dest for a in step_parser(step, REPO)._actions}
    assert UPSTREAM_FLAGS[step] <= dests, sorted(UPSTREAM_FLAGS[step] - dests)
    assert {flag for s, flag in UPSTREAM_DEFAULTS if s == step} <= UPSTREAM_FLAGS[step]


def test_flags_doc_marks_origins():
    text = (REPO / FLAGS_DOC).read_text(encoding="utf-8")
    step3 = text.split("## Step 3")[1]
    assert re.search(r"^\| `--kl_ctl` \| `0.1` \| dschat \|", step3, re.M)
    assert re.search(r"^\| `--actor_learning_rate` \| `9.65e-06` \| upstream \|", step3, re.M)
    assert re.search(r"^\| `--seed` \| `1234` \| upstream \(default was `None`", step3, re.M)


# ---------------------------------------------------------------------------------------------
# The docstring policy (docs/contributing.md#docstrings-and-comments), on comments and docstrings
# ---------------------------------------------------------------------------------------------
def prose_of(text: str) -> list[tuple[int, str]]:
    """(line, text) of every comment block (a comment and the whole-line comments right below it) and
    every string that stands alone as a statement (module, class, function and attribute docstrings)
    of Python source."""
    out: list[tuple[int, str]] = []
    block: list = []  # [first line, last line, texts]
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type != tokenize.COMMENT:
            continue
        if block and block[1] == tok.start[0] - 1 and tok.line.lstrip().startswith("#"):
            block[1] = tok.start[0]
            block[2].append(tok.string)
        else:
            block = [tok.start[0], tok.start[0], [tok.string]]
            out.append(block)  # type: ignore[arg-type]
    out = [(b[0], " ".join(b[2])) for b in out]  # type: ignore[index]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.append((node.lineno, node.value.value))
    return sorted(out)


def _code_files() -> list[Path]:
    return sorted((REPO / "dschat").rglob("*.py"))


# History of this code and issue numbers belong in commit messages. An upstream issue is described
# in docs/upstream.md and the code links there, so no issue number of any project stands in the code.
_HISTORY = re.compile(
    r"before this change|as before the split|\buntil now\b|\bpreviously\b|\bformerly\b"
    r"|(?<!is )(?<!are )(?<!was )(?<!were )(?<!be )(?<!been )(?<!not )\bused to\b"  # "it used to", not "is used to"
    r"|\bnow (?:also|only|always|never)\b"
    r"|\bissues?\b|(?<![\w&])#\d+\b|\bDSE\b", re.I)



def history_phrases(rel: str, text: str) -> list[tuple[str, str]]:
    """(file:line, phrase) for each story of past code or issue number in ``text``'s comments and
    docstrings."""
    return [(f"{rel}:{line}", m.group(0)) for line, s in prose_of(text) for m in _HISTORY.finditer(s)]


def test_code_holds_no_history_or_issue_numbers():
    found = [h for f in _code_files()
             for h in history_phrases(str(f.relative_to(REPO)), f.read_text(encoding="utf-8"))]
    assert not found, ("history and issue numbers belong in commit messages, upstream's issues in "
                       "docs/upstream.md: " + ", ".join(f"{p!r} at {f}" for f, p in found))


def test_history_and_issue_numbers_are_caught():
    text = ('"""Before this change it was slow (issue 21; see #6). Upstream\'s DSE #437/#558, DS #4788, TRL\n'
            'PR #3493. It used to pad; the mask is used to pad; now also sorted."""\n'
            'x = "#12 in a string is code"  # as before the split\n# previously\n# a colour: &#39;\n')
    assert [p for _, p in history_phrases("x.py", text)] == [
        "Before this change", "issue", "#6", "DSE", "#437", "#558", "#4788", "#3493", "used to", "now also",
        "as before the split", "previously"]
    assert history_phrases("x.py", text)[-1][0] == "x.py:3"  # the comment block starting on line 3


# Timings live in benchmarks/results.md, with their command. A timing here: a duration (a number and a
# unit of time) or a speed-up factor. A duration that is a contract (a default timeout) is listed.
_TIMING = re.compile(
    r"(?<![\w.^])\d+(?:\.\d+)?\s?(?:ms|µs|s|secs?|seconds?|mins?|minutes?|hours?)\b"
    r"|(?<![\w.])\d+\.\d+\s?[x×](?![\w^])|\d\s?[x×]\s?(?:faster|slower|quicker|speed-?up)"
    r"|\d\s?%\s?(?:faster|slower|quicker|less time|more time)", re.I)

# A comment beside an import inside a function states its import-time cost (docs/contributing.md;
# tests/project/test_layout.py asks for the reason): "lazy: torch costs 1.3 s at import".
_IMPORT_COST = re.compile(r"\blazy\b|\bimport", re.I)

# Durations that are contracts, not measurements: (file, the text of the match).
_CONTRACT_DURATIONS = {
    ("dschat/runtime/dist.py", "10 minutes"),  # DeepSpeed's default start-up timeout
    ("dschat/runtime/dist.py", "30 s"),  # the grace period's bounds, "between 5 and 30 s"
}


def timing_figures(rel: str, text: str) -> list[tuple[str, str]]:
    """(file:line, figure) for each timing in ``text``'s comments and docstrings, except an import's
    cost in its comment and the durations listed as contracts."""
    out = []
    for line, s in prose_of(text):
        if s.lstrip().startswith("#") and _IMPORT_COST.search(s):
            continue
        out += [(f"{rel}:{line}", m.group(0)) for m in _TIMING.finditer(s)
                if (rel, m.group(0)) not in _CONTRACT_DURATIONS]
    return out


def test_code_holds_no_timings():
    found = [t for f in _code_files()
             for t in timing_figures(str(f.relative_to(REPO)), f.read_text(encoding="utf-8"))]
    assert not found, "timings belong in benchmarks/results.md: " + ", ".join(f"{p!r} at {f}" for f, p in found)


def test_timings_are_caught():
    text = ('"""Decoding took 95.9 s (1.18x per step, 3x faster; 12 % less time), 250 ms a token, 5 minutes in all.\n'
            'Shapes: (B x L), 2 x hidden, 4 h^2, (6h); a 2x2 grid; 16 x 256 x 4 bytes; a 1.5 GiB buffer."""\n'
            '# lazy: torch costs 1.3 s at import (python -X importtime)\n# lazy: matplotlib, 0.5 s\n'
            'x = 1  # a step takes 2.5 s\n')
    assert [p for _, p in timing_figures("x.py", text)] == [
        "95.9 s", "1.18x", "3x faster", "2 % less time", "250 ms", "5 minutes", "2.5 s"]
    assert timing_figures("dschat/runtime/dist.py", '"""default 10 minutes, between 5 and 30 s; 7 s"""') == [
        ("dschat/runtime/dist.py:1", "7 s")]


def test_upstream_anchors_quoted_in_the_code_resolve():
    """Every ``docs/upstream.md#anchor`` in the code names a heading there (missing_paths checks it,
    test_paths_quoted_in_the_code_exist runs it on every file); here on a planted example."""
    assert missing_paths("x.py", "docs/upstream.md#data-cache and docs/upstream.md#no-such-difference") == [
        ("x.py", "docs/upstream.md#no-such-difference")]
