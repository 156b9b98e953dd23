"""A model folder without tokenizer files (its ``tokenizer*`` files deleted) loaded as an empty GPT-2
tokenizer of one token: step 1 trained NaN steps, step 3 trained garbage and exited 0, the chatbot
raised a traceback. Now one line names the folder and the fix; a tokenizer that loads with at most one
token is refused too."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dschat.errors import UserError
from dschat.models.registry import resolve_model_path
from dschat.models.tokenizer import load_hf_tokenizer
from helpers import PYTHON
from helpers.steps import run_cli


def _without_tokenizer(tmp_path: Path) -> Path:
    folder = tmp_path / "m"
    shutil.copytree(resolve_model_path("tiny-opt"), folder)
    for file in folder.glob("tokenizer*"):
        file.unlink()
    return folder


def test_a_folder_without_tokenizer_files_is_one_line_naming_it_and_the_fix(tmp_path):
    folder = _without_tokenizer(tmp_path)
    with pytest.raises(UserError, match=f"^{folder} has no tokenizer files .* copy the tokenizer files of the model it "
                                        "was trained from .* or set \"_name_or_path\" in its config.json"):
        load_hf_tokenizer(str(folder))
    # The second fix works: the tokenizer its config.json names.
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "_name_or_path": resolve_model_path("tiny-opt")}))
    assert len(load_hf_tokenizer(str(folder))) == len(load_hf_tokenizer("tiny-opt"))


def test_a_tokenizer_of_at_most_one_token_is_refused(tmp_path):
    folder = _without_tokenizer(tmp_path)
    (folder / "vocab.json").write_text("{}")  # vocabulary files that hold nothing
    (folder / "merges.txt").write_text("")
    with pytest.raises(UserError, match=f"the tokenizer loaded from {folder} has 1 token"):
        load_hf_tokenizer(str(folder))


def test_data_prepare_refuses_it_before_writing(tmp_path):
    folder = _without_tokenizer(tmp_path)
    proc = run_cli([PYTHON, "-m", "dschat.data.prepare", "--model_name_or_path", str(folder), "--train_phase", "1",
                    "--data_path", "dschat/builtin", "--data_output_path", str(tmp_path / "cache")], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {folder} has no tokenizer files")
    assert not (tmp_path / "cache").exists()
