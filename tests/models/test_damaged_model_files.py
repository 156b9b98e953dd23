"""Model folders whose files are damaged, cut short or missing (a full disk, a broken copy) or that name
a model family transformers does not know: one UserError line naming the file and the fix (the CLIs
exit 2), where transformers and safetensors raise a traceback; other errors pass through unchanged."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from dschat.errors import UserError
from dschat.models import build
from dschat.models.build import create_critic_model, create_hf_model
from dschat.models.registry import resolve_model_path
from dschat.models.save import save_hf_model
from dschat.models.tokenizer import load_hf_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_hf_tokenizer("tiny-opt")


def _model_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(resolve_model_path("tiny-opt"), folder)
    return folder


def _cut(file: Path, keep: float) -> None:
    data = file.read_bytes()
    file.write_bytes(data[:int(len(data) * keep)])


@pytest.mark.parametrize("keep", [0.5, 0.001], ids=["cut-in-the-data", "cut-in-the-header"])
def test_a_truncated_model_file_is_one_line_naming_it(tmp_path, tokenizer, keep):
    folder = _model_folder(tmp_path)
    _cut(folder / "model.safetensors", keep)
    weights = folder / "model.safetensors"
    with pytest.raises(UserError, match=rf"cannot read the weights in {weights} \(SafetensorError: .*\): the file is "
                                        "damaged or truncated; copy or save the model again"):
        create_hf_model(AutoModelForCausalLM, str(folder), tokenizer)


def test_the_damaged_file_named_is_the_one_loaded_not_a_damaged_backup_beside_it(tmp_path, tokenizer):
    folder = _model_folder(tmp_path)
    (folder / "a-backup.safetensors").write_bytes(b"not safetensors")  # sorts first; never loaded
    _cut(folder / "model.safetensors", 0.5)
    with pytest.raises(UserError, match=rf"cannot read the weights in {folder / 'model.safetensors'} "):
        create_hf_model(AutoModelForCausalLM, str(folder), tokenizer)


def test_a_folder_without_weights_is_one_line(tmp_path, tokenizer):
    folder = _model_folder(tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(UserError, match=rf"{folder} has no model weights \(model.safetensors or pytorch_model.bin.*\); "
                                        "copy or save the model again"):
        create_hf_model(AutoModelForCausalLM, str(folder), tokenizer)


def test_a_missing_shard_is_one_line_naming_it(tmp_path, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-opt"))
    folder = tmp_path / "sharded"
    model.save_pretrained(str(folder), max_shard_size="20KB")
    tokenizer.save_pretrained(str(folder))
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    with pytest.raises(UserError, match=rf"^{folder} lacks {shards[1].name}, which its weights index lists; copy or "
                                        "save the model again$"):
        create_hf_model(AutoModelForCausalLM, str(folder), tokenizer)


@pytest.mark.parametrize("config,message", [
    ("{bad", "config.json is not valid JSON; the folder is damaged: copy or save the model again"),
    (None, r"config.json names model type 'llamazz', which transformers .* does not know; upgrade transformers"),
    ('{"hidden_size": 16}', "config.json has no model_type, so it is no model's config that transformers reads"),
], ids=["not-json", "unknown-model-type", "no-model-type"])
def test_a_bad_config_is_one_line(tmp_path, tokenizer, config, message):
    folder = _model_folder(tmp_path)
    if config is None:
        config = json.dumps({**json.loads((folder / "config.json").read_text()), "model_type": "llamazz"})
    (folder / "config.json").write_text(config)
    with pytest.raises(UserError, match=message):
        create_hf_model(AutoModelForCausalLM, str(folder), tokenizer)


@pytest.mark.parametrize("damage", ["v_head-garbage", "v_head-cut", "body-cut"])
def test_a_damaged_step2_output_is_one_line_naming_the_file(tmp_path, tokenizer, damage):
    folder = save_hf_model(create_critic_model("tiny-opt", tokenizer, None), tokenizer, tmp_path / "rm")
    file = folder / ("model.safetensors" if damage == "body-cut" else "v_head.safetensors")
    if damage == "v_head-garbage":
        file.write_bytes(b"\xff" * 64)
    else:
        _cut(file, 0.5)
    with pytest.raises(UserError, match=rf"cannot read (the weights in )?{file} \(SafetensorError: .*\): the file is "
                                        r".*; copy or save the model again"):
        create_critic_model(str(folder), tokenizer, None, rlhf_training=True)


def test_other_load_errors_pass_through():
    """Only the errors of missing or damaged weights become a UserError: anything else is a bug to see."""
    class Failing:
        @staticmethod
        def from_pretrained(path, **kwargs):
            raise OSError("[Errno 122] Disk quota exceeded")

    with pytest.raises(OSError, match="Disk quota exceeded"):
        build.load_pretrained(Failing, "somewhere")


@pytest.mark.parametrize("damage", ["cut", "garbage"])
def test_a_damaged_pytorch_model_bin_is_one_line_naming_it(tmp_path, tokenizer, damage):
    """Upstream's format: ``torch.load(weights_only=True)`` fails on a cut zip archive (RuntimeError)
    and on bytes that are no tensor file (UnpicklingError)."""
    import torch

    folder = _model_folder(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    (folder / "model.safetensors").unlink()
    weights = folder / "pytorch_model.bin"
    torch.save(model.state_dict(), weights)
    create_hf_model(AutoModelForCausalLM, str(folder), tokenizer)  # whole, it loads
    if damage == "cut":
        _cut(weights, 0.5)
    else:
        weights.write_bytes(b"garbage" * 10)
    with pytest.raises(UserError, match=rf"^cannot read the weights in {weights} \((RuntimeError|UnpicklingError): "
                                        r".*\): the file is damaged or truncated, or holds Python objects"):
        create_hf_model(AutoModelForCausalLM, str(folder), tokenizer)


def test_a_model_error_beside_a_trainers_pickle_is_not_called_damaged_weights(tmp_path, tokenizer):
    """A trainer's ``training_args.bin`` (a pickle, not tensors) beside whole weights: a model error
    (here a config that does not match the weights) passes through as itself, not as damaged weights."""
    import argparse

    import torch

    folder = _model_folder(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    (folder / "model.safetensors").unlink()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    torch.save(argparse.Namespace(learning_rate=1e-5), folder / "training_args.bin")  # weights_only refuses it
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "ffn_dim": config["ffn_dim"] * 2}))
    with pytest.raises(RuntimeError) as raised:
        create_hf_model(AutoModelForCausalLM, str(folder), tokenizer)
    assert not isinstance(raised.value, UserError) and "ignore_mismatched_sizes" in str(raised.value)


@pytest.mark.parametrize("damage", ["legacy-cut", "zeros", "empty"])
def test_other_damage_torch_load_reports_is_one_line_too(tmp_path, tokenizer, damage):
    """An old-format (non-zip) file cut short, a file of zeros, an empty file: each of torch.load's
    own failures on ``pytorch_model.bin`` names the file in one line."""
    import torch

    folder = _model_folder(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    (folder / "model.safetensors").unlink()
    weights = folder / "pytorch_model.bin"
    if damage == "legacy-cut":
        torch.save(model.state_dict(), weights, _use_new_zipfile_serialization=False)
        _cut(weights, 0.5)
    else:
        weights.write_bytes(b"\0" * 4096 if damage == "zeros" else b"")
    with pytest.raises(UserError, match=rf"^cannot read the weights in {weights} \("):
        create_hf_model(AutoModelForCausalLM, str(folder), tokenizer)


def test_a_hub_id_neither_cached_nor_reachable_is_one_line(monkeypatch):
    from transformers import AutoConfig

    from dschat.models.registry import load_config

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them "
                      "in the cached files.")

    monkeypatch.setattr(AutoConfig, "from_pretrained", offline)
    with pytest.raises(UserError, match="^org/model is not a local folder and not in the Hugging Face cache, and the "
                                        "hub cannot be reached"):
        load_config("org/model")
