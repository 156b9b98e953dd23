"""Fault injection on every save path: each filesystem operation of a save fails in turn, and
separately the saving process is SIGKILLed at each one; after every fault the folder holds the
complete old state or the complete new one (after the recovery the next start runs), the newest
checkpoint loads, and nothing else the user had is gone.

Save paths: the final model save of steps 1, 2 and DPO (``save_hf_model`` into ``--output_dir``),
step 3's saves (the critic into ``<output_dir>/critic`` beside ``actor/``), ``best/``
(``save_best``), a training checkpoint (a real DeepSpeed engine; rotation and a step saved
again), and the tokenised-data cache (``write_cache``). The operations counted, on paths under the
test's folder: ``open`` for writing, ``os.open`` with a write flag, ``mkdir``, ``rename`` /
``replace``, ``link``, ``unlink``, ``rmdir``, ``chmod``, ``shutil.rmtree`` and every ``fsync``.
A failed operation raises ``OSError(EIO)``; a kill is a real SIGKILL of a forked child just before
the operation. Each path reports how many faults it injected and how many states were lost (0).
"""
from __future__ import annotations

import builtins
import faulthandler
import errno
import io
import json
import os
import random
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from dschat.data.cache import cache_files, load_cache, locked, write_cache
from dschat.errors import UserError
from dschat.data.token_dataset import PromptDataset, TokenRows
from dschat.models.build import create_critic_model
from dschat.models.registry import resolve_model_path
from dschat.models.save import recover_output_dir, save_hf_model
from dschat.models.tokenizer import load_hf_tokenizer
from dschat.paths import BEST_DIR
from dschat.rlhf.heldout.best import save_best
from dschat.runtime import fs
from dschat.runtime.run_lock import LOCK_NAME
from dschat.runtime.dist import init_distributed
from dschat.training import checkpoint as ckpt
from dschat.training import rotation

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.forks]  # forks: tests/conftest.py

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
KILL_WAIT_S = 60


class Injector:
    """Wraps the filesystem functions; at the ``at``-th counted call (1-based) raises OSError(EIO)
    (``kill=False``) or SIGKILLs this process. ``at=0`` only counts."""

    def __init__(self, root: Path, at: int, kill: bool) -> None:
        self.root, self.at, self.kill = str(root), at, kill
        self.calls = 0
        self.fired = False
        self.saved: list[tuple[Any, str, Any]] = []

    def _counted(self, path: Any) -> bool:
        try:
            return os.path.abspath(os.fsdecode(path)).startswith(self.root)
        except TypeError:
            return False

    def _hit(self, what: str) -> None:
        self.calls += 1
        if self.calls == self.at:
            self.fired = True
            if self.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(errno.EIO, f"injected fault at {what}")

    def _wrap(self, owner: Any, name: str, counted: Callable[..., bool]) -> None:
        real = getattr(owner, name)
        self.saved.append((owner, name, real))

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if counted(*args, **kwargs):
                self._hit(name)
            return real(*args, **kwargs)

        setattr(owner, name, wrapper)

    def install(self) -> "Injector":
        on_path = lambda path, *a, **k: self._counted(path)  # noqa: E731
        for name in ("replace", "rename", "link", "unlink", "remove", "rmdir", "mkdir", "chmod"):
            self._wrap(os, name, on_path)
        self._wrap(shutil, "rmtree", on_path)
        self._wrap(os, "fsync", lambda *a, **k: True)
        self._wrap(os, "open", lambda path, flags, *a, **k: bool(flags & WRITE_FLAGS) and self._counted(path))

        def writing(file: Any, mode: str = "r", *a: Any, **k: Any) -> bool:
            return isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+") and self._counted(file)

        self._wrap(builtins, "open", writing)
        self._wrap(io, "open", writing)
        return self

    def remove(self) -> None:
        for owner, name, real in reversed(self.saved):
            setattr(owner, name, real)
        self.saved.clear()


def _content(path: Path) -> bytes:
    """A file's bytes; a safetensors file's tensors and metadata (its header orders the metadata
    keys differently from one write to the next)."""
    if path.suffix != ".safetensors" or path.name.startswith("."):
        return path.read_bytes()
    try:
        with safe_open(str(path), "pt") as f:
            parts = [json.dumps(f.metadata(), sort_keys=True).encode()]
            parts += [name.encode() + f.get_tensor(name).numpy().tobytes() for name in sorted(f.keys())]
    except Exception:  # noqa: BLE001 - a damaged file: compare its bytes, which then differ
        return path.read_bytes()
    return b"|".join(parts)


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones too) by relative path; folders as empty entries."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        out[rel] = _content(path) if path.is_file() else b"<dir>"
    return out


def run_with_fault(save: Callable[[], None], root: Path, at: int, kill: bool) -> bool:
    """Run ``save`` with a fault at operation ``at``; True when the fault fired."""
    if not kill:
        injector = Injector(root, at, kill=False).install()
        try:
            save()
        except OSError as err:
            assert injector.fired, f"the save failed without a fault: {err!r}"
        except Exception as err:  # a disk error surfaced as one line (UserError) is a fine failure too
            assert injector.fired, f"the save failed without a fault: {err!r}"
        finally:
            injector.remove()
        return injector.fired
    python_rng = random.getstate()  # a checkpoint records it; the random module reseeds a forked child
    pid = os.fork()
    if pid == 0:  # the child: saves, and dies at the fault
        code = 0
        try:
            random.setstate(python_rng)
            faulthandler.dump_traceback_later(KILL_WAIT_S // 2, exit=True)  # a hang shows where
            _single_rank_collectives()
            injector = Injector(root, at, kill=True).install()
            save()
        except BaseException:  # noqa: BLE001 - reported through the exit status
            code = 3
        finally:
            os._exit(code)
    deadline = time.monotonic() + KILL_WAIT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the save hung in a forked child (fault at operation {at})")
        time.sleep(0.01)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return True
    assert os.WEXITSTATUS(status) == 0, f"the save failed in the child without a fault (operation {at})"
    return False


def _single_rank_collectives() -> None:
    """In a forked child: the parent's gloo group cannot be used (its threads do not survive a
    fork), and with one rank every collective is the identity, so the child runs them as that."""
    dist = torch.distributed
    if not dist.is_initialized():
        return
    assert dist.get_world_size() == 1
    dist.barrier = lambda *a, **k: None
    dist.all_reduce = lambda tensor, *a, **k: None
    dist.broadcast = lambda tensor, *a, **k: None
    dist.all_gather = lambda out, tensor, *a, **k: out[0].copy_(tensor) and None
    dist.all_gather_into_tensor = lambda out, tensor, *a, **k: out.copy_(tensor.reshape(out.shape)) and None


def count_operations(save: Callable[[], None], root: Path) -> int:
    injector = Injector(root, 0, kill=False).install()
    try:
        save()
    finally:
        injector.remove()
    return injector.calls


def inject_everywhere(name: str, template: Path, work: Path, save: Callable[[Path], None],
                      restart: Callable[[Path], None], states: dict[str, dict[str, bytes]],
                      check: Callable[[Path, str], None] | None = None) -> tuple[int, int]:
    """For each operation k of ``save`` and each fault kind: a fresh copy of ``template`` at
    ``work``, the fault, ``restart`` (what the next start runs), then the folder must equal one
    of ``states`` byte for byte (``check`` then reads it). Returns (faults injected, states lost)."""
    def fresh() -> None:
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(template, work, symlinks=True)

    fresh()
    total = count_operations(lambda: save(work), work)
    assert total > 0
    injected, lost, problems = 0, 0, []
    for kill in (False, True):
        for at in range(1, total + 1):
            fresh()
            fired = run_with_fault(lambda: save(work), work, at, kill)
            assert fired, f"{name}: operation {at} of {total} was not reached"
            injected += 1
            restart(work)
            now = snapshot(work)
            matched = next((state for state, files in states.items() if files == now), None)
            if matched is None:
                lost += 1
                problems.append(f"{'kill' if kill else 'error'} at operation {at}: "
                                f"{sorted(set(now) ^ set(next(iter(states.values()))))[:6]}")
            elif check is not None:
                check(work, matched)
        fresh()
        assert not run_with_fault(lambda: save(work), work, total + 1, kill)  # nothing past the last one
    print(f"[faults] {name}: faults injected {injected}, states lost {lost}")
    assert lost == 0, f"{name}: {lost} states lost: " + "; ".join(problems[:5])
    return injected, lost


# --- the save paths ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any, Any]:
    path = resolve_model_path("tiny-llama")
    tokenizer = load_hf_tokenizer(path)
    torch.manual_seed(0)
    old = AutoModelForCausalLM.from_pretrained(path)
    new = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for param in new.parameters():
            param.add_(0.01)
    return old, new, tokenizer


def _user_files(folder: Path) -> None:
    """What a user keeps in an output folder besides the model."""
    (folder / "training.log").write_text("epoch 0 loss 1.0\n")
    (folder / "notes.txt").write_text("mine")
    step = folder / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (step / ckpt.MARKER).write_text("{}")
    (folder / "runs").mkdir()
    (folder / "runs" / "events.out").write_bytes(b"\x00\x01")


def _states_by_saving(template: Path, save: Callable[[Path], None], scratch: Path) -> dict[str, dict[str, bytes]]:
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(template, scratch, symlinks=True)
    save(scratch)
    return {"old": snapshot(template), "new": snapshot(scratch)}


def test_final_model_save(tiny, tmp_path):
    old, new, tokenizer = tiny
    template = tmp_path / "template"
    save_hf_model(old, tokenizer, template)
    _user_files(template)
    # A stale file of an older format: the new (safetensors) save removes it; the old state has it.
    (template / "pytorch_model.bin").write_bytes(b"stale")

    def save(out: Path) -> None:
        save_hf_model(new, tokenizer, out)

    def restart(out: Path) -> None:
        recover_output_dir(out)

    states = _states_by_saving(template, save, tmp_path / "expected")
    assert "pytorch_model.bin" not in states["new"] and "notes.txt" in states["new"]
    for folder in (template, tmp_path / "expected"):
        AutoModelForCausalLM.from_pretrained(folder)  # both states load
    inject_everywhere("final model save", template, tmp_path / "out", save, restart, states)


def test_step3_critic_save_beside_the_actor(tiny, tmp_path):
    old, new, tokenizer = tiny
    path = resolve_model_path("tiny-llama")
    torch.manual_seed(1)
    critic = create_critic_model(path, tokenizer, None)
    template = tmp_path / "template"
    save_hf_model(old, tokenizer, template / "actor")
    save_hf_model(critic, tokenizer, template / "critic")
    (template / "metrics.jsonl").write_text('{"global_step": 0}\n')
    with torch.no_grad():
        critic.v_head.weight.add_(1.0)

    def save(out: Path) -> None:
        save_hf_model(critic, tokenizer, out / "critic")

    states = _states_by_saving(template, save, tmp_path / "expected")
    assert states["old"]["critic/v_head.safetensors"] != states["new"]["critic/v_head.safetensors"]
    inject_everywhere("step-3 critic save", template, tmp_path / "out", save, recover_output_dir, states)


def test_best_models_save(tiny, tmp_path):
    old, new, tokenizer = tiny
    template = tmp_path / "template"
    template.mkdir()
    save_best(template, {"actor": old}, tokenizer, {"step": 1}, rank=0)
    _user_files(template)

    def save(out: Path) -> None:
        save_best(out, {"actor": new}, tokenizer, {"step": 2}, rank=0)

    def restart(out: Path) -> None:  # what step 3's evaluation runs at start-up
        fs.recover_dir(out / BEST_DIR)

    states = _states_by_saving(template, save, tmp_path / "expected")
    inject_everywhere("best/ save", template, tmp_path / "out", save, restart, states)


@pytest.fixture(scope="module")
def engine(tiny):
    import deepspeed

    from dschat.runtime.ds_config import get_train_ds_config, resolve_dtype

    init_distributed()
    model = AutoModelForCausalLM.from_config(tiny[0].config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = get_train_ds_config(False, resolve_dtype("fp32"), 0, micro_batch_size=1)
    config["train_batch_size"] = 1
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _position(steps: int) -> ckpt.TrainingPosition:
    return ckpt.TrainingPosition(epoch=0, epoch_micro_steps=steps, micro_steps=steps, optimizer_steps=steps)


def _checkpoint_restart(folder: Path) -> None:
    """What prepare_checkpoint_root renames and prunes at the next start (one rank)."""
    root = ckpt.checkpoint_root(folder)
    rotation.restore_replaced(root)
    rotation.retire_incomplete(root)
    rotation.prune_leftovers(root, "restart")


def _loads(engine: Any) -> Callable[[Path, str], None]:
    def check(folder: Path, state: str) -> None:  # --resume: the last written checkpoint loads
        latest = ckpt.latest_checkpoint(ckpt.checkpoint_root(folder))
        assert latest is not None, state
        ckpt.load_checkpoint(latest, {"model": engine}, rank=0)
    return check


@pytest.mark.parametrize("case", ["rotation", "same-step-again"])
def test_training_checkpoint(case, engine, tmp_path):
    template = tmp_path / "template"
    template.mkdir()
    _user_files(template)
    shutil.rmtree(template / "checkpoints")
    root = ckpt.checkpoint_root(template)
    for steps in (1, 2):
        ckpt.save_checkpoint(root, {"model": engine}, _position(steps), keep=2, rank=0)
    steps = 3 if case == "rotation" else 2

    def save(out: Path) -> None:
        ckpt.save_checkpoint(ckpt.checkpoint_root(out), {"model": engine}, _position(steps), keep=2, rank=0,
                             protect=(ckpt.checkpoint_root(out) / ckpt.checkpoint_name(1),) if case != "rotation"
                             else ())

    states = _states_by_saving(template, save, tmp_path / "expected")
    names = sorted({key.split("/")[1] for key in states["new"] if key.startswith("checkpoints/step")})
    assert names == (["step_00000002", "step_00000003"] if case == "rotation" else ["step_00000001", "step_00000002"])
    if case == "rotation":  # the new checkpoint is complete, the old one could not be deleted: kept whole
        rotated_out = {k: v for k, v in states["old"].items() if k.startswith("checkpoints/step_00000001")}
        states["new, step 1 not yet rotated out"] = {**states["new"], **rotated_out}
    inject_everywhere(f"checkpoint ({case})", template, tmp_path / "out", save, _checkpoint_restart, states,
                      check=_loads(engine))


def test_a_full_disk_during_a_checkpoint_is_one_line_and_the_earlier_ones_stay(engine, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from dschat.errors import UserError

    settings = SimpleNamespace(output_dir=str(tmp_path / "out"), save_interval=1, keep_checkpoints=1)
    checkpointer = ckpt.Checkpointer(settings, {"model": engine}, rank=0)
    first = checkpointer.save(_position(1))
    before = {p: p.read_bytes() for p in first.rglob("*") if p.is_file()}

    def full(*_: Any) -> dict:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "rng_state", full)
    with pytest.raises(UserError, match=r"the disk is full .* while writing .*step_00000002; free some space .*the "
                                        r"earlier checkpoints in .* are unchanged, and a save needs room for one more"):
        checkpointer.save(_position(2))
    assert {p: p.read_bytes() for p in first.rglob("*") if p.is_file()} == before
    assert [p.name for p in ckpt.complete_checkpoints(checkpointer.root)] == [first.name]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_a_full_disk_inside_torch_save_keeps_its_errno(tiny, tmp_path, monkeypatch):
    """torch.save to a path raised a RuntimeError from its C++ writer on a full disk (no errno), so
    the disk-full line never came: a 50-line traceback, exit 1. The checkpoint engine and
    --save_format bin write through a Python file, whose OSError says ENOSPC (/dev/full: every write
    fails with it)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from dschat.models import save as save_module

    state = {"w": torch.zeros(4096)}
    with pytest.raises(OSError) as err:
        ckpt.RecordingCheckpointEngine(TorchCheckpointEngine()).save(state, "/dev/full")
    assert err.value.errno == errno.ENOSPC
    model, _, _ = tiny
    monkeypatch.setattr(save_module, "UPSTREAM_WEIGHTS_FILE", "/dev/full")  # folder / "/dev/full" is /dev/full
    with pytest.raises(OSError) as err:
        save_module._write_upstream_bin(model, model.state_dict(), tmp_path)
    assert err.value.errno == errno.ENOSPC


def _dataset(seed: int) -> PromptDataset:
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, 100, (int(n),), generator=gen).tolist() for n in torch.randint(3, 9, (5,), generator=gen)]
    return PromptDataset(None, TokenRows.from_lists(rows, [[1] * len(r) for r in rows]), None, 0, 1, max_seq_len=8)


def test_data_cache(tmp_path):
    key = "0" * 64
    template = tmp_path / "template"
    template.mkdir(mode=0o700)
    files = cache_files(template, key)
    write_cache(files, key, {}, _dataset(1), _dataset(2), [])
    (template / "other-cache.json").write_text("{}")  # another key's file, the user's

    def save(out: Path) -> None:
        write_cache(cache_files(out, key), key, {}, _dataset(3), _dataset(4), [])

    def restart(out: Path) -> None:  # the next process takes the lock before it reads
        with locked(cache_files(out, key).lock):
            pass
        cache_files(out, key).lock.unlink()

    def check(out: Path, state: str) -> None:
        train, held_out = load_cache(cache_files(out, key), key)
        expected = _dataset(1 if state == "old" else 3)
        assert torch.equal(train.tensors()["chosen.ids"], expected.tensors()["chosen.ids"])

    states = _states_by_saving(template, save, tmp_path / "expected")
    inject_everywhere("data cache", template, tmp_path / "out", save, restart, states, check=check)


# --- output folders that cannot be renamed --------------------------------------------------------

class Recorder(Injector):
    """Counts nothing; records every path under ``root`` that an operation names outside ``inside``."""

    def __init__(self, root: Path, inside: Path) -> None:
        super().__init__(root, 0, kill=False)
        self.inside, self.outside = f"{inside}/", []

    def _counted(self, path: Any) -> bool:
        if super()._counted(path):
            full = os.path.abspath(os.fsdecode(path))
            if not f"{full}/".startswith(self.inside):
                self.outside.append(full)
        return False


def test_a_final_save_touches_nothing_outside_the_output_folder(tiny, tmp_path):
    """A mount point (EBUSY, EXDEV), a folder in a parent the user cannot write to, a team folder in
    a sticky parent (EPERM): each refuses only operations on the folder itself or beside it, in its
    parent. A save -- a first one and one over a previous model -- makes none of those."""
    old, new, tokenizer = tiny
    out = tmp_path / "volume"
    out.mkdir()
    (out / "training.log").write_text("log")
    for model in (old, new):
        recorder = Recorder(tmp_path, out).install()
        try:
            save_hf_model(model, tokenizer, out)
            recover_output_dir(out)
        finally:
            recorder.remove()
        assert recorder.outside == []
    assert (out / "training.log").read_text() == "log"
    AutoModelForCausalLM.from_pretrained(out)


def test_a_final_save_into_the_working_directory(tiny, tmp_path, monkeypatch):
    old, _, tokenizer = tiny
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    save_hf_model(old, tokenizer, ".")
    save_hf_model(old, tokenizer, ".")  # and again, over the first
    AutoModelForCausalLM.from_pretrained(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".dschat-")]
    assert sorted(p.name for p in tmp_path.parent.iterdir() if p.name.startswith(f".{tmp_path.name}")) == []


def test_a_final_save_keeps_the_users_files_named_like_weights_and_replaces_an_earlier_models(tiny, tmp_path):
    """Only files of the exact names a Hugging Face save writes are the model's: a backup the user
    made beside it (``model.prev.safetensors``, ``model-v1.safetensors``, ``model.int8.safetensors``,
    ``model.h5``) is kept, byte for byte; an earlier model's weights in another form (upstream's
    ``pytorch_model.bin``, shards and their index) are removed so the folder holds one model."""
    old, new, tokenizer = tiny
    out = tmp_path / "out"
    save_hf_model(old, tokenizer, out)
    mine = {name: f"the user's {name}".encode() for name in
            ("model.prev.safetensors", "model-v1.safetensors", "model.int8.safetensors", "model.h5",
             "pytorch_model.safetensors", "model.safetensors.bak")}
    earlier = ("pytorch_model.bin", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
               "model.safetensors.index.json")
    for name, data in mine.items():
        (out / name).write_bytes(data)
    for name in earlier:
        (out / name).write_bytes(b"an earlier model's weights")
    save_hf_model(new, tokenizer, out)
    assert {name: (out / name).read_bytes() for name in mine} == mine
    assert [name for name in earlier if (out / name).exists()] == []
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), new.state_dict().values()))


def test_a_first_save_keeps_the_users_files_named_like_configs_and_tokenizer_files(tiny, tmp_path):
    """A folder that holds no model (no ``config.json``, no weights): the user's ``vocab.json``,
    ``config.txt``, ``tokenizer.txt`` ... are theirs, kept byte for byte unless the save writes that
    very name; names no Hugging Face save writes (``config.txt``) are kept beside a model too."""
    old, new, tokenizer = tiny
    out = tmp_path / "out"
    out.mkdir()
    mine = {name: f"the user's {name}".encode() for name in
            ("config.txt", "tokenizer.txt", "generation_config.txt", "special_tokens_map.txt", "added_tokens.txt",
             "merges.json", "notes.txt")}
    for name, data in {**mine, "vocab.json": b"the user's vocab.json"}.items():
        (out / name).write_bytes(data)
    tokenizer.save_pretrained(tmp_path / "probe")
    assert not (tmp_path / "probe" / "vocab.json").exists()  # this tokenizer writes none: the file stays the user's
    save_hf_model(old, tokenizer, out)
    assert {name: (out / name).read_bytes() for name in mine} == mine
    assert (out / "vocab.json").read_bytes() == b"the user's vocab.json"
    save_hf_model(new, tokenizer, out)  # beside a model now: still theirs
    assert {name: (out / name).read_bytes() for name in mine} == mine


def test_a_folder_holding_only_an_adapter_holds_a_model():
    """A folder of only ``lora_adapter/`` (an adapter save): a new save without LoRA removes it, so the
    folder holds one model, not a stale adapter beside it."""
    import tempfile

    from dschat.models.save import earlier_model_files, is_model_artifact

    with tempfile.TemporaryDirectory() as folder:
        assert earlier_model_files(folder)("vocab.json") is False
        os.mkdir(os.path.join(folder, "lora_adapter"))
        assert earlier_model_files(folder) is is_model_artifact


def test_rolling_back_with_resume_from_then_resume(engine, tmp_path):
    """The issue's roll-back: step_50, 100 and 200 exist; --resume_from step_50 and --keep_checkpoints
    2, then a save at step 60 keeps step_60 and the source; a later --resume continues from step_60
    and rotation then goes by write order (the --resume source is not kept for ever)."""
    from types import SimpleNamespace

    out = tmp_path / "out"
    root = ckpt.checkpoint_root(out)
    for steps in (50, 100, 200):
        ckpt.save_checkpoint(root, {"model": engine}, _position(steps), keep=3, rank=0)

    def checkpointer(**flags: Any) -> ckpt.Checkpointer:
        args = SimpleNamespace(**{"output_dir": str(out), "save_interval": 10, "keep_checkpoints": 2, "resume": False,
                                  "resume_from": None, **flags})
        return ckpt.Checkpointer(args, {"model": engine}, rank=0)

    rolled_back = checkpointer(resume_from=str(root / ckpt.checkpoint_name(50)))
    assert rolled_back.resume().optimizer_steps == 50
    rolled_back.maybe_save(_position(60))
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_00000050", "step_00000200", "step_00000060"]
    resumed = checkpointer(resume=True)
    assert resumed.resume().optimizer_steps == 60  # the last written, not the abandoned step 200
    resumed.maybe_save(_position(70))
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_00000060", "step_00000070"]


def _save_killed_at_rename(folder: Path, owns: Callable[[str], bool], new: dict[str, bytes], rename: int) -> None:
    """A save of ``new`` (name -> bytes) into ``folder`` with ``owns``, killed (SIGKILL) at its
    ``rename``-th rename, in a child process."""
    from dschat.runtime.inplace import save_in_place

    child = os.fork()
    if child == 0:
        calls = [0]
        real = os.replace

        def replace(src, dst):
            calls[0] += 1
            if calls[0] == rename:
                os.kill(os.getpid(), signal.SIGKILL)
            real(src, dst)

        os.replace = replace
        with save_in_place(folder, owns) as stage:
            for name, data in new.items():
                (stage / name).write_bytes(data)
        os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def _model_save_killed_between_renames(folder: Path) -> Path:
    """An old model in ``folder``, then a save of a new one killed (SIGKILL) at its second rename:
    the new config.json is in place beside the old weights."""
    from dschat.models.save import is_model_artifact

    folder.mkdir()
    (folder / "config.json").write_text('{"old": 1}')
    (folder / "model.safetensors").write_bytes(b"old weights")
    _save_killed_at_rename(folder, is_model_artifact, {"config.json": b'{"new": 1}', "model.safetensors": b"new weights"}, 2)
    return folder


def test_a_killed_weights_only_save_is_finished_by_its_journal_not_by_the_recovering_callers_owns(tmp_path):
    """Upstream's save_zero_three_model replaces the weights only; the recovery at the next start
    (recover_output_dir) claims every model file. The journal says what the save removes: the
    tokenizer files stay."""
    from dschat.models.save import is_weights_file

    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "config.json").write_text('{"kept": 1}')
    (folder / "tokenizer.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"old weights")
    (folder / "model-00002-of-00002.safetensors").write_bytes(b"old shard")  # the new save has no such shard
    # Killed at the third rename: the old shard and the old weights moved aside, the new ones not yet in.
    _save_killed_at_rename(folder, is_weights_file, {"model.safetensors": b"new weights"}, 3)
    assert recover_output_dir(folder) == [f"finished an interrupted save into {folder}"]
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (folder / "model.safetensors").read_bytes() == b"new weights"
    assert (folder / "config.json").read_text() == '{"kept": 1}'


def test_a_save_undone_then_killed_while_its_staging_folder_goes_leaves_the_old_model(tmp_path):
    """A Ctrl-C in the swap is undone (the old model back), then the staging folder is deleted: a kill
    during that delete could leave the journal beside a part of the staged files, and the next start
    "finished" the save from them (the old weights removed, the new ones gone). The journal now goes
    first: the next start removes the rest of the staging folder and the old model stands."""
    from dschat.models.save import is_model_artifact
    from dschat.runtime.inplace import JOURNAL, STAGING_PREFIX, save_in_place

    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "config.json").write_text('{"old": 1}')
    (folder / "pytorch_model.bin").write_bytes(b"old weights")  # a bin save, now a safetensors one
    child = os.fork()
    if child == 0:
        real_replace, real_unlink, interrupted = os.replace, os.unlink, []

        def replace(src, dst):
            if STAGING_PREFIX in os.path.realpath(os.path.dirname(os.fspath(src))) and not interrupted:  # staged
                interrupted.append(src)
                raise KeyboardInterrupt
            real_replace(src, dst)

        def unlink(name, *args, **kwargs):
            real_unlink(name, *args, **kwargs)
            if interrupted and not os.fspath(name).endswith(JOURNAL):
                os.kill(os.getpid(), signal.SIGKILL)  # right after the first staged file went

        os.replace, os.unlink = replace, unlink
        try:
            with save_in_place(folder, is_model_artifact) as stage:
                (stage / "config.json").write_text('{"new": 1}')
                (stage / "model.safetensors").write_bytes(b"new weights")
        finally:
            os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert [p for p in folder.iterdir() if p.name.startswith(STAGING_PREFIX)]  # killed midway through
    recover_output_dir(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "pytorch_model.bin"]
    assert (folder / "pytorch_model.bin").read_bytes() == b"old weights"
    assert (folder / "config.json").read_text() == '{"old": 1}'


def test_an_interrupted_save_whose_staged_entries_are_gone_is_not_finished(tmp_path):
    """A journal naming entries that neither the staging folder nor the output folder holds (a
    staging folder deleted in part) is one line: finishing it would remove the old model for nothing."""
    from dschat.runtime.inplace import JOURNAL, STAGING_PREFIX

    folder = tmp_path / "out"
    stage = folder / f"{STAGING_PREFIX}0123abcd"
    stage.mkdir(parents=True, mode=0o700)
    (folder / "pytorch_model.bin").write_bytes(b"old weights")
    (stage / JOURNAL).write_text(json.dumps({"entries": ["model.safetensors"], "removes": ["pytorch_model.bin"]}))
    with pytest.raises(UserError, match=rf"the interrupted save {stage} lacks model.safetensors, which {folder} does "
                                        r"not hold either, so it cannot be finished; move .* out of the folder"):
        recover_output_dir(folder)
    assert (folder / "pytorch_model.bin").read_bytes() == b"old weights"


def test_a_killed_save_is_finished_in_a_folder_under_a_parent_others_can_write_to(tmp_path):
    """A team folder others can write to (not sticky) above --output_dir: the user's own leftovers
    inside the output folder are still finished (the folders above are no reason to strand a save)."""
    team = tmp_path / "team"
    team.mkdir()
    os.chmod(team, 0o777)
    old = os.umask(0o002)  # the usual umask on a team machine: group-writable folders
    try:
        folder = _model_save_killed_between_renames(team / "sft")
    finally:
        os.umask(old)
    notices = recover_output_dir(folder)
    assert notices == [f"finished an interrupted save into {folder}"], notices
    assert (folder / "config.json").read_text() == '{"new": 1}'
    assert (folder / "model.safetensors").read_bytes() == b"new weights"
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]


def test_a_reader_refuses_a_model_folder_a_stopped_save_left_half_replaced_and_the_recover_command_finishes_it(tmp_path):
    """A save killed between its renames leaves the new config.json beside the old weights: loading
    the folder is one line naming the leftover and the command; ``--recover`` finishes the save."""
    import subprocess
    import sys

    from helpers import REPO

    from dschat.errors import UserError
    from dschat.models.registry import check_local_model_path

    folder = _model_save_killed_between_renames(tmp_path / "sft")
    with pytest.raises(UserError, match=r"holds an unfinished model save \(\.dschat-") as err:
        check_local_model_path(str(folder))
    assert f"python -m dschat.models.save --recover {folder}" in str(err.value) and "\n" not in str(err.value)
    proc = subprocess.run([sys.executable, "-m", "dschat.models.save", "--recover", str(folder)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0 and "finished an interrupted save" in proc.stdout, proc.stderr[-2000:]
    check_local_model_path(str(folder))
    assert (folder / "config.json").read_text() == '{"new": 1}'
    assert (folder / "model.safetensors").read_bytes() == b"new weights"
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    proc = subprocess.run([sys.executable, "-m", "dschat.models.save", "--recover", str(tmp_path / "none")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and proc.stderr.startswith("error: --recover") and proc.stderr.count("\n") == 1


@pytest.mark.parametrize("variable", ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK"])
def test_under_an_mpi_launch_only_rank_0_recovers_an_interrupted_save_at_start_up(variable, tmp_path, monkeypatch):
    """An MPI launcher sets no RANK before start-up: every process calling the recovery at once could
    move the finished files aside twice and delete them. Only the launcher's rank 0 recovers."""
    folder = _model_save_killed_between_renames(tmp_path / "out")
    args = type("Args", (), {"output_dir": str(folder), "resume_from": None, "resume": False, "save_interval": 0,
                             "keep_checkpoints": 2, "max_nonfinite_steps": 0})()
    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable.replace("RANK", "SIZE"), "2")  # an MPI launch of two processes
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)  # before start-up (an earlier test's group)
    left = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
    assert any(name.startswith(".dschat-staging-") for name in left)
    monkeypatch.setenv(variable, "1")
    ckpt.check_checkpoint_args(args)
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == left  # not touched
    monkeypatch.setenv(variable, "0")
    ckpt.check_checkpoint_args(args)
    # rank 0 holds the folder's run lock while ``args`` lives (dschat.runtime.run_lock)
    assert sorted(p.name for p in folder.iterdir() if p.name != LOCK_NAME) == ["config.json", "model.safetensors"]
    assert (folder / "model.safetensors").read_bytes() == b"new weights"
