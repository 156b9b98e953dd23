"""LoRA adapters in PEFT's format (dschat/models/peft_adapter.py): the export beside every LoRA save
(factors transposed into PEFT's orientation, lora_alpha reproducing dschat's scaling, what else trained),
equality with ``peft.PeftModel`` on tiny OPT and LLaMA models, adapters given back as model paths
(dschat's and peft's own), and the adapters dschat refuses. The step runs (tests/training/test_step1.py,
test_step2.py, test_dpo.py, test_step3_smoke.py) check the same on trained models, under ZeRO-3 too."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForCausalLM

from dschat.errors import UserError
from dschat.models import peft_adapter
from dschat.models.build import create_critic_model, create_hf_model
from dschat.models.lora import convert_linear_layer_to_lora, only_optimize_lora_parameters
from dschat.models.registry import resolve_model_path
from dschat.models.save import save_hf_model
from dschat.models.tokenizer import load_hf_tokenizer

from helpers import PYTHON
from helpers.steps import assert_causal_adapter_matches, run_cli

PROBE = [" Human: Tell me about owls. Assistant: Owls hunt at night.", " Human: Hi Assistant: Hello"]
LORA_MODULES = {"tiny-opt": "decoder.layers.", "tiny-llama": "layers."}


def _lora_model(name: str, only_lora: bool, seed: int = 0, critic: bool = False):
    """A tiny model with LoRA 4 whose trainable parameters (the LoRA factors, and with ``only_lora``
    False everything but the wrapped weights) have moved, as after training."""
    tok = load_hf_tokenizer(name)
    torch.manual_seed(seed)
    model = (create_critic_model(name, tok, None) if critic else create_hf_model(AutoModelForCausalLM, name, tok))
    model = convert_linear_layer_to_lora(model, LORA_MODULES[name], 4)
    if only_lora:
        only_optimize_lora_parameters(model, ["v_head.weight"] if critic else [])
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.05)
    return model.eval(), tok


def _logits(model, tok) -> torch.Tensor:
    batch = tok(PROBE, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**batch).logits


@pytest.mark.parametrize("name,only_lora", [("tiny-opt", False), ("tiny-llama", True)])
def test_export_is_the_merged_model_under_peft_and_round_trips(tmp_path, name, only_lora):
    model, tok = _lora_model(name, only_lora)
    out = save_hf_model(model, tok, tmp_path / "sft")
    folder = out / "lora_adapter"
    config = json.loads((folder / "adapter_config.json").read_text())
    base = resolve_model_path(name)
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["base_model_name_or_path"] == str(Path(base).resolve())
    # dschat's scaling is lora_scaling / r = 1/4; PEFT's is lora_alpha / r.
    assert config["r"] == 4 and config["lora_alpha"] == 1
    projections = {"tiny-opt": {"q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"},
                   "tiny-llama": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}}
    assert set(config["target_modules"]) == projections[name]
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    q = model.get_submodule("model.decoder.layers.0.self_attn.q_proj" if name == "tiny-opt"
                            else "model.layers.0.self_attn.q_proj")
    prefix = "base_model.model.model." + ("decoder.layers.0" if name == "tiny-opt" else "layers.0")
    assert torch.equal(tensors[f"{prefix}.self_attn.q_proj.lora_A.weight"], q.lora_right_weight.t())  # (r, in)
    assert torch.equal(tensors[f"{prefix}.self_attn.q_proj.lora_B.weight"], q.lora_left_weight.t())  # (out, r)
    if only_lora:  # the factors alone: what LoRA servers accept
        assert config["modules_to_save"] is None and config["bias"] == "none"
        assert all(".lora_A." in k or ".lora_B." in k for k in tensors) and len(tensors) == 2 * 7 * 2
    else:  # OPT trained its embeddings (tied to lm_head), norms and the LoRA layers' biases too
        assert set(config["modules_to_save"]) == {"embed_tokens", "embed_positions", "self_attn_layer_norm",
                                                  "final_layer_norm", "lm_head"}
        assert config["bias"] == "lora_only" and config["ensure_weight_tying"] is True
        assert f"{prefix}.self_attn.q_proj.base_layer.bias" in tensors

    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                          str(folder)).eval()
    back = create_hf_model(AutoModelForCausalLM, str(folder), load_hf_tokenizer(str(folder))).eval()
    expected = _logits(merged, tok)
    torch.testing.assert_close(_logits(model, tok), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(_logits(with_peft, tok), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(_logits(back, tok), expected, rtol=0, atol=1e-5)
    # A LoRA trained on the merged adapter names the adapter folder as its base.
    assert back.config._name_or_path == str(folder.resolve())


def test_reward_model_adapter_applies_to_the_body_with_the_value_head_beside(tmp_path):
    critic, tok = _lora_model("tiny-llama", only_lora=False, critic=True)
    out = save_hf_model(critic, tok, tmp_path / "rm")
    folder = out / "lora_adapter"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["task_type"] == "FEATURE_EXTRACTION" and (folder / "v_head.safetensors").is_file()
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    assert "base_model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors  # keys of the body, no "model."
    batch = tok(PROBE, padding=True, return_tensors="pt")

    # The README's recipe: PEFT on the base's body, then the value head at the last token.
    body = PeftModel.from_pretrained(AutoModel.from_pretrained(resolve_model_path("tiny-llama"), dtype=torch.float32),
                                     str(folder)).eval()
    v_head = load_file(str(folder / "v_head.safetensors"))["v_head.weight"]
    real = batch["attention_mask"].bool()  # right padding: the real tokens have the same positions
    with torch.no_grad():
        values = (body(**batch).last_hidden_state @ v_head.T).squeeze(-1)  # (B, T)
        expected = critic.forward_value(**batch, return_value_only=True)
    torch.testing.assert_close(values[real], expected[real], rtol=0, atol=1e-5)
    # dschat loads the pair as a step-3 critic / reward model.
    reloaded = create_critic_model(str(folder), tok, None, rlhf_training=True).eval()
    merged = create_critic_model(str(out), tok, None, rlhf_training=True).eval()
    with torch.no_grad():
        got = reloaded.forward_value(**batch, return_value_only=True)
        want = merged.forward_value(**batch, return_value_only=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got[real], expected[real], rtol=0, atol=1e-5)


def test_a_step1_adapter_starts_a_reward_model_body(tmp_path):
    """Step 2 from step 1's adapter: the causal LM's LoRA (and trained modules) land in the AutoModel body
    (``model.`` dropped from the keys, ``lm_head`` left out, as AutoModel drops it from the merged folder)."""
    model, tok = _lora_model("tiny-opt", only_lora=False)
    out = save_hf_model(model, tok, tmp_path / "sft")
    critic = create_critic_model(str(out / "lora_adapter"), tok, None).eval()
    body = AutoModel.from_pretrained(out, dtype=torch.float32).eval()
    batch = tok(PROBE, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = body(**batch).last_hidden_state
        got = critic.rwtransformer(**batch).last_hidden_state
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_a_peft_made_adapter_merges_as_peft_merges_it(tmp_path):
    """An adapter peft wrote (rsLoRA, an alpha pattern, no tokenizer files) loads as PEFT's merge_and_unload."""
    base = resolve_model_path("tiny-opt")
    config = LoraConfig(r=8, lora_alpha=16, use_rslora=True, alpha_pattern={"fc1": 4}, init_lora_weights=False,
                        target_modules=["q_proj", "v_proj", "fc1"], task_type="CAUSAL_LM")
    torch.manual_seed(3)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), config)
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    tok = load_hf_tokenizer(str(tmp_path / "adapter"))  # from the base: the folder has no tokenizer
    expected = _logits(peft_model.eval().merge_and_unload(), tok)
    got = create_hf_model(AutoModelForCausalLM, str(tmp_path / "adapter"), tok).eval()
    torch.testing.assert_close(_logits(got, tok), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("r", [1, 3, 4, 49, 128])
@pytest.mark.parametrize("lora_scaling", [1, 2, 0.3, 16])
def test_lora_alpha_gives_dschat_scaling_back_exactly(r, lora_scaling):
    scaling = lora_scaling / r  # LinearLayer_LoRA.lora_scaling, upstream's formula
    alpha = peft_adapter._lora_alpha(scaling, r)
    assert alpha == lora_scaling and alpha / r == scaling  # PEFT's scaling, bit for bit


def test_a_save_without_lora_removes_a_stale_adapter_and_a_failed_write_keeps_the_old_folder(tmp_path, monkeypatch):
    model, tok = _lora_model("tiny-opt", only_lora=True)
    out = save_hf_model(model, tok, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in (out / "lora_adapter").iterdir()}

    import dschat.models.save

    def broken(export, folder, tokenizer=None):
        Path(folder).mkdir()
        (Path(folder) / "adapter_config.json").write_text("{")
        raise OSError("simulated crash while writing the adapter")

    monkeypatch.setattr(dschat.models.save, "write_lora_adapter", broken)
    with pytest.raises(OSError, match="simulated crash"):
        save_hf_model(model, tok, out)
    assert {p.name: p.read_bytes() for p in (out / "lora_adapter").iterdir()} == before  # atomic
    monkeypatch.undo()

    plain = create_hf_model(AutoModelForCausalLM, "tiny-opt", tok)
    save_hf_model(plain, tok, out)
    assert not (out / "lora_adapter").exists()


def _adapter_folder(tmp_path: Path, **config) -> Path:
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                            "base_model_name_or_path": "tiny-opt", **config}))
    save_file({"base_model.model.model.decoder.layers.0.fc1.lora_A.weight": torch.zeros(4, 64),
               "base_model.model.model.decoder.layers.0.fc1.lora_B.weight": torch.zeros(128, 4)},
              str(folder / "adapter_model.safetensors"))
    return folder


@pytest.mark.parametrize("config,message", [
    ({"peft_type": "IA3"}, "is a PEFT IA3 adapter; dschat loads LoRA adapters only"),
    ({"use_dora": True}, "LoRA variant dschat does not merge (DoRA"),
    ({"base_model_name_or_path": "nobody-dschat/no-such-model"},
     "LoRA adapter of base model 'nobody-dschat/no-such-model', which cannot be loaded here"),
    ({"base_model_name_or_path": None}, "names no base model"),
])
def test_adapters_dschat_cannot_load_are_one_line_errors(tmp_path, config, message):
    folder = _adapter_folder(tmp_path, **config)
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        resolve_model_path(str(folder))


def test_adapter_tensors_must_fit_the_base(tmp_path):
    folder = _adapter_folder(tmp_path)
    save_file({"base_model.model.model.decoder.layers.0.fc1.lora_A.weight": torch.zeros(4, 64),
               "base_model.model.model.decoder.layers.0.fc1.lora_B.weight": torch.zeros(64, 4)},
              str(folder / "adapter_model.safetensors"))
    tok = load_hf_tokenizer("tiny-opt")
    with pytest.raises(UserError, match=r"do not fit its weight \(128, 64\)"):
        create_hf_model(AutoModelForCausalLM, str(folder), tok)
    (folder / "adapter_model.safetensors").unlink()
    (folder / "adapter_model.bin").write_bytes(b"not read")
    with pytest.raises(UserError, match="does not unpickle"):
        resolve_model_path(str(folder))


TWO_RANK_SCRIPT = """
import sys, torch, deepspeed
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from dschat.models.build import create_hf_model
from dschat.models.lora import convert_linear_layer_to_lora
from dschat.models.save import save_hf_model
from dschat.models.tokenizer import load_hf_tokenizer
from dschat.runtime.dist import init_distributed
from dschat.runtime.ds_config import get_eval_ds_config
adapter, out = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
info = init_distributed()
tokenizer = load_hf_tokenizer(adapter)
ds_config = get_eval_ds_config(False, "fp32", 3, micro_batch_size=2)
ds_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition even tiny weights
model = create_hf_model(AutoModelForCausalLM, adapter, tokenizer, ds_config)  # merged into partitioned weights
assert model.model.decoder.layers[0].fc1.weight.numel() == 0
torch.manual_seed(1)  # the same new LoRA on both ranks
model = convert_linear_layer_to_lora(model, "decoder.layers.", 4)
with torch.no_grad():
    for module in model.modules():
        if hasattr(module, "lora_left_weight"):
            module.lora_left_weight.normal_(std=0.05)
engine, *_ = deepspeed.initialize(model=model, config=ds_config)
engine.eval()
with torch.no_grad():
    logits = engine(**tokenizer(%r, return_tensors="pt", padding=True)).logits
save_hf_model(engine, tokenizer, out + "/saved")  # factors gathered from both ranks
save_file({"logits": logits.contiguous()}, f"{out}/rank{info.rank}.safetensors")
""" % (PROBE,)


@pytest.mark.slow
def test_two_zero3_ranks_merge_an_adapter_and_export_one(tmp_path):
    """Two ZeRO-3 ranks: an adapter merged into partitioned weights (rank 0 writes, both see it), and a
    LoRA on top exported from factors partitioned over both ranks."""
    import shutil


    model, tok = _lora_model("tiny-opt", only_lora=False)
    adapter = save_hf_model(model, tok, tmp_path / "in") / "lora_adapter"
    script = tmp_path / "adapter_ranks.py"
    script.write_text(TWO_RANK_SCRIPT)
    deepspeed_cli = shutil.which("deepspeed") or str(Path(PYTHON).with_name("deepspeed"))
    proc = run_cli([deepspeed_cli, "--num_gpus", "2", str(script), str(adapter), str(tmp_path)], cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    rank0, rank1 = (load_file(str(tmp_path / f"rank{r}.safetensors"))["logits"] for r in (0, 1))
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32).eval()
    expected = _logits(saved, tok)
    torch.testing.assert_close(rank0, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(rank1, expected, rtol=0, atol=1e-5)
    assert_causal_adapter_matches(tmp_path / "saved", adapter)  # its base: the adapter it started from
