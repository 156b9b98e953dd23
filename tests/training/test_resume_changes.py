"""Resuming with flags that differ from the run that wrote the checkpoint: another
--gradient_accumulation_steps keeps the optimizer steps done (no step counted twice, no checkpoint
rewritten, none written mid-accumulation), another --dtype loads the consolidated state, a
--resume_from of another --output_dir does not mix with that folder's own checkpoints, and the
checkpoint a run resumed from is never replaced."""
from __future__ import annotations

import json
import math
import re
import shutil
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dschat.errors import UserError
from dschat.training import checkpoint as ckpt
from dschat.training import consolidated, rotation

from helpers.steps import base_argv, load_script

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("resume_changes_data")


def _markers(root: Path) -> dict[str, bytes]:
    return {p.name: (p / ckpt.MARKER).read_bytes() for p in ckpt.complete_checkpoints(root)}


def test_another_gradient_accumulation_keeps_the_optimizer_steps_done(data_dir, tmp_path, capsys):
    """3 optimizer steps of 2 micro-batches, resumed with 4 per step up to 4 steps: one more step of
    4 micro-batches (it used to count 6 micro-steps as 1 optimizer step, rewrite step_2 and step_3,
    save mid-accumulation and run 5 optimizer steps)."""
    main = load_script("step1").main
    out = tmp_path / "o"

    def argv(accumulation: int, steps: int, *more: str) -> list[str]:
        return base_argv("tiny-llama", data_dir, "--gradient_accumulation_steps", str(accumulation), "--save_interval",
                         "1", "--keep_checkpoints", "5", "--output_dir", str(out), *more, max_train_steps=steps,
                         batch_size=2)

    first = main(argv(2, 3))
    assert first.optimizer_steps == 3 and len(first.train_losses) == 6
    root = ckpt.checkpoint_root(out)
    before = _markers(root)
    capsys.readouterr()
    again = main(argv(4, 4, "--resume"))
    printed = capsys.readouterr().out
    assert again.optimizer_steps == 4 and again.engine.global_steps == 4 and len(again.train_losses) == 4
    assert "--gradient_accumulation_steps is 4 here and was 2 when the checkpoint was written" in printed
    after = _markers(root)
    assert list(after) == [ckpt.checkpoint_name(n) for n in (1, 2, 3, 4)]
    assert {name: after[name] for name in before} == before  # none rewritten, the resumed-from one included
    assert sorted(p.name for p in root.iterdir()) == list(after)  # nothing set aside or left over
    position = ckpt.read_position(root / ckpt.checkpoint_name(4))
    assert (position.epoch, position.epoch_micro_steps, position.micro_steps) == (0, 6 + 4, 4 * 4)
    state = json.loads((root / ckpt.checkpoint_name(4) / consolidated.FOLDER / consolidated.STATE).read_text())
    assert state["engines"]["model"]["counters"]["global_steps"] == 4


def test_a_resume_on_another_plan_lays_the_lr_schedule_over_the_steps_this_run_takes(data_dir, tmp_path, capsys):
    """A cosine schedule saved at its step 8 of 8 (--max_train_steps 8) and resumed without the cap
    and with twice the accumulation: the checkpoint's schedule is laid over the 8 steps done plus the
    epoch's rest at the new accumulation; a --learning_rate given here applies from the step resumed
    at (the way out of a divergence), with one line. (This run's schedule, planned from step 0 over the epoch at
    the new accumulation, ran past its end and rose again.) A fresh run's plan rounds up the same way,
    so the schedule ends at (or a step before) its 0."""
    main = load_script("step1").main

    def argv(accumulation: int, steps: int, *more: str) -> list[str]:
        return base_argv("tiny-llama", data_dir, "--gradient_accumulation_steps", str(accumulation), "--max_seq_len",
                         "32", "--lr_scheduler_type", "cosine", "--learning_rate", "1e-3", *more,
                         max_train_steps=steps, batch_size=8)

    main(argv(1, 8, "--save_interval", "8", "--output_dir", str(tmp_path / "a")))
    capsys.readouterr()
    again = main(argv(2, 0, "--resume_from", str(ckpt.checkpoint_root(tmp_path / "a") / ckpt.checkpoint_name(8)),
                      "--output_dir", str(tmp_path / "b"), "--learning_rate", "5e-4"))
    printed = capsys.readouterr().out
    assert ("[checkpoint] this run's learning rates and LR schedule (lr 0.0005, cosine, 0 warmup steps) apply from "
            "the step it resumes at; the checkpoint's were lr 0.001, cosine, 0 warmup steps") in printed
    taken = again.optimizer_steps
    found = re.search(r"\[checkpoint\] the LR schedule was laid over 8 optimizer steps .* and this run plans (\d+): "
                      r"it is laid over (\d+) now \(8 done, (\d+) to go\)", printed)
    assert found, printed
    planned, total, left = map(int, found.groups())
    # Upstream's plan rounds each epoch's steps up: a last odd micro-batch is planned, not taken.
    assert total == 8 + left and taken in (total, total - 1) and planned < taken
    scheduler = again.engine.lr_scheduler
    assert scheduler.last_epoch == taken
    assert scheduler.get_last_lr()[0] == pytest.approx(5e-4 * 0.5 * (1 + math.cos(math.pi * taken / total)))


def test_a_weight_decay_given_on_resume_applies_from_there_with_one_line(data_dir, tmp_path, capsys):
    """The optimizer's load restored the checkpoint's weight decay over the flag's, silently, on the
    same shape (another shape took the flag's): like a learning rate, the flag applies from the step
    resumed at, with one line."""
    main = load_script("step1").main
    argv = base_argv("tiny-llama", data_dir, "--weight_decay", "0", "--save_interval", "1", "--output_dir",
                     str(tmp_path / "a"), max_train_steps=1, batch_size=8)
    main(argv)
    capsys.readouterr()
    argv[argv.index("--max_train_steps") + 1] = "2"
    again = main([*argv, "--resume", "--weight_decay", "0.5"])
    assert ("[checkpoint] this run's weight decay (0.5, 0) applies from the step it resumes at; the checkpoint's "
            "was 0") in capsys.readouterr().out
    assert [g["weight_decay"] for g in again.engine.optimizer.param_groups] == [0.5, 0.0]  # decayed, no-decay


def test_another_dtype_loads_the_consolidated_state(data_dir, tmp_path, capsys):
    """An fp32 checkpoint resumed with --dtype bf16 (ZeRO-2): DeepSpeed's own files name the dtype
    (a KeyError or a missing bf16_* file before); the consolidated state loads the fp32 masters, both
    moments, steps, schedule and counters exactly as saved."""
    from helpers.reshape_worker import dump, trained_engines

    main = load_script("step1").main

    def argv(out: Path, dtype: str, *more: str) -> list[str]:
        flags = base_argv("tiny-llama", data_dir, "--zero_stage", "2", "--save_interval", "2", "--output_dir",
                          str(out), *more, max_train_steps=2, batch_size=2)
        flags[flags.index("--dtype") + 1] = dtype
        return flags

    main(argv(tmp_path / "a", "fp32"))
    folder = ckpt.checkpoint_root(tmp_path / "a") / ckpt.checkpoint_name(2)
    capsys.readouterr()
    dump(trained_engines("step1", argv(tmp_path / "b", "bf16", "--resume_from", str(folder))), tmp_path / "dump")
    printed = capsys.readouterr().out
    assert ("resumed on another shape: saved on 1 rank(s) (model ZeRO 2 fp32), resumed on 1 rank(s) "
            "(model ZeRO 2 bf16)") in printed
    saved, dumped = folder / consolidated.FOLDER, tmp_path / "dump"
    for kind in consolidated.KINDS:
        before, after = (load_file(str(where / f"model.{kind}.safetensors")) for where in (saved, dumped))
        assert sorted(before) == sorted(after) and before
        assert all(torch.equal(before[name], after[name]) for name in before), kind
    old = json.loads((saved / consolidated.STATE).read_text())["engines"]["model"]
    new = json.loads((dumped / "records.json").read_text())["model"]
    assert (old["dtype"], new["dtype"]) == ("fp32", "bf16") and min(old["steps"].values()) == 2
    assert all(old[key] == new[key] for key in ("parameters", "param_groups", "steps", "scheduler", "counters"))
    # And it trains on in bf16 from there.
    more = argv(tmp_path / "c", "bf16", "--resume_from", str(folder))
    more[more.index("--max_train_steps") + 1] = "3"
    resumed = main(more)
    assert resumed.optimizer_steps == 3 and len(resumed.train_losses) == 1


def test_a_dtype_change_on_an_uncovered_engine_names_the_dtype_to_resume_with(tmp_path):
    """A checkpoint whose engine the consolidated state does not cover, resumed in another dtype:
    one line naming the world size, stage and --dtype that load it."""
    from types import SimpleNamespace

    folder = tmp_path / "step_2"
    (folder / consolidated.FOLDER).mkdir(parents=True)
    record = {"format": consolidated.FORMAT_VERSION, "world_size": 1, "data": [],
              "engines": {"model": {"unsupported": "the optimizer is SGD, not Adam(W)", "zero_stage": 0,
                                    "dtype": "bf16"}}}
    (folder / consolidated.FOLDER / consolidated.STATE).write_text(json.dumps(record))
    engine = SimpleNamespace(zero_optimization_stage=lambda: 0, fp16_enabled=lambda: False,
                             bfloat16_enabled=lambda: False)
    with pytest.raises(UserError, match=r"cannot resume 'model' on another shape: the optimizer is SGD, not "
                                        r"Adam\(W\); resume with 1 rank\(s\), ZeRO stage 0 and --dtype bf16$"):
        consolidated.reshape_of(folder, {"model": engine})
    engine.bfloat16_enabled = lambda: True  # the same dtype: DeepSpeed's own files load
    assert consolidated.reshape_of(folder, {"model": engine}) is None


def _complete(root: Path, steps: int) -> Path:
    folder = root / ckpt.checkpoint_name(steps)
    folder.mkdir(parents=True)
    (folder / ckpt.MARKER).write_text(json.dumps({"sequence": steps}))
    return folder


def test_resume_from_another_output_dir_refuses_an_earlier_runs_checkpoints(tmp_path):
    """--resume_from A/checkpoints/step_N --output_dir B, with checkpoints in B: they would mix with
    this run's and rotation would delete them; one line. From B's own checkpoints it goes on."""
    source = _complete(ckpt.checkpoint_root(tmp_path / "a"), 3)
    theirs = _complete(ckpt.checkpoint_root(tmp_path / "b"), 5)
    args = Namespace(output_dir=str(tmp_path / "b"), save_interval=1, resume=False, resume_from=str(source))
    with pytest.raises(UserError) as err:
        ckpt.prepare_checkpoint_root(args, rank=0)
    assert str(err.value).endswith(
        f" found checkpoints of an earlier run in {theirs.parent}, and --resume_from {source} is not one of them; pass "
        f"another --output_dir, --resume_from one of those, or delete {theirs.parent} on every node to start over")
    assert (theirs / ckpt.MARKER).is_file()
    ckpt.prepare_checkpoint_root(Namespace(output_dir=str(tmp_path / "c"), save_interval=1, resume=False,
                                           resume_from=str(source)), rank=0)  # an empty --output_dir
    args.resume_from = str(tmp_path / "b" / "checkpoints" / ".." / "checkpoints" / theirs.name)
    ckpt.prepare_checkpoint_root(args, rank=0)  # rolling back within B
    assert ckpt.complete_checkpoints(theirs.parent) == [theirs]


def test_the_checkpoint_a_run_resumed_from_is_never_replaced(tmp_path):
    """A save of the step the run resumed from stops with one line before anything is written, and
    rotation's set_aside refuses it too; the checkpoint stays byte for byte."""
    root = tmp_path / "checkpoints"
    source = _complete(root, 3)
    marker = (source / ckpt.MARKER).read_bytes()
    for kind in ("protect", "resumed_from"):
        how = {"resumed_from": source} if kind == "resumed_from" else {"protect": (source,)}
        with pytest.raises(UserError, match=f"would replace {source}, the checkpoint this run resumed from"):
            ckpt.save_checkpoint(root, {}, ckpt.TrainingPosition(0, 3, 3, 3), keep=2, rank=0, **how)
        assert (source / ckpt.MARKER).read_bytes() == marker and sorted(root.iterdir()) == [source]
    with pytest.raises(UserError, match="the checkpoint this run resumed from"):
        rotation.set_aside(source, [None, source])
    assert sorted(root.iterdir()) == [source]
    aside = rotation.set_aside(source, [root / ckpt.checkpoint_name(2)])  # another step: set aside as before
    assert aside is not None and aside.name.startswith(f"{source.name}{rotation.REPLACED_TAG}")


def _model_copy(src: Path, dest: Path, nudge: float = 0.0) -> Path:
    """``src``'s folder copied to ``dest``; with ``nudge``, every weight moved by it (another training)."""
    shutil.copytree(src, dest)
    if nudge:
        weights = dest / "model.safetensors"
        save_file({k: v + nudge for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
    return dest


def test_weights_fingerprint_follows_the_weights_not_the_folder(tmp_path):
    """Copies give one digest, other weights another; a file over 16 MiB is sampled (a change within a
    sampled piece shows); an adapter's digest covers its base down the chain."""
    from dschat.models.registry import resolve_model_path, weights_fingerprint

    src = Path(resolve_model_path("tiny-llama"))
    same, other = _model_copy(src, tmp_path / "same"), _model_copy(src, tmp_path / "other", nudge=0.01)
    assert weights_fingerprint(str(same)) == weights_fingerprint("tiny-llama") != weights_fingerprint(str(other))
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text("{}")
    (big / "model.safetensors").write_bytes(bytes(20 * 2**20))
    first = weights_fingerprint(str(big))
    with open(big / "model.safetensors", "r+b") as handle:
        handle.seek(20 * 2**20 - 1)  # the last byte: inside the last sampled piece
        handle.write(b"\x01")
    assert weights_fingerprint(str(big)) != first
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"lora")
    digests = []
    for base in (same, src, other):
        (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base)}))
        digests.append(weights_fingerprint(str(adapter), 1))  # as a chain's link: the stand-in is not checked
    assert digests[0] == digests[1] != digests[2]
    import dschat.models.registry as registry

    def unreadable(*args, **kwargs):
        raise PermissionError("denied")

    with pytest.MonkeyPatch.context() as patch:  # a weight file this account cannot read: nothing to compare
        patch.setattr(registry, "open", unreadable, raising=False)
        assert weights_fingerprint(str(same)) is None and weights_fingerprint(str(adapter), 1) is None


def test_a_hub_id_is_fingerprinted_by_its_cached_snapshot_and_other_files_are_not_read(tmp_path, monkeypatch):
    """A hub id resolves to its snapshot in the local cache (a run from the id and a resume from a
    folder of the same weights agree); a folder's files that are not weights (training_args.bin) do not
    count."""
    import huggingface_hub.constants

    from dschat.models.registry import resolve_model_path, weights_fingerprint

    src = Path(resolve_model_path("tiny-llama"))
    repo = tmp_path / "hub" / "models--dschat-test--tiny"
    _model_copy(src, repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert weights_fingerprint("dschat-test/tiny") == weights_fingerprint(str(src)) is not None
    extra = _model_copy(src, tmp_path / "extra")
    (extra / "training_args.bin").write_bytes(b"not weights")
    assert weights_fingerprint(str(extra)) == weights_fingerprint(str(src))


def test_a_resume_from_other_starting_weights_is_refused_a_copy_is_not(data_dir, tmp_path):
    """A checkpoint records the weights its run started from: the frozen models (a reference model, a
    LoRA adapter's base) come from the model flag, not from the checkpoint. The same weights in another
    folder resume; other weights under the flag are one line (they resumed silently before)."""
    from dschat.models.registry import resolve_model_path

    main = load_script("step1").main
    src = Path(resolve_model_path("tiny-llama"))
    start = _model_copy(src, tmp_path / "start")
    out = tmp_path / "o"

    def argv(model: Path, *more: str) -> list[str]:
        return base_argv(str(model), data_dir, "--save_interval", "1", "--output_dir", str(out), *more,
                         max_train_steps=1, batch_size=2)

    main(argv(start))
    record = json.loads((ckpt.checkpoint_root(out) / ckpt.checkpoint_name(1) / ckpt.MARKER).read_text())
    assert record["meta"]["models"]["model"]["path"] == str(start)
    other = _model_copy(src, tmp_path / "retrained", nudge=0.01)
    with pytest.raises(UserError) as err:
        main(argv(other, "--resume"))
    assert str(err.value) == (
        f"{ckpt.checkpoint_root(out) / ckpt.checkpoint_name(1)} is of a run whose model started from other weights "
        f"({start}) than --model_name_or_path {other}; the reference and reward models and a LoRA adapter's base "
        "come from that flag, not from the checkpoint: resume with that run's model, or start afresh in another "
        "--output_dir")
    moved = _model_copy(src, tmp_path / "moved")
    assert main(argv(moved, "--resume")).optimizer_steps == 1


def test_a_resume_past_this_runs_end_is_refused_and_keeps_the_final_model(data_dir, tmp_path, capsys):
    """A run of 4 steps resumed with --max_train_steps 2 (a roll-back meant): it would train nothing and
    save the 4-step model as the 2-step one; refused in one line, the final model left as it was. At
    the end exactly (4 again: a run killed in its final save) only the final save is left."""
    main = load_script("step1").main
    out = tmp_path / "o"

    def argv(steps: int, *more: str) -> list[str]:
        return base_argv("tiny-llama", data_dir, "--save_interval", "2", "--output_dir", str(out), *more,
                         max_train_steps=steps, batch_size=2)

    main(argv(4))
    final = (out / "model.safetensors").read_bytes()
    with pytest.raises(UserError, match=r"^the checkpoint resumed from has 4 optimizer steps done, past "
                                        r"--max_train_steps 2: .*--resume_from an earlier"):
        main(argv(2, "--resume"))
    assert (out / "model.safetensors").read_bytes() == final
    assert main(argv(4, "--resume")).train_losses == []


@pytest.mark.parametrize("epoch, batches, epochs, refused", [
    (2, 0, 2, False),  # a 2-epoch run's end: only the final save left
    (1, 10, 2, False),
    (2, 0, 1, True),  # 2 epochs done, resumed with --num_train_epochs 1
    (1, 5, 1, True),
    (0, 5, 1, False),
])
def test_epochs_past_the_end(epoch, batches, epochs, refused):
    from types import SimpleNamespace

    from dschat.training.checkpoint import refuse_past_the_end

    checkpointer = SimpleNamespace(first_epoch=lambda: epoch, batches_done=lambda e: batches if e == epoch else 0)
    if refused:
        with pytest.raises(UserError, match=rf"epochs done, past --num_train_epochs {epochs}"):
            refuse_past_the_end(checkpointer, 10, epochs, (99, 0, "steps"))
    else:
        refuse_past_the_end(checkpointer, 10, epochs, (99, 0, "steps"))
