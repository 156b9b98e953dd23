"""Tiny random-weight test models (dschat.models.tiny) and model-path resolution (dschat.models.registry)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dschat.errors import UserError
from dschat.models import registry
from dschat.models import tiny
from dschat.models.registry import SHORT_NAMES, resolve_model_path, short_names_help
from dschat.models.tiny import MARKER_FILE, TINY_NAMES, build_tiny_model

# Everything a folder must hold for AutoModelForCausalLM / AutoTokenizer and for the cache check.
EXPECTED_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", MARKER_FILE}
# Files compared byte for byte between two independent builds.
BYTE_COMPARED = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", MARKER_FILE)

# Built in a child Python so that a different PYTHONHASHSEED and a fresh process are covered.
BUILD_SCRIPT = """
import logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
from dschat.models.tiny import build_tiny_model
for name in sys.argv[2:]:
    print("RESULT", build_tiny_model(name, Path(sys.argv[1])), flush=True)
"""


def _child_env(hash_seed: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(PYTHONHASHSEED=hash_seed, HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false")
    return env


def _spawn_build(root: Path, names: list[str], hash_seed: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BUILD_SCRIPT, str(root), *names], env=_child_env(hash_seed),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    for name in TINY_NAMES:
        build_tiny_model(name, root)
    return root


@pytest.mark.parametrize("name", TINY_NAMES)
def test_builds_reloads_and_generates(tiny_root: Path, name: str) -> None:
    folder = build_tiny_model(name, tiny_root)
    assert folder == tiny_root / name
    assert EXPECTED_FILES <= {p.name for p in folder.iterdir()}
    assert not (folder / "chat_template.jinja").exists()

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    family = "llama" if name == "tiny-llama" else "opt"
    assert model.config.model_type == family
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    assert model.config.max_position_embeddings == 512
    assert model.config.vocab_size % 8 == 0 and len(tokenizer) <= model.config.vocab_size < len(tokenizer) + 8
    assert 500 <= len(tokenizer) <= 1000  # a ~1000-token BPE, not a byte fallback
    assert tokenizer.chat_template is None
    # Config and generation config agree with the tokenizer on every special id.
    for cfg in (model.config, model.generation_config):
        assert cfg.bos_token_id == tokenizer.bos_token_id
        assert cfg.eos_token_id == tokenizer.eos_token_id
        assert cfg.pad_token_id == tokenizer.pad_token_id

    batch = tokenizer([" Human: Tell me about volcanoes. Assistant:", " Human: Hi Assistant:"],
                      padding=True, return_tensors="pt")
    assert set(batch) == {"input_ids", "attention_mask"}  # no token_type_ids for OPT/LLaMA forward()
    out = model.generate(**batch, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert out.shape == (2, batch["input_ids"].shape[1] + 4)
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (*batch["input_ids"].shape, model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_special_token_layouts(tiny_root: Path) -> None:
    llama = AutoTokenizer.from_pretrained(tiny_root / "tiny-llama")
    assert (llama.unk_token, llama.bos_token, llama.eos_token, llama.pad_token) == ("<unk>", "<s>", "</s>", "<pad>")
    assert (llama.unk_token_id, llama.bos_token_id, llama.eos_token_id) == (0, 1, 2)  # LLaMA's ids
    assert len({llama.bos_token_id, llama.eos_token_id, llama.pad_token_id}) == 3

    opt = AutoTokenizer.from_pretrained(tiny_root / "tiny-opt")
    assert opt.bos_token == opt.eos_token == "</s>" and opt.pad_token == "<pad>"
    assert (opt.pad_token_id, opt.eos_token_id) == (1, 2)  # OPT's ids
    assert opt.pad_token_id != opt.eos_token_id

    quirk = AutoTokenizer.from_pretrained(tiny_root / "tiny-opt-quirk")
    assert quirk.pad_token == quirk.eos_token == quirk.bos_token == "</s>"
    assert quirk.pad_token_id == quirk.eos_token_id == quirk.bos_token_id == 2
    # Padding with the quirk tokenizer writes EOS ids: masks must not be derived from ids.
    batch = quirk(["a b c d", "a"], padding=True)
    assert batch["input_ids"][1][-1] == quirk.eos_token_id and batch["attention_mask"][1][-1] == 0


def test_quirk_is_tiny_opt_after_pad_eq_eos(tiny_root: Path) -> None:
    """Same weights and vocabulary as tiny-opt; only the pad token differs (upstream's `pad = eos`)."""
    opt, quirk = tiny_root / "tiny-opt", tiny_root / "tiny-opt-quirk"
    assert (opt / "model.safetensors").read_bytes() == (quirk / "model.safetensors").read_bytes()
    opt_cfg = json.loads((opt / "config.json").read_text())
    quirk_cfg = json.loads((quirk / "config.json").read_text())
    assert opt_cfg.pop("pad_token_id") == 1 and quirk_cfg.pop("pad_token_id") == 2
    assert opt_cfg == quirk_cfg
    assert json.loads((opt / "tokenizer.json").read_text())["model"] == \
        json.loads((quirk / "tokenizer.json").read_text())["model"]


def test_opt_keeps_default_dropout(tiny_root: Path) -> None:
    cfg = json.loads((tiny_root / "tiny-opt" / "config.json").read_text())
    assert cfg["dropout"] == 0.1 and cfg["ffn_dim"] == 128 and cfg["word_embed_proj_dim"] == 64
    llama_cfg = json.loads((tiny_root / "tiny-llama" / "config.json").read_text())
    heads = (llama_cfg["num_attention_heads"], llama_cfg["num_key_value_heads"])
    assert llama_cfg["intermediate_size"] == 128 and heads == (4, 2)


@pytest.mark.parametrize("name", TINY_NAMES)
def test_tokenizer_prepends_bos_and_round_trips(tiny_root: Path, name: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_root / name)
    text = " Human: What should I know about puffins? Assistant: Puffins nest in burrows. ünïcødé ✓"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids[1:]
    assert tokenizer.unk_token_id not in ids  # byte-level: nothing is unknown
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # The BPE learned the corpus: a frequent word is one token, not bytes.
    assert len(tokenizer(" Human:", add_special_tokens=False)["input_ids"]) <= 2


def test_tokenizer_trained_on_builtin_train_split() -> None:
    from dschat.data.builtin import read_rows

    rows = read_rows("train")
    texts = tiny.corpus_texts()
    assert texts[:3] == [rows[0]["prompt"], rows[0]["chosen"], rows[0]["rejected"]]
    assert len(texts) == 3 * len(rows)


def test_second_call_is_a_cache_hit(tiny_root: Path) -> None:
    marker = tiny_root / "tiny-llama" / MARKER_FILE
    before = marker.stat().st_mtime_ns
    assert build_tiny_model("tiny-llama", tiny_root) == tiny_root / "tiny-llama"
    assert marker.stat().st_mtime_ns == before


def test_incomplete_or_stale_folder_is_rebuilt(tmp_path: Path) -> None:
    folder = build_tiny_model("tiny-opt", tmp_path)
    reference = (folder / "model.safetensors").read_bytes()
    # A folder without the marker (e.g. copied by hand, half-deleted) is not trusted.
    (folder / MARKER_FILE).unlink()
    (folder / "model.safetensors").write_bytes(b"garbage")
    build_tiny_model("tiny-opt", tmp_path)
    assert (folder / "model.safetensors").read_bytes() == reference
    # A marker from another recipe / corpus is stale.
    record = json.loads((folder / MARKER_FILE).read_text())
    (folder / MARKER_FILE).write_text(json.dumps({**record, "corpus_sha256": "0" * 64}))
    build_tiny_model("tiny-opt", tmp_path)
    assert json.loads((folder / MARKER_FILE).read_text()) == record
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name or ".old-" in p.name]


def test_unknown_tiny_name(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="unknown tiny model 'tiny-gpt'"):
        build_tiny_model("tiny-gpt", tmp_path)


@pytest.mark.slow
def test_two_builds_are_byte_identical(tiny_root: Path, tmp_path: Path) -> None:
    """A build in another process (other hash seed, other root) gives the same bytes."""
    proc = _spawn_build(tmp_path, list(TINY_NAMES), hash_seed="12345")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    # a first build inside another command (the chatbot's one-line errors) shows no progress bar
    assert "Writing model shards" not in err, err
    for name in TINY_NAMES:
        for file in BYTE_COMPARED:
            a, b = tiny_root / name / file, tmp_path / name / file
            assert a.read_bytes() == b.read_bytes(), f"{name}/{file} differs between two builds"


@pytest.mark.slow
def test_two_process_race_builds_once(tmp_path: Path) -> None:
    procs = [_spawn_build(tmp_path, ["tiny-llama"], hash_seed=str(seed)) for seed in (1, 2)]
    results = [p.communicate(timeout=300) for p in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err
        assert f"RESULT {tmp_path / 'tiny-llama'}" in out
    builds = sum(err.count("building tiny model tiny-llama") for _, err in results)
    assert builds == 1, [err for _, err in results]
    # One complete folder, no leftovers of a second build.
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {"tiny-llama", ".tiny-llama.lock"}
    assert EXPECTED_FILES <= {p.name for p in (tmp_path / "tiny-llama").iterdir()}
    AutoModelForCausalLM.from_pretrained(tmp_path / "tiny-llama")
    AutoTokenizer.from_pretrained(tmp_path / "tiny-llama")


# ----------------------------------------------------------------------------- resolve_model_path


def test_short_names_listed() -> None:
    assert SHORT_NAMES == ("smollm2-135m", "tiny-llama", "tiny-opt", "tiny-opt-quirk")
    assert registry.TINY_MODEL_NAMES == TINY_NAMES
    assert all(name in short_names_help() for name in SHORT_NAMES)


def test_resolve_tiny_short_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSCHAT_CACHE_DIR", str(tmp_path))
    assert resolve_model_path("tiny-opt-quirk") == str(tmp_path / "tiny" / "tiny-opt-quirk")
    assert (tmp_path / "tiny" / "tiny-opt-quirk" / MARKER_FILE).is_file()


@pytest.mark.parametrize("path", ["/nonexistent/dschat-model", "./no/such/model", "../no-such-model",
                                  "~/no-such-dschat-model-dir"])
def test_resolve_missing_local_path(path: str) -> None:
    with pytest.raises(UserError) as info:
        resolve_model_path(path)
    message = str(info.value)
    assert message.startswith(
        f"model path '{path}' does not exist; pass a Hugging Face model folder, a hub id, or one of:")
    assert "smollm2-135m, tiny-llama, tiny-opt, tiny-opt-quirk" in message


def test_resolve_folder_without_config(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(UserError, match=r"is not a Hugging Face model folder \(no config.json\)"):
        resolve_model_path(str(tmp_path))


def test_resolve_existing_folders_as_is(tiny_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = str(tiny_root / "tiny-opt")
    assert resolve_model_path(folder) == folder
    # A tokenizer-only folder is accepted too (some flags take a tokenizer path).
    (tmp_path / "tokenizer.json").write_text((tiny_root / "tiny-opt" / "tokenizer.json").read_text())
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    # A relative folder is returned exactly as written.
    monkeypatch.chdir(tiny_root)
    assert resolve_model_path("tiny-opt/") == "tiny-opt/"


def test_resolve_offline_hub_id_not_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError) as info:
        resolve_model_path("dschat-test-org/no-such-model-1b")
    message = str(info.value)
    assert "'dschat-test-org/no-such-model-1b' is not a local folder and not in the Hugging Face cache" in message
    assert "offline" in message and "HF_HUB_OFFLINE" in message
    assert "smollm2-135m, tiny-llama, tiny-opt, tiny-opt-quirk" in message


def test_resolve_hub_id_cached_or_online(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    # Offline but cached: returned as is.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache",
                        lambda repo_id, filename, **kw: f"/cache/{repo_id}/{filename}")
    assert resolve_model_path("facebook/opt-1.3b") == "facebook/opt-1.3b"
    # Online: returned as is without consulting the cache (or the network).
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **kw: pytest.fail("cache consulted"))
    assert resolve_model_path("facebook/opt-1.3b") == "facebook/opt-1.3b"


def test_resolve_invalid_hub_id() -> None:
    with pytest.raises(UserError, match="neither an existing folder nor a valid hub id"):
        resolve_model_path("org/name/extra")
    with pytest.raises(UserError, match="empty model path"):
        resolve_model_path("  ")
