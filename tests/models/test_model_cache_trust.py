"""The tiny-model and embedded-model caches on a shared machine (docs/shared-machine.md): a cache
folder, model folder, model file or lock that another account owns or could write to is refused in
one line before anything reads or locks it; a fresh cache is created private and reused."""
from __future__ import annotations

import fcntl
import json
import os
import stat
import threading
from pathlib import Path
from typing import Callable

import pytest

from dschat.errors import UserError
from dschat.models import embedded, tiny
from dschat.models.registry import resolve_model_path

OTHER_UID = 65534  # nobody
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another uid (chown) needs root")
SMALL_CORPUS = [f"the quick brown fox {i} jumps over the lazy dog {i % 7}" for i in range(60)]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty ``$DSCHAT_CACHE_DIR`` (not yet created); nothing here may be built."""
    monkeypatch.setenv("DSCHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tiny, "_build", lambda *a, **kw: pytest.fail("a tiny model was built"))
    monkeypatch.setattr(embedded, "_build", lambda *a, **kw: pytest.fail("the embedded model was built"))
    monkeypatch.setattr(embedded, "locate_smollm2_gguf", lambda *a, **kw: pytest.fail("the GGUF was looked for"))
    return tmp_path / "cache"


def _plant_tiny(cache: Path, name: str = "tiny-opt") -> Path:
    """A folder that the old code took for a complete tiny model (the marker it expects, the files it looks for)."""
    folder = cache / "tiny" / name
    folder.mkdir(parents=True)
    marker = tiny._marker(name, tiny._corpus_digest(tiny.corpus_texts()))
    (folder / tiny.MARKER_FILE).write_text(json.dumps(marker))
    for file in ("config.json", "model.safetensors", "tokenizer.json"):
        (folder / file).write_text('{"dropout": 0.37}')
    return folder


def _plant_embedded(cache: Path) -> Path:
    """A folder whose provenance names the pinned GGUF digest (a claim, never checked on read)."""
    folder = cache / "models" / embedded.SHORT_NAME
    folder.mkdir(parents=True)
    for file in embedded.REQUIRED_FILES:
        (folder / file).write_text("{}")
    record = {"format_version": embedded.FORMAT_VERSION, "gguf_sha256": embedded.GGUF_SHA256}
    (folder / embedded.PROVENANCE_FILE).write_text(json.dumps(record))
    return folder


PLANTERS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "tiny-opt": (_plant_tiny, "tiny-model folder"),
    embedded.SHORT_NAME: (_plant_embedded, "embedded-model folder"),
}


def _chown_tree(top: Path, uid: int) -> None:
    for parent, dirs, files in os.walk(top):
        for entry in (parent, *(os.path.join(parent, n) for n in (*dirs, *files))):
            os.chown(entry, uid, uid)


def _refused(name: str, *words: str) -> str:
    with pytest.raises(UserError) as caught:
        resolve_model_path(name)
    line = str(caught.value)
    assert "\n" not in line and "not safe" in line and "DSCHAT_CACHE_DIR" in line, line
    for word in words:
        assert word in line, line
    return line


@needs_root
@pytest.mark.parametrize("name", sorted(PLANTERS))
@pytest.mark.parametrize("variable", ["DSCHAT_CACHE_DIR", "XDG_CACHE_HOME"])
def test_another_accounts_cache_is_refused(cache: Path, monkeypatch: pytest.MonkeyPatch, name: str,
                                           variable: str) -> None:
    """The reviewer's case: another account's copy of the cache (planted model folder and all)."""
    if variable == "XDG_CACHE_HOME":
        monkeypatch.delenv("DSCHAT_CACHE_DIR")
        monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
        cache = cache / "dschat"
    PLANTERS[name][0](cache)
    _chown_tree(cache, OTHER_UID)
    _refused(name, str(cache), f"uid {OTHER_UID}")


@needs_root
@pytest.mark.parametrize("name", sorted(PLANTERS))
def test_another_accounts_model_folder_is_refused(cache: Path, name: str) -> None:
    """The cache is the user's own, the model folder in it another account's."""
    planter, what = PLANTERS[name]
    folder = planter(cache)
    _chown_tree(folder, OTHER_UID)
    _refused(name, what, str(folder), f"uid {OTHER_UID}")


@pytest.mark.parametrize("name", sorted(PLANTERS))
@pytest.mark.parametrize("where", ["subfolder", "folder", "file"])
def test_a_cache_others_can_write_to_is_refused(cache: Path, monkeypatch: pytest.MonkeyPatch, name: str,
                                                where: str) -> None:
    """World-writable: the cache's tiny/ or models/ folder, the model folder, or one file in it."""
    folder = PLANTERS[name][0](cache)
    target = {"subfolder": folder.parent, "folder": folder, "file": folder / "config.json"}[where]
    target.chmod(stat.S_IMODE(target.stat().st_mode) | stat.S_IWOTH)
    read: list[Path] = []
    monkeypatch.setattr(tiny, "_is_complete", lambda f, m: read.append(f) or True)
    monkeypatch.setattr(embedded, "read_provenance", lambda f: read.append(f) or {})
    _refused(name, str(target), "other users can write")
    assert not read, "the untrusted folder was read"


def _resolve_in_thread(name: str) -> tuple[threading.Thread, list[BaseException]]:
    raised: list[BaseException] = []

    def call() -> None:
        try:
            resolve_model_path(name)
        except BaseException as err:  # noqa: BLE001 - handed to the test
            raised.append(err)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout=30)
    return thread, raised


@pytest.mark.parametrize("name", sorted(PLANTERS))
@pytest.mark.parametrize("owner", ["other", "me"])
def test_a_planted_held_lock_is_refused_not_waited_on(cache: Path, name: str, owner: str) -> None:
    """A lock file 0666 (another account's, or the user's own that others can write to) held with
    flock: refused in one line at once; the old code waited on it silently, for ever."""
    if owner == "other" and os.geteuid() != 0:
        pytest.skip("giving a file to another uid (chown) needs root")
    sub = "tiny" if name.startswith("tiny") else "models"
    (cache / sub).mkdir(parents=True, mode=0o700)
    lock = cache / sub / f".{name}.lock"
    lock.touch()
    lock.chmod(0o666)
    if owner == "other":
        os.chown(lock, OTHER_UID, OTHER_UID)
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        thread, raised = _resolve_in_thread(name)
        assert not thread.is_alive(), f"resolve_model_path({name!r}) waits on a planted lock"
    finally:
        os.close(fd)
    assert len(raised) == 1 and isinstance(raised[0], UserError), raised
    line = str(raised[0])
    assert "\n" not in line and str(lock) in line and "lock" in line and "DSCHAT_CACHE_DIR" in line, line


@pytest.mark.parametrize("name", sorted(PLANTERS))
def test_a_symlinked_lock_is_refused(cache: Path, tmp_path: Path, name: str) -> None:
    sub = "tiny" if name.startswith("tiny") else "models"
    (cache / sub).mkdir(parents=True, mode=0o700)
    target = tmp_path / "victim"
    target.write_text("keep me")
    (cache / sub / f".{name}.lock").symlink_to(target)
    with pytest.raises(UserError, match="symbolic link"):
        resolve_model_path(name)
    assert target.read_text() == "keep me"


@needs_root
def test_a_cache_folder_of_another_account_is_not_created_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``$DSCHAT_CACHE_DIR`` exists, empty, another account's: refused, nothing made inside it."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o755)
    os.chown(cache, OTHER_UID, OTHER_UID)
    monkeypatch.setenv("DSCHAT_CACHE_DIR", str(cache))
    monkeypatch.setattr(tiny, "_build", lambda *a, **kw: pytest.fail("a tiny model was built"))
    _refused("tiny-llama", str(cache), f"uid {OTHER_UID}")
    assert not list(cache.iterdir())


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path, follow_symlinks=False).st_mode)


def test_a_fresh_tiny_cache_is_private_and_then_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("DSCHAT_CACHE_DIR", str(cache))
    folder = tiny.build_tiny_model("tiny-opt", texts=SMALL_CORPUS)
    assert folder == cache / "tiny" / "tiny-opt" and (folder / "model.safetensors").is_file()
    assert _mode(cache) == _mode(cache / "tiny") == 0o700
    assert _mode(cache / "tiny" / ".tiny-opt.lock") == 0o600
    monkeypatch.setattr(tiny, "_build", lambda *a, **kw: pytest.fail("rebuilt"))
    assert tiny.build_tiny_model("tiny-opt", texts=SMALL_CORPUS) == folder


def test_a_build_under_a_group_writable_umask_leaves_nothing_the_group_can_write(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """umask 002 (a shared group: HPC, containers) gave 0664 files, which the next use refused as
    writable by the group: the build's own cache took the group's write bits off."""
    monkeypatch.setenv("DSCHAT_CACHE_DIR", str(tmp_path / "cache"))
    old = os.umask(0o002)
    try:
        folder = tiny.build_tiny_model("tiny-opt", texts=SMALL_CORPUS)
    finally:
        os.umask(old)
    writable = [str(p) for p in (folder, *folder.rglob("*")) if os.stat(p).st_mode & 0o022]
    assert writable == []


def test_a_fresh_embedded_cache_is_private_and_then_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("DSCHAT_CACHE_DIR", str(cache))
    source = embedded.GgufSource(tmp_path / embedded.GGUF_NAME, embedded.WHEEL_VERSION, "test")
    monkeypatch.setattr(embedded, "locate_smollm2_gguf", lambda *a, **kw: source)
    monkeypatch.setattr(embedded, "verify_gguf", lambda s: embedded.GGUF_SHA256)
    builds: list[Path] = []

    def fake_build(src: embedded.GgufSource, digest: str, folder: Path) -> None:
        builds.append(folder)
        for file in embedded.REQUIRED_FILES:
            (folder / file).write_text("{}")
        record = {"format_version": embedded.FORMAT_VERSION, "gguf_sha256": digest}
        (folder / embedded.PROVENANCE_FILE).write_text(json.dumps(record))

    monkeypatch.setattr(embedded, "_build", fake_build)
    folder = Path(resolve_model_path(embedded.SHORT_NAME))
    assert folder == cache / "models" / embedded.SHORT_NAME and len(builds) == 1
    assert _mode(cache) == _mode(cache / "models") == 0o700
    assert _mode(cache / "models" / f".{embedded.SHORT_NAME}.lock") == 0o600
    assert Path(resolve_model_path(embedded.SHORT_NAME)) == folder and len(builds) == 1


def test_a_foreign_wheels_folder_is_refused(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GGUF read out of a cached wheel is hashed, then read again: its folder must be the user's own."""
    monkeypatch.setattr(embedded, "_from_installed_package", lambda: None)
    monkeypatch.delenv(embedded.ENV_GGUF, raising=False)
    wheels = cache / "wheels"
    wheels.mkdir(parents=True)
    wheels.chmod(0o757)
    with pytest.raises(UserError, match="other users can write"):
        embedded._from_cached_wheel()
