"""The non-finite guard (--max_nonfinite_steps) in real step-1 runs: a NaN loss or NaN gradients
skip the step (counted, logged, weights stay finite), and too many in a row stop the run with one
line naming the last good checkpoint."""
from __future__ import annotations

import math

import pytest
import torch

from dschat.training.nonfinite import TrainingDiverged

from helpers.steps import base_argv, load_script

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("nonfinite_data")


def _poison_engine(monkeypatch, step1, *, nan_loss_at=(), nan_grad_at=()):
    """Wrap step 1's ``initialize_engine``: training forward number k (1-based) in ``nan_loss_at``
    returns a NaN loss; backward number k in ``nan_grad_at`` turns one weight's gradient into NaN
    while the loss stays finite."""
    original = step1.initialize_engine
    calls = {"forward": 0, "backward": 0}

    def initialize_engine(model, ds_config, optim):
        engine = original(model, ds_config, optim)

        def poison_loss(module, inputs, output):
            if not module.training:
                return output
            calls["forward"] += 1
            if calls["forward"] in nan_loss_at:
                output.loss = output.loss * float("nan")
            return output

        def poison_grad(grad):
            calls["backward"] += 1
            return grad * float("nan") if calls["backward"] in nan_grad_at else grad

        engine.module.register_forward_hook(poison_loss)
        next(p for p in engine.module.parameters() if p.requires_grad).register_hook(poison_grad)
        return engine

    monkeypatch.setattr(step1, "initialize_engine", initialize_engine)
    return calls


def test_all_finite_by_hand():
    from dschat.training.nonfinite import all_finite

    nan, inf = float("nan"), float("inf")
    big = torch.full((4,), 3e38)  # finite, though its sum of squares overflows
    assert all_finite() and all_finite(torch.tensor(2.0), big, torch.zeros(3, dtype=torch.bfloat16))
    for bad in (nan, inf, -inf):
        tensor = torch.zeros(100_003)
        tensor[77_777] = bad
        assert not all_finite(torch.ones(2), tensor)
        assert not all_finite(torch.tensor([bad], dtype=torch.bfloat16), big)


@pytest.mark.parametrize("other_rank_finite", [True, False])
def test_a_loss_counts_only_when_every_rank_has_a_finite_one(other_rank_finite, monkeypatch):
    """The guard's ranks agree by AND: a rank whose own loss is finite skips with the rank whose loss
    is NaN (else that rank's NaN gradients are all-reduced into everyone's). The all-reduce mean of
    a second rank's flag is stood in for here; the real collective runs in the two-rank step tests."""
    import dschat.training.nonfinite as nonfinite

    other = 1.0 if other_rank_finite else 0.0
    monkeypatch.setattr(nonfinite, "get_all_reduce_mean", lambda flag: (flag + other) / 2)
    guard = nonfinite.NonFiniteGuard(limit=5, rank=0, device="cpu")
    assert guard.loss_ok(torch.tensor(1.0)) is other_rank_finite
    assert guard.loss_ok(torch.tensor(float("nan"))) is False
    assert guard.skipped == (1 if other_rank_finite else 2)


def _weights_finite(engine) -> bool:
    return all(bool(torch.isfinite(p.detach()).all()) for p in engine.module.parameters())


def test_a_nan_loss_skips_that_micro_step(data_dir, tmp_path, monkeypatch, capsys):
    step1 = load_script("step1")
    _poison_engine(monkeypatch, step1, nan_loss_at=(3,))
    result = step1.main(base_argv("tiny-llama", data_dir, "--zero_stage", "0", max_train_steps=4, batch_size=2))
    assert result.skipped_nonfinite == 1
    assert result.optimizer_steps == 4 and len(result.train_losses) == 4  # the skipped batch is not counted
    assert all(math.isfinite(x) for x in result.train_losses) and _weights_finite(result.engine)
    assert "[non-finite] non-finite loss at epoch 0 step 2; micro-step skipped" in capsys.readouterr().out


@pytest.mark.parametrize("zero_stage", ["0", "2"])
def test_nan_gradients_skip_the_optimizer_step(zero_stage, data_dir, tmp_path, monkeypatch, capsys):
    step1 = load_script("step1")
    _poison_engine(monkeypatch, step1, nan_grad_at=(2,))
    result = step1.main(base_argv("tiny-llama", data_dir, "--zero_stage", zero_stage, max_train_steps=4,
                                  batch_size=2))
    assert result.skipped_nonfinite == 1
    assert all(math.isfinite(x) for x in result.train_losses)
    assert _weights_finite(result.engine)  # without the guard, ZeRO 0 fp32 writes NaN into every weight
    assert "non-finite gradients at epoch 0 step 1; optimizer step skipped" in capsys.readouterr().out


def test_too_many_in_a_row_stop_the_run_naming_the_last_checkpoint(data_dir, tmp_path, monkeypatch):
    step1 = load_script("step1")
    _poison_engine(monkeypatch, step1, nan_loss_at=range(4, 100))  # broken from the 4th micro-step on
    out = tmp_path / "out"
    with pytest.raises(TrainingDiverged) as err:
        step1.main(base_argv("tiny-llama", data_dir, "--save_interval", "1", "--max_nonfinite_steps", "3",
                             "--output_dir", str(out), max_train_steps=8, batch_size=2))
    message = str(err.value)
    assert "3 steps in a row had NaN/inf loss or gradients" in message
    assert f"--resume_from {out / 'checkpoints' / 'step_00000003'}" in message
    assert not (out / "model.safetensors").exists()  # no final model from a diverged run


def test_weights_made_non_finite_by_a_step_with_finite_gradients_are_never_checkpointed(data_dir, tmp_path):
    """A learning rate far too high: loss and gradients finite, the weights NaN after the step. The
    checkpoint of them was named the last good one (and rotated good ones out); now none is written."""
    step1 = load_script("step1")
    out = tmp_path / "out"
    with pytest.raises(TrainingDiverged) as err:
        step1.main(base_argv("tiny-llama", data_dir, "--save_interval", "1", "--learning_rate", "1e38",
                             "--output_dir", str(out), max_train_steps=4, batch_size=2))
    assert str(err.value).startswith("training stopped: the weights hold NaN/inf after 1 optimizer steps (their loss "
                                     "and gradients were finite), and are not saved; no good checkpoint was saved")
    assert not list((out / "checkpoints").glob("step_*")) and not (out / "model.safetensors").exists()


def test_a_damaged_older_checkpoint_does_not_stop_a_run_that_resumes_from_a_good_one(data_dir, tmp_path):
    """The weights check before a save names the last good checkpoint only when it refuses: a damaged
    marker among the older checkpoints stopped every later save (--resume_from given or not)."""
    from dschat.training.rotation import MARKER

    step1 = load_script("step1")
    out = tmp_path / "out"
    step1.main(base_argv("tiny-llama", data_dir, "--save_interval", "1", "--output_dir", str(out),
                         max_train_steps=2, batch_size=2))
    first, second = sorted((out / "checkpoints").glob("step_*"))
    (first / MARKER).write_text('{"trunc')
    step1.main(base_argv("tiny-llama", data_dir, "--save_interval", "1", "--output_dir", str(out),
                         "--resume_from", str(second), max_train_steps=4, batch_size=2))
    assert (out / "checkpoints" / "step_00000004").is_dir() and (out / "model.safetensors").is_file()


@pytest.mark.parametrize("rank, finite", [(0, False), (1, True)])
def test_the_weights_check_reads_only_the_real_elements_of_a_zero3_partition(rank, finite, monkeypatch):
    """ZeRO-3 pads every partition of a parameter to one size: 3 elements on 2 ranks are [a, b] and
    [c, padding], and the padding is uninitialised memory. A NaN bit pattern there stopped a healthy run."""
    from types import SimpleNamespace

    from dschat.training import nonfinite

    param = torch.nn.Parameter(torch.empty(0))
    param.ds_numel, param.ds_process_group = 3, None
    param.ds_tensor = torch.tensor([1.0, math.nan])  # rank 0: [a, NaN]; rank 1: [c, padding NaN]
    param.ds_tensor.ds_numel = 2
    monkeypatch.setattr(nonfinite, "_partition_rank", lambda p: rank)
    engine = SimpleNamespace(module=torch.nn.Module(), device="cpu")
    engine.module.parameters = lambda: iter([param])
    if finite:
        nonfinite.check_weights_finite({"model": engine}, 5, lambda: None)
    else:
        with pytest.raises(TrainingDiverged, match="the weights hold NaN/inf after 5 optimizer steps"):
            nonfinite.check_weights_finite({"model": engine}, 5, lambda: None)
