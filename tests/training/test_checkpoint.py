"""Checkpoints and exact resume for steps 1, 2 and DPO (--save_interval, --resume, --resume_from,
--keep_checkpoints): a run interrupted after a checkpoint and resumed reproduces the uninterrupted
run's losses and final weights bit for bit (CPU, ZeRO 0 and 2); incomplete checkpoints are ignored."""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from dschat.errors import EXIT_USAGE, UserError, cli_main
from dschat.training import checkpoint as ckpt

from helpers import PYTHON
from helpers.step3 import load_state, max_abs_diff
from helpers.steps import STEP_DIRS, base_argv, load_script, run_cli

pytestmark = pytest.mark.slow


class Interrupted(Exception):
    """Stands in for a crash right after a given optimizer step."""


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt_data")


def test_random_states_round_trip_through_json():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = json.loads(json.dumps(ckpt.rng_state()))
    first = (random.random(), np.random.rand(), torch.rand(3))
    ckpt.set_rng_state(state)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert first[0] == again[0] and first[1] == again[1] and torch.equal(first[2], again[2])


def test_latest_checkpoint_skips_incomplete_ones_with_a_notice(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    for steps in (2, 4):
        folder = root / ckpt.checkpoint_name(steps)
        folder.mkdir(parents=True)
        (folder / ckpt.MARKER).write_text("{}")
    (root / ckpt.checkpoint_name(6)).mkdir()  # no marker: killed before it was complete
    (root / f"{ckpt.TMP_PREFIX}{ckpt.checkpoint_name(8)}").mkdir()  # killed while writing
    assert ckpt.latest_checkpoint(root) == root / ckpt.checkpoint_name(4)
    out = capsys.readouterr().out
    assert out.count("ignoring incomplete checkpoint") == 2 and "step_00000006" in out


def test_start_up_leaves_a_step_folder_dschat_did_not_write(tmp_path, capsys):
    from argparse import Namespace

    from dschat.errors import UserError

    root = ckpt.checkpoint_root(tmp_path)
    own, older, other = (root / ckpt.checkpoint_name(n) for n in (6, 5, 3))
    # Unfinished saves of dschat (the tag; before the tag: consolidated/ and the RNG files), another tool's.
    for folder, name in ((own, ckpt.WRITING_TAG), (older, "consolidated/state.json"), (older, "rng_rank0.json"),
                         (other, "weights.bin")):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("x")
    args = Namespace(output_dir=str(tmp_path), save_interval=1, resume=True, resume_from=None)
    with pytest.raises(UserError, match=r"sees a step_<N> \(or .tmp-step_<N>\) entry in .* that dschat did not write"):
        ckpt.prepare_checkpoint_root(args, rank=0)
    out = capsys.readouterr().out
    assert [line.split()[1] for line in out.splitlines() if "not a checkpoint dschat wrote" in line] == [str(other)]
    assert sum("was never completed" in line for line in out.splitlines()) == 2
    assert (other / "weights.bin").read_text() == "x"
    assert not own.exists() and not older.exists()  # dschat's own unfinished saves go
    # A save never replaces it either: one line, and the folder stays.
    with pytest.raises(UserError, match=f"would replace {other}, which dschat did not write"):
        ckpt.save_checkpoint(root, {}, ckpt.TrainingPosition(0, 3, 3, 3), keep=2, rank=0)
    assert (other / "weights.bin").read_text() == "x" and ckpt.complete_checkpoints(root) == []
    (other / "weights.bin").unlink()
    other.rmdir()
    ckpt.prepare_checkpoint_root(args, rank=0)  # the user moved it out: start-up goes on and prunes
    assert list(root.iterdir()) == []


def test_what_a_save_would_meet_is_refused_at_start_up_and_never_deleted(tmp_path, capsys):
    """A file where checkpoints/ goes, a file named step_<N>, and a .tmp-step_<N> of the user's (where
    the save of step N begins, which deleted it) are refused at start-up in one line, not at the first
    save after training; a save that meets the user's .tmp-step_<N> refuses and leaves it as it is."""
    from argparse import Namespace

    from dschat.errors import UserError

    root = ckpt.checkpoint_root(tmp_path)
    args = Namespace(output_dir=str(tmp_path), save_interval=2, resume=False, resume_from=None)
    root.write_text("my notes")
    with pytest.raises(UserError, match=f"sees {root}, which is not a folder: the checkpoints go there; move it out "
                                        f"of {tmp_path}, or pass another --output_dir$"):
        ckpt.prepare_checkpoint_root(args, rank=0)
    ckpt.prepare_checkpoint_root(Namespace(output_dir=str(tmp_path), save_interval=0, resume=False, resume_from=None),
                                 rank=0)  # no checkpoints wanted: the file is not in the way
    assert root.read_text() == "my notes"
    root.unlink()
    root.mkdir()
    mine = root / f"{ckpt.TMP_PREFIX}{ckpt.checkpoint_name(2)}"
    (mine / "mine.txt").parent.mkdir()
    (mine / "mine.txt").write_text("precious")
    (root / ckpt.checkpoint_name(4)).write_text("notes")
    (root / f"{ckpt.TMP_PREFIX}step_2").mkdir()  # another name: no save begins there, and it is not empty
    (root / f"{ckpt.TMP_PREFIX}step_2" / "x").write_text("x")
    with pytest.raises(UserError, match=r"entry in .* that dschat did not write \(named above\)"):
        ckpt.prepare_checkpoint_root(args, rank=0)
    named = [line.split()[1] for line in capsys.readouterr().out.splitlines() if "not a checkpoint dschat wrote" in line]
    assert named == [str(mine), str(root / ckpt.checkpoint_name(4))]
    with pytest.raises(UserError, match=f"would replace {mine}, which dschat did not write; move it out of {root}"):
        ckpt.save_checkpoint(root, {}, ckpt.TrainingPosition(0, 2, 2, 2), keep=2, rank=0)
    assert (mine / "mine.txt").read_text() == "precious" and ckpt.complete_checkpoints(root) == []
    assert (root / ckpt.checkpoint_name(4)).read_text() == "notes"


def test_a_kill_while_a_save_deletes_a_stopped_save_of_its_step_leaves_dschats_own_leftover(tmp_path, monkeypatch):
    """A save of step N first deletes the .tmp-step_<N> a stopped save left. Deleted in place, a kill
    midway could leave it without its tag and not empty: the next start refused it as the user's.
    It is renamed to a .tmp-pruned-* name first, which start-up prunes."""
    from argparse import Namespace

    root = ckpt.checkpoint_root(tmp_path)
    stopped = root / f"{ckpt.TMP_PREFIX}{ckpt.checkpoint_name(2)}"
    (stopped / "consolidated").mkdir(parents=True)
    (stopped / ckpt.WRITING_TAG).write_text("x")
    (stopped / "consolidated" / "state.json").write_text("{}")

    def killed(path, *args, **kwargs):
        (Path(path) / ckpt.WRITING_TAG).unlink()  # rmtree's first removals, then the kill
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(root, {}, ckpt.TrainingPosition(0, 2, 2, 2), keep=2, rank=0)
    monkeypatch.undo()
    args = Namespace(output_dir=str(tmp_path), save_interval=2, resume=True, resume_from=None)
    ckpt.prepare_checkpoint_root(args, rank=0)  # not refused as a folder of the user's: pruned
    assert list(root.iterdir()) == []


def _interrupt_after(monkeypatch, optimizer_steps: int) -> None:
    original = ckpt.Checkpointer.maybe_save

    def maybe_save(self, position):
        saved = original(self, position)
        if position.optimizer_steps == optimizer_steps:
            raise Interrupted
        return saved

    monkeypatch.setattr(ckpt.Checkpointer, "maybe_save", maybe_save)


CASES = {
    "step1-z0": ("step1", "tiny-llama", ["--zero_stage", "0", "--dropout", "0.1"]),
    "step1-z2": ("step1", "tiny-opt", ["--zero_stage", "2", "--dropout", "0.1"]),
    "step2-z0": ("step2", "tiny-llama", ["--zero_stage", "0", "--num_padding_at_beginning", "0", "--eval_iters", "1",
                                         "--eval_interval", "3"]),
    "dpo-z2": ("dpo", "tiny-opt", ["--zero_stage", "2"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_interrupted_and_resumed_run_matches_the_uninterrupted_one(case, data_dir, tmp_path, monkeypatch):
    step, model, extra = CASES[case]
    main = load_script(step).main

    def argv(out, *more):
        # batch 2 and 6 steps, gradient accumulation 2: checkpoints every 2 optimizer steps.
        return base_argv(model, data_dir, *extra, "--gradient_accumulation_steps", "2", "--save_interval", "2",
                         "--keep_checkpoints", "2", "--output_dir", str(out), *more, batch_size=2)

    full = main(argv(tmp_path / "full"))
    assert full.optimizer_steps == 6 and len(full.train_losses) == 12

    _interrupt_after(monkeypatch, 4)  # crash right after optimizer step 4 (its checkpoint is written)
    with pytest.raises(Interrupted):
        main(argv(tmp_path / "resumed"))
    monkeypatch.undo()
    root = tmp_path / "resumed" / "checkpoints"
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_00000002", "step_00000004"]
    # A half-written newer checkpoint (a kill during a save) is ignored on resume.
    (root / f"{ckpt.TMP_PREFIX}{ckpt.checkpoint_name(6)}").mkdir()

    resumed = main(argv(tmp_path / "resumed", "--resume"))
    # Micro-steps 9..12 of the uninterrupted run, to the bit.
    assert resumed.train_losses == full.train_losses[8:]
    assert resumed.optimizer_steps == 6
    assert max_abs_diff(load_state(tmp_path / "full"), load_state(tmp_path / "resumed")) == 0.0
    # --keep_checkpoints 2: only the newest two remain.
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_00000004", "step_00000006"]


def test_resume_from_a_named_checkpoint(data_dir, tmp_path):
    main = load_script("step1").main
    argv = base_argv("tiny-llama", data_dir, "--save_interval", "3", "--output_dir", str(tmp_path / "a"), batch_size=2)
    full = main(argv)
    first = tmp_path / "a" / "checkpoints" / "step_00000003"
    again = main(base_argv("tiny-llama", data_dir, "--output_dir", str(tmp_path / "b"), "--resume_from", str(first),
                           batch_size=2))
    assert again.train_losses == full.train_losses[3:]


def test_resume_without_checkpoints_starts_from_scratch(data_dir, tmp_path, capsys):
    main = load_script("step1").main
    result = main(base_argv("tiny-llama", data_dir, "--resume", "--output_dir", str(tmp_path / "o"),
                            max_train_steps=1, batch_size=2))
    assert result.optimizer_steps == 1 and "no complete checkpoint" in capsys.readouterr().out


@pytest.mark.parametrize("flags,message", [
    (["--save_interval", "2"], "need --output_dir"),
    (["--save_interval", "-1", "--output_dir", "OUT"], "--save_interval must be >= 0"),
    (["--keep_checkpoints", "0", "--output_dir", "OUT"], "--keep_checkpoints must be >= 1"),
    (["--resume", "--resume_from", "X", "--output_dir", "OUT"], "either --resume"),
])
def test_contradictory_checkpoint_flags_are_refused(flags, message, tmp_path):
    step1 = load_script("step1")
    flags = [str(tmp_path / "o") if f == "OUT" else f for f in flags]
    with pytest.raises(UserError, match=re.escape(message)):
        step1.parse_args(["--model_name_or_path", "tiny-llama", *flags])


def test_resuming_with_other_trainable_parameters_is_one_line_exit_2(data_dir, tmp_path):
    """A checkpoint of a step-2 run with --freeze_layers 1, resumed without it: the optimizer state
    would not fit (torch raised a ValueError traceback, exit 1); one line names the flags instead. With
    the same flags it resumes."""
    out = tmp_path / "o"
    argv = base_argv("tiny-llama", tmp_path / "d", "--num_padding_at_beginning", "0", "--save_interval", "1",
                     "--output_dir", str(out), max_train_steps=1, batch_size=2)
    load_script("step2").main([*argv, "--freeze_layers", "1"])
    record = json.loads((out / "checkpoints" / "step_00000001" / ckpt.MARKER).read_text())
    assert not any(entry.startswith("rwtransformer.layers.0.") for entry in record["trainable"]["model"])
    assert "rwtransformer.layers.1.mlp.up_proj.weight [" in " ".join(record["trainable"]["model"])
    resumed = argv[:argv.index("--max_train_steps") + 1] + ["2"] + argv[argv.index("--max_train_steps") + 2:]
    proc = run_cli([PYTHON, str(STEP_DIRS["step2"] / "main.py"), *resumed, "--resume"], cwd=tmp_path)
    assert proc.returncode == EXIT_USAGE, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "trained 11 parameter tensors, this run trains 21 (first difference: " in errors[0], errors
    assert "--freeze_layers" in errors[0] and "Traceback" not in proc.stderr
    again = load_script("step2").main([*resumed, "--resume", "--freeze_layers", "1"])
    assert again.optimizer_steps == 2 and len(again.train_losses) == 1


def test_a_checkpoint_another_step_wrote_is_refused_on_resume(data_dir, tmp_path, capsys):
    """DPO --resume in step 1's --output_dir: both name their engine ``model`` and train the same
    parameters from the same base, so DPO took SFT's weights, optimizer state and position as its own
    and saved the result as its model. The checkpoint records its step; another step is one line."""
    out = tmp_path / "o"
    argv = base_argv("tiny-llama", data_dir, "--save_interval", "1", "--output_dir", str(out), max_train_steps=1,
                     batch_size=2)
    load_script("step1").main(argv)
    first = out / "checkpoints" / "step_00000001"
    assert json.loads((first / ckpt.MARKER).read_text())["meta"]["step"] == "step1"
    argv[argv.index("--max_train_steps") + 1] = "2"
    for flag in (["--resume"], ["--resume_from", str(first)]):
        code = cli_main(load_script("dpo").main, [*argv, *flag])
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert code == EXIT_USAGE and errors == [
            f"error: {first} was written by step 1 (fine-tuning), and this is DPO: it would go on with another "
            "step's weights, optimizer state and position; pass another --output_dir (or --resume_from a "
            "checkpoint of this step)"], errors
    assert load_script("step1").main([*argv, "--resume"]).optimizer_steps == 2  # its own step resumes


def test_resuming_with_another_optimizer_offload_is_one_line(data_dir, tmp_path, capsys):
    """--offload added on a same-shape resume: AdamW's state went into DeepSpeedCPUAdam, which raised
    KeyError 'bias_correction' after the 'resumed' line (a traceback, exit 1). Dropped: the reverse."""
    out = tmp_path / "o"
    argv = base_argv("tiny-llama", data_dir, "--zero_stage", "2", "--save_interval", "1", "--output_dir", str(out),
                     max_train_steps=1, batch_size=2)
    load_script("step1").main(argv)
    first = out / "checkpoints" / "step_00000001"
    assert json.loads((first / ckpt.MARKER).read_text())["meta"]["offload"] == {"model": False}
    argv[argv.index("--max_train_steps") + 1] = "2"
    code = cli_main(load_script("step1").main, [*argv, "--resume", "--offload"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == EXIT_USAGE and errors == [
        f"error: {first} was written without optimizer offload (--offload) for 'model', and this run offloads "
        "it: the optimizer state would not load; resume with the --offload setting that wrote it"], errors
    record = json.loads((first / ckpt.MARKER).read_text())
    record["meta"]["offload"] = {"model": True}  # as a run with --offload writes it, resumed without
    (first / ckpt.MARKER).write_text(json.dumps(record))
    with pytest.raises(UserError, match=r"written with optimizer offload \(--offload\) for 'model', and this run "
                                        r"does not offload it"):
        load_script("step1").main([*argv, "--resume"])
    record["meta"]["offload"] = {"model": "yes"}  # edited: one line naming the file
    (first / ckpt.MARKER).write_text(json.dumps(record))
    with pytest.raises(UserError, match=r"meta.offload is not an object of true/false"):
        load_script("step1").main([*argv, "--resume"])


def test_resuming_with_another_lora_rank_is_one_line_exit_2(data_dir, tmp_path):
    """Same parameter names, other shapes (--lora_dim 4 written, 8 asked): refused by the shapes."""
    out = tmp_path / "o"
    argv = base_argv("tiny-llama", tmp_path / "d", "--lora_dim", "4", "--lora_module_name", "layers.",
                     "--save_interval", "1", "--output_dir", str(out), max_train_steps=1, batch_size=2)
    load_script("step1").main(argv)
    argv[argv.index("--lora_dim") + 1] = "8"
    argv[argv.index("--max_train_steps") + 1] = "2"
    proc = run_cli([PYTHON, str(STEP_DIRS["step1"] / "main.py"), *argv, "--resume"], cwd=tmp_path)
    assert proc.returncode == EXIT_USAGE, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "lora_right_weight [" in errors[0] and "Traceback" not in proc.stderr, errors


def test_resume_from_a_folder_that_is_no_checkpoint_exits_2(tmp_path):
    proc = run_cli([PYTHON, str(STEP_DIRS["step1"] / "main.py"), "--model_name_or_path", "tiny-llama",
                    "--data_path", "dschat/builtin", "--dtype", "fp32", "--output_dir", str(tmp_path / "o"),
                    "--data_output_path", str(tmp_path / "d"), "--resume_from", str(tmp_path)], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "not a complete dschat checkpoint" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("case", ["step1-z0", "step2-z0", "dpo-z2"])
def test_resuming_from_the_last_checkpoint_trains_no_further(case, data_dir, tmp_path):
    # A run killed after its last checkpoint (e.g. during the final model save) has only the save
    # left; it used to train one more micro-step past --max_train_steps.
    step, model, extra = CASES[case]
    main = load_script(step).main
    argv = base_argv(model, data_dir, *extra, "--save_interval", "2", "--output_dir", str(tmp_path / "o"),
                     max_train_steps=2, batch_size=2)
    assert len(main(argv).train_losses) == 2
    again = main([*argv, "--resume"])
    assert again.train_losses == [] and again.optimizer_steps == 2


@pytest.fixture(scope="module")
def saved_checkpoint(data_dir, tmp_path_factory):
    """A real step-1 checkpoint (ZeRO 2, one optimizer step) to tamper with."""
    out = tmp_path_factory.mktemp("tamper") / "a"
    load_script("step1").main(base_argv("tiny-llama", data_dir, "--zero_stage", "2", "--save_interval", "1",
                                        "--output_dir", str(out), max_train_steps=1, batch_size=2))
    return out / "checkpoints" / "step_00000001"


@pytest.mark.parametrize("target,payload", [
    # The model states: a function from a module torch blocks by name, which torch 2.13 words as
    # "unsupported GLOBAL os.makedirs whose module os is blocked" (it used to be a traceback, exit 1).
    ("mp_rank_00_model_states.pt", "blocked-module"),
    # The optimizer states: a function torch refuses as "Unsupported global".
    ("*optim_states.pt", "not-allowed-global"),
])
def test_a_checkpoint_that_would_run_code_is_one_line_exit_2(target, payload, saved_checkpoint, data_dir, tmp_path,
                                                               capsys):
    """DeepSpeed would unpickle anything; dschat loads checkpoints with weights_only=True, and a
    tampered file is one error line naming it, whatever torch's wording."""
    folder = tmp_path / "step_00000001"
    shutil.copytree(saved_checkpoint, folder)
    victim = next((folder / "model").glob(target))
    marker = tmp_path / "code-ran"
    state = torch.load(victim, weights_only=False)  # the attacker's side: the file is ours
    state["payload"] = _MakesFolder(str(marker)) if payload == "blocked-module" else _RunsCode(str(marker))
    torch.save(state, victim)
    main = load_script("step1").main
    capsys.readouterr()
    code = cli_main(main, base_argv("tiny-llama", data_dir, "--zero_stage", "2", "--output_dir", str(tmp_path / "b"),
                                    "--resume_from", str(folder), max_train_steps=2, batch_size=2))
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"{victim} holds objects dschat does not unpickle" in errors[0], err[-3000:]
    assert "resume only from checkpoints dschat wrote" in errors[0]
    assert not marker.exists()


class _MakesFolder:
    """Unpickling this creates a folder: ``os.makedirs``, in a module torch blocks by name."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.makedirs, (self.path,))


class _RunsCode:
    """Unpickling this writes a file: what a tampered checkpoint could do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (_touch, (self.path,))


def _touch(path: str) -> None:
    open(path, "w").close()


def test_resuming_on_other_rows_of_the_same_count_is_one_line(tmp_path, capsys):
    """A checkpoint in the middle of an epoch, resumed with the two --data_path datasets swapped: as
    many rows, in another order, so the batches the checkpoint skips as trained would be other rows
    (never trained that epoch). Refused in one line; the same order resumes."""
    from helpers.data import pref_rows, write_jsonl

    mine = write_jsonl(tmp_path / "mine.jsonl", pref_rows(40))
    out = tmp_path / "out"

    def argv(*data: str, steps: int) -> list[str]:
        return base_argv("tiny-llama", tmp_path / "data", "--output_dir", str(out), "--save_interval", "2",
                         "--data_path", *data, max_train_steps=steps, batch_size=2, max_seq_len=32)

    main = load_script("step1").main
    main(argv("dschat/builtin", str(mine), steps=3))
    capsys.readouterr()
    code = cli_main(main, argv(str(mine), "dschat/builtin", steps=4) + ["--resume"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == EXIT_USAGE and "Traceback" not in err
    assert lines == ["error: the training data has as many rows as when the checkpoint was written but not the same "
                     "ones (another --data_path order, an edited data file, another tokenizer or length): the rows the "
                     "checkpoint skips as trained would not be; resume with the data it was written with, or start "
                     "afresh without --resume"]
    assert main(argv("dschat/builtin", str(mine), steps=4) + ["--resume"]).optimizer_steps == 4


def test_the_rows_digest_is_checked_only_where_rows_would_be_skipped():
    """Other rows at an epoch's end skip nothing (the next epoch starts afresh): accepted. The digest
    is of the rows, not the padded width: the same prompts under a longer --max_prompt_seq_len match."""
    from dschat.data.token_dataset import PromptDataset, TokenRows
    from dschat.training.consolidated import convert_batches_done

    order = {"world_size": 1, "batch_size": 2, "dataset_size": 8, "drop_last": False, "sampler_drop_last": False,
             "shuffle": True, "seed": 1, "rows_sha256": "a"}
    other = {**order, "rows_sha256": "b"}
    assert convert_batches_done(4, [order], [other]) == 4  # the epoch (4 batches) is over
    with pytest.raises(UserError, match="not the same ones"):
        convert_batches_done(2, [order], [other])
    assert convert_batches_done(2, [{k: v for k, v in order.items() if k != "rows_sha256"}], [other]) == 2  # older
    rows = TokenRows.from_lists([[1, 2, 3], [4, 5]], [[1, 1, 1], [1, 1]])
    short, wide = (PromptDataset(rows, None, None, 0, 3, max_seq_len=n) for n in (8, 16))
    assert short.digest() == wide.digest()
    assert PromptDataset(TokenRows.from_lists([[1, 2, 3], [4, 6]], [[1, 1, 1], [1, 1]]), None, None, 0, 3,
                         max_seq_len=8).digest() != short.digest()
