"""The report's and the chatbot's decoding and --device options: a bad one is one line (exit 2)
before any model loads or --out is made (dschat.eval.heldout.check_sampling and
dschat.eval.scoring.pick_device, shared by both tools)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helpers import REPO

from dschat.errors import UserError
from dschat.eval import report, scoring
from dschat.eval.heldout import EvalSettings


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "0"], "--temperature must be > 0 when sampling, got 0.0; or pass --greedy"),
    (["--temperature", "nan"], "--temperature must be > 0"),
    (["--temperature", "1e-300"], "--temperature must be a finite number of at least 1e-06 when sampling, got "
                                  "1e-300; or pass --greedy (greedy decoding)"),
    (["--temperature", "inf"], "--temperature must be a finite number of at least 1e-06"),
    (["--top_p", "0"], "--top_p must be in (0, 1] when sampling (1: off), got 0.0"),
    (["--top_p", "1.5"], "--top_p must be in (0, 1]"),
    (["--top_k", "-1"], "--top_k must be >= 0 when sampling (0: off), got -1"),
])
def test_report_refuses_bad_sampling_before_making_out(tmp_path, flags, message):
    out = tmp_path / "out"
    argv = ["--sft", str(tmp_path / "a"), "--rlhf", str(tmp_path / "b"), "--reward", str(tmp_path / "c"),
            "--out", str(out), *flags]
    with pytest.raises(UserError) as err:
        report.main(argv)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert not out.exists()
    with pytest.raises(UserError, match="no config.json"):  # --greedy: sampling settings are not used
        report.main(argv + ["--greedy"])


def _no_cuda(monkeypatch, count: int = 0) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_pick_device_refuses_a_device_this_machine_lacks(monkeypatch):
    _no_cuda(monkeypatch)
    assert scoring.pick_device("auto") == torch.device("cpu")
    assert scoring.pick_device("cpu") == torch.device("cpu")
    with pytest.raises(UserError, match=r"^--device cuda: this machine has no CUDA device; give --device cpu or "
                                        r"--device auto$"):
        scoring.pick_device("cuda")
    with pytest.raises(UserError, match="--device 'gpu' is not a torch device; give cpu, cuda, cuda:N or auto"):
        scoring.pick_device("gpu")
    _no_cuda(monkeypatch, count=2)
    assert scoring.pick_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(UserError, match=r"--device cuda:2: this machine has 2 CUDA device\(s\), cuda:0 to cuda:1"):
        scoring.pick_device("cuda:2")


def test_report_checks_the_device_before_making_out(monkeypatch, tmp_path):
    _no_cuda(monkeypatch)
    for name in ("check_actor_folder", "check_reward_folder"):  # good folders, as far as this test goes
        monkeypatch.setattr(scoring, name, lambda path: path)
    out = tmp_path / "out"
    with pytest.raises(UserError, match="--device cuda: this machine has no CUDA device"):
        report.build_report("sft", "rlhf", "reward", out, EvalSettings(device="cuda"))
    assert not out.exists()


def test_chat_with_a_cuda_device_on_a_machine_without_one_is_one_line():
    env = dict(os.environ, HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(REPO / "chat.py"), "--path", "tiny-opt", "--device", "cuda"],
                          input="hello\n", env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("error: --device cuda: this machine has no CUDA device; give --device cpu or "
                                   "--device auto")
    assert "Round 1" not in proc.stdout
