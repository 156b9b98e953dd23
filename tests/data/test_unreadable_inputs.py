"""Inputs this account may not read (a data file or folder, a model folder, its config.json or weights, a
metrics file) are one line, ``cannot read X (Permission denied): ...``, where a PermissionError traceback
was (or, for model.safetensors, a line blaming a weights index the folder does not have). Read for real in
one child process that drops root's read-override capabilities (skipped where they cannot be dropped).

Also the lines that named the wrong problem: a checkpoint of another model or step blamed on the
trainable-parameter flags, --metrics given a folder or a file without records, a CSV file read as JSON,
local/jsonfile's candidate folders named twice, and --recover given a file."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from torch import nn

from dschat.data import local_files as lf
from dschat.data.adapters import local
from dschat.data.dispatch import resolve_dataset
from dschat.errors import UserError
from dschat.eval import report
from dschat.models import save
from dschat.models.registry import resolve_model_path
from dschat.training import checkpoint as ckpt
from helpers import PYTHON, REPO
from helpers.steps import cli_env

# name -> (the path made unreadable, what the child calls, the path its line names)
CASES: dict[str, tuple[str, str, str]] = {
    "data-file": ("d.jsonl", "resolve_dataset('d.jsonl').fingerprint()", "d.jsonl"),
    "data-file-read": ("d.jsonl", "lf.read_records(Path('d.jsonl'))", "d.jsonl"),
    "data-folder": ("dd", "resolve_dataset('dd/').fingerprint()", "dd"),
    "model-config": ("mc/config.json", "load_config(resolve_model_path('mc'))", "mc/config.json"),
    "model-folder": ("mu", "resolve_model_path('mu')", "mu"),
    "model-weights": ("ms/model.safetensors",
                      "create_hf_model(AutoModelForCausalLM, 'ms', load_hf_tokenizer('ms'))", "ms/model.safetensors"),
    "value-head": ("vh.safetensors", "read_safetensors('vh.safetensors')", "vh.safetensors"),
    "metrics-file": ("m.jsonl", "report.curves_only('m.jsonl', 'rep')", "m.jsonl"),
}

CHILD = """
import sys
from pathlib import Path
from transformers import AutoModelForCausalLM
from dschat.data import local_files as lf
from dschat.data.dispatch import resolve_dataset
from dschat.errors import UserError
from dschat.eval import report
from dschat.models.build import create_hf_model
from dschat.models.registry import load_config, resolve_model_path
from dschat.models.reward_model import read_safetensors
from dschat.models.tokenizer import load_hf_tokenizer
try:
    open("probe").close()
    print("PROBE readable")
except PermissionError:
    pass
for name, call in {calls!r}.items():
    try:
        eval(call)
        print(name, "OK")
    except UserError as err:
        print(name, "error:", err)
    except Exception as err:
        print(name, type(err).__name__, err)
"""
DROP = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search"]


@pytest.fixture(scope="module")
def unreadable_lines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """What the child printed for each case of :data:`CASES`, each input chmod 000 at once."""
    root = tmp_path_factory.mktemp("unreadable")
    row = json.dumps({"prompt": " Human: hi Assistant:", "chosen": " yes", "rejected": " no"}) + "\n"
    (root / "d.jsonl").write_text(row * 4)
    (root / "dd").mkdir()
    (root / "dd" / "train.jsonl").write_text(row * 4)
    for name in ("mc", "mu", "ms"):
        shutil.copytree(resolve_model_path("tiny-opt"), root / name)
    shutil.copy(root / "ms" / "model.safetensors", root / "vh.safetensors")
    (root / "m.jsonl").write_text(json.dumps({"global_step": 1, "reward": 0.5}) + "\n")
    (root / "probe").write_text("x")
    for path in {case[0] for case in CASES.values()} | {"probe"}:
        (root / path).chmod(0)
    prefix = DROP if os.geteuid() == 0 else []
    if prefix and shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot drop the capability that reads any file")
    calls = {name: call for name, (_, call, _) in CASES.items()}
    try:
        proc = subprocess.run([*prefix, PYTHON, "-c", CHILD.format(calls=calls)], cwd=root, env=cli_env(),
                              capture_output=True, text=True, timeout=300)
    finally:
        for path in {case[0] for case in CASES.values()} | {"probe"}:
            (root / path).chmod(0o755)
    if "PROBE readable" in proc.stdout or (proc.returncode != 0 and "Operation not permitted" in proc.stderr):
        pytest.skip("this account reads files whatever their mode (capabilities cannot be dropped here)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.split(" ", 1)[0] in CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_an_unreadable_input_is_one_line_naming_it(unreadable_lines, case):
    named = CASES[case][2]
    assert unreadable_lines.get(case, "").startswith(f"error: cannot read {named} (Permission denied): give this "
                                                     "account read access"), unreadable_lines.get(case)


def test_a_data_folder_it_cannot_list_is_one_line_and_an_unreadable_subfolder_is_skipped(tmp_path, monkeypatch):
    """The fingerprint's walk: the folder itself unreadable is :func:`cannot_read`'s line; a subfolder
    it may not list (a root-owned lost+found, another user's folder: nothing reads them) is skipped."""
    (tmp_path / "lost+found").mkdir()
    (tmp_path / "train.jsonl").write_text("{}")
    denied = [str(tmp_path / "lost+found")]
    real = os.walk

    def walk(top, onerror=None, followlinks=False):
        for name in denied:
            onerror(PermissionError(13, "Permission denied", name))
        yield from real(top) if str(tmp_path) not in denied else ()

    monkeypatch.setattr(lf.os, "walk", walk)
    assert "train.jsonl" in [p.name for p in lf.files_under(tmp_path)]
    denied[:] = [str(tmp_path)]
    with pytest.raises(UserError, match=rf"^cannot read {tmp_path} \(Permission denied\)"):
        lf.files_under(tmp_path)


# --- a checkpoint of another model or step --------------------------------------------------------


class _Tiny(nn.Module):
    def __init__(self, prefix: str, width: int = 2, lora_rank: int = 0) -> None:
        super().__init__()
        inner = nn.Module()
        inner.proj = nn.Linear(width, width, bias=False)
        if lora_rank:
            inner.proj.lora_right_weight = nn.Parameter(inner.proj.weight.new_zeros(width, lora_rank))
        self.add_module(prefix, inner)


def _record(model: nn.Module) -> dict:
    return {"trainable": {"model": ckpt.trainable_parameters(model)}}


def test_a_checkpoint_of_another_model_or_step_says_so(tmp_path):
    # another family (model.decoder.* vs model.*) or step (v_head)
    with pytest.raises(UserError, match="is a checkpoint of another model or step: its 'model' trained ") as err:
        ckpt.check_trainable(tmp_path, _record(_Tiny("decoder")), {"model": _Tiny("layers")})
    assert ".proj.weight [2, 2], which this run's model lacks" in str(err.value)
    assert "--freeze_layers" not in str(err.value)
    # another size of the family, or a vocabulary padded otherwise (--add_eot_token): the shapes differ
    with pytest.raises(UserError, match=r"trained layers.proj.weight \[2, 2\], shaped \[3, 3\] in this run's model: "
                                        r"a checkpoint of another model size, or of a run whose vocabulary differed"):
        ckpt.check_trainable(tmp_path, _record(_Tiny("layers", width=2)), {"model": _Tiny("layers", width=3)})


def test_a_checkpoint_of_the_same_trainable_parameters_passes(tmp_path):
    ckpt.check_trainable(tmp_path, _record(_Tiny("layers", lora_rank=2)), {"model": _Tiny("layers", lora_rank=2)})


@pytest.mark.parametrize("saved,now", [
    (_Tiny("layers"), _Tiny("layers", lora_rank=2)),  # LoRA now, not then
    (_Tiny("layers", lora_rank=4), _Tiny("layers", lora_rank=2)),  # another LoRA rank
    (_Tiny("layers", lora_rank=4), _Tiny("layers")),  # LoRA then, not now
], ids=["lora-added", "lora-rank", "lora-dropped"])
def test_other_trainable_flags_still_name_the_flags(tmp_path, saved, now):
    with pytest.raises(UserError, match=r"the flags that choose what trains \(--freeze_layers, LoRA flags\)"):
        ckpt.check_trainable(tmp_path, _record(saved), {"model": now})


# --- report --metrics -------------------------------------------------------------------------------


def test_curves_only_reads_a_step3_output_folder_and_refuses_one_without_metrics(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(UserError, match=r"--metrics .*run is a folder without a metrics.jsonl"):
        report.curves_only(tmp_path / "run", tmp_path / "rep")
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"global_step": 1, "reward": 0.5}) + "\n")
    assert report.curves_only(tmp_path / "run", tmp_path / "rep")[0].startswith("PPO curves: ")


@pytest.mark.parametrize("text", ["", "not json {\n", json.dumps({"prompt": "p", "chosen": "c"}) + "\n"],
                         ids=["empty", "malformed", "a-data-file"])
def test_curves_only_refuses_a_metrics_file_without_records(tmp_path, text):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(text)
    with pytest.raises(UserError, match="holds no PPO or evaluation records"):
        report.curves_only(metrics, tmp_path / "rep")
    assert not (tmp_path / "rep").exists()


# --- lines that named another problem ---------------------------------------------------------------


def test_a_csv_data_file_is_named_as_an_unsupported_format(tmp_path):
    (tmp_path / "x.csv").write_text("prompt,chosen\nhi,yes\n")
    with pytest.raises(UserError, match=r"x.csv: CSV \(.csv\) is not a supported local data format; dschat reads "
                                        r"\.json, \.jsonl, \.parquet files"):
        resolve_dataset(str(tmp_path / "x.csv"))
    with pytest.raises(UserError, match="is not a supported local data format"):
        lf.read_records(tmp_path / "x.csv")


def test_local_jsonfile_names_each_folder_it_looked_in_once(monkeypatch):
    monkeypatch.chdir(REPO)
    if (REPO / "data" / "train.json").is_file():
        pytest.skip("this checkout holds data/train.json")
    with pytest.raises(UserError) as err:
        local.find_local_jsonfile_dir()
    assert f"none found under {REPO.resolve()};" in str(err.value)


def test_recover_given_a_file_says_it_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match=r"--recover .*f is a file, not a folder"):
        save.main(["--recover", str(tmp_path / "f")])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))


def test_a_linked_split_folder_is_in_the_fingerprint_and_a_link_cycle_ends(tmp_path):
    """A save_to_disk copy whose split folders are links: load_from_disk reads through them, so the
    cache key must hash what they hold (it saw dataset_dict.json only and served stale rows)."""
    real = tmp_path / "real" / "train"
    real.mkdir(parents=True)
    (real / "data.arrow").write_bytes(b"first")
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "dataset_dict.json").write_text("{}")
    (copy / "train").symlink_to(real, target_is_directory=True)
    (copy / "loop").symlink_to(copy, target_is_directory=True)  # walked once, not forever
    assert [p.relative_to(copy).as_posix() for p in lf.files_under(copy)] == ["dataset_dict.json", "train/data.arrow"]
    before = lf.fingerprint_files(lf.files_under(copy), copy)
    (real / "data.arrow").write_bytes(b"second")
    assert lf.fingerprint_files(lf.files_under(copy), copy) != before
