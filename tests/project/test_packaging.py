"""dschat installs as a real package (wheel and editable), CI runs the README's test command, and the
dependency ranges exclude versions with known holes."""
import ast
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from helpers import REPO


def _readme_command(marker: str) -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    match = re.search(rf"<!-- {marker} -->\s*```bash\n(.+?)\n```", text, re.S)
    assert match, f"README.md has no ```bash block after <!-- {marker} -->"
    lines = [ln for ln in match.group(1).splitlines() if ln.strip()]
    assert len(lines) == 1, f"the {marker} must be exactly one command, got {lines}"
    return lines[0].strip()


def test_readme_opens_with_the_two_commands():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    first_blocks = re.findall(r"```bash\n(.+?)\n```", text, re.S)[:2]
    assert [b.strip() for b in first_blocks] == [_readme_command("main-job-command"), _readme_command("test-command")]
    assert "e2e_rlhf.py" in _readme_command("main-job-command")
    assert "pytest" in _readme_command("test-command")


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert _readme_command("test-command") in ci.splitlines()
    # CI must treat "no tests collected" (pytest exit code 5) as a failure.
    assert '"$rc" -eq 5' in ci and "DS_ACCELERATOR=cpu" in ci and "HF_HUB_OFFLINE=1" in ci


def _install_requires() -> dict[str, Requirement]:
    """setup.py's ``install_requires``, read without running setup.py."""
    for node in ast.walk(ast.parse((REPO / "setup.py").read_text(encoding="utf-8"))):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return {req.name: req for req in map(Requirement, ast.literal_eval(node.value))}
    raise AssertionError("setup.py has no install_requires")


@pytest.mark.parametrize("name,vulnerable,fixed", [
    # weights_only=True, dschat's only guard against pickled .bin/.pt checkpoints, can be bypassed
    # before torch 2.6 (CVE-2025-32434).
    ("torch", "2.5.1", "2.6.0"),
    # A lock path symlinked to another file truncated that file and made it 0644 (CVE-2025-68146).
    ("filelock", "3.20.0", "3.20.1"),
])
def test_dependency_floors_exclude_known_holes(name, vulnerable, fixed):
    spec = _install_requires()[name].specifier
    assert not spec.contains(vulnerable) and spec.contains(fixed), f"{name}{spec}"


def test_the_pinned_versions_ci_tests_are_inside_the_supported_ranges():
    required = _install_requires()
    pins = [line.split("==") for line in (REPO / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    checked = [name for name, version in pins if name in required]
    assert {"torch", "filelock"} <= set(checked)
    for name, version in pins:
        if name in required:
            assert required[name].specifier.contains(version), f"constraints.txt {name}=={version} vs setup.py {required[name]}"


def _pip(*args: str, cwd: Path = REPO) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args], cwd=cwd, check=True)


FULL_PROBE = (
    "import dschat, dschat.data.builtin as b, dschat.rl_math, dschat.utils.data.data_utils;"
    "print(dschat.__file__); print(len(b.read_rows('eval')))"
)
# Without torch in the environment: the package itself and its data.
LIGHT_PROBE = "import dschat, dschat.data.builtin as b; print(dschat.__file__); print(len(b.read_rows('eval')))"


def _import_probe(env_path: dict, python: str = sys.executable, code: str = FULL_PROBE) -> tuple[str, int]:
    out = subprocess.run(
        [python, "-c", code], cwd="/", env={**os.environ, **env_path}, check=True, capture_output=True, text=True
    ).stdout.split()
    return out[0], int(out[1])


@pytest.mark.slow
def test_wheel_is_not_empty_and_imports(tmp_path):
    # Upstream's namespace package built an empty wheel; ours must carry code and data.
    _pip("wheel", "--no-deps", ".", "-w", str(tmp_path / "dist"))
    wheel = next((tmp_path / "dist").glob("dschat-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "dschat/__init__.py",
        "dschat/rl_math/ppo.py",  # a subpackage of dschat
        "dschat/utils/data/data_utils.py",
        "dschat/data/builtin_prefs/train.jsonl",
        "dschat/data/builtin_prefs/eval.jsonl",
        "dschat/data/builtin_prefs/samples/train.jsonl",
        "dschat/data/builtin_prefs/samples/eval.jsonl",
    ):
        assert required in names, required
    target = tmp_path / "site"
    _pip("install", "--no-deps", "--target", str(target), str(wheel))
    location, rows = _import_probe({"PYTHONPATH": str(target)})
    assert Path(location).is_relative_to(target) and rows >= 300


@pytest.mark.slow
def test_editable_install_imports_from_the_checkout(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    subprocess.run(
        [python, "-m", "pip", "--disable-pip-version-check", "-q", "install", "--no-deps", "-e", str(REPO)],
        check=True,
    )
    location, rows = _import_probe({"PYTHONPATH": ""}, python=python, code=LIGHT_PROBE)
    assert Path(location).is_relative_to(REPO) and rows >= 300


# Declared dependencies dschat does not import itself: the library module that imports each, for a
# feature dschat uses (optional dependencies of those libraries, so dschat declares them).
IMPORTED_BY_A_LIBRARY = {
    "accelerate": "transformers/integrations/deepspeed.py",  # HfDeepSpeedConfig: ZeRO-3 model builds
    "gguf": "transformers/modeling_gguf_pytorch_utils.py",  # the embedded SmolLM2's GGUF
    "tensorboard": "torch/utils/tensorboard/__init__.py",  # --enable_tensorboard
}


def _install_requires_commented() -> list[tuple[str, str]]:
    """``(distribution, comment)`` for every install_requires entry of setup.py."""
    text = (REPO / "setup.py").read_text(encoding="utf-8")
    block = text[text.index("install_requires=["):text.index("],", text.index("install_requires=["))]
    return re.findall(r'^\s*"([A-Za-z0-9_.-]+)[^"]*",[ \t]*(?:#[ \t]*(.*))?$', block, re.M)


def _imported_in(folder: Path, module: str) -> bool:
    pattern = re.compile(rf"^\s*(import|from)\s+{re.escape(module)}\b", re.M)
    return any(pattern.search(path.read_text(encoding="utf-8")) for path in folder.rglob("*.py"))


def test_every_declared_dependency_is_imported_and_says_by_what():
    import importlib.util

    requires = _install_requires_commented()
    assert len(requires) >= 10 and "tqdm" not in dict(requires)
    site = Path(importlib.util.find_spec("transformers").origin).parents[1]
    for dist, comment in requires:
        module = dist.replace("-", "_")
        assert comment, f"setup.py: say beside {dist} what imports it"
        if module in IMPORTED_BY_A_LIBRARY:
            library_file = site / IMPORTED_BY_A_LIBRARY[module]
            assert re.search(rf"^\s*(import|from)\s+{module}\b", library_file.read_text(encoding="utf-8"), re.M), dist
            assert not comment.startswith("dschat"), (dist, comment)
        else:
            assert comment.startswith("dschat") and _imported_in(REPO / "dschat", module), (dist, comment)
