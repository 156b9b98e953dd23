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

from helpers.steps import assert_causal_adapter_matches, deepspeed_cmd, run_cli

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
    model, tok = _lora_model("tiny-opt", only_lora=False)
    adapter = save_hf_model(model, tok, tmp_path / "in") / "lora_adapter"
    script = tmp_path / "adapter_ranks.py"
    script.write_text(TWO_RANK_SCRIPT)
    proc = run_cli(deepspeed_cmd(str(script), str(adapter), str(tmp_path)), cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    rank0, rank1 = (load_file(str(tmp_path / f"rank{r}.safetensors"))["logits"] for r in (0, 1))
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32).eval()
    expected = _logits(saved, tok)
    torch.testing.assert_close(rank0, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(rank1, expected, rtol=0, atol=1e-5)
    assert_causal_adapter_matches(tmp_path / "saved", adapter)  # its base: the adapter it started from


# ------------------------------------------------------------------ untrusted adapter folders
@pytest.mark.parametrize("config,message", [
    ({"lora_alpha": "16"}, "lora_alpha is '16', not a finite number"),
    ({"lora_alpha": None}, "lora_alpha is None, not a finite number"),
    ({"r": "4"}, "r is '4', not a positive integer"),
    ({"r": 0}, "r is 0, not a positive integer"),
    ({"r": True}, "r is True, not a positive integer"),
    ({"alpha_pattern": [["fc1", 4]]}, "alpha_pattern is a list, not an object of module pattern"),
    ({"alpha_pattern": {"fc1": [4]}}, r"alpha_pattern\['fc1'\] is \[4\], not one of finite numbers"),
    ({"alpha_pattern": {"fc1": "4"}}, r"alpha_pattern\['fc1'\] is '4'"),
    ({"rank_pattern": {"fc1": 2.5}}, r"rank_pattern\['fc1'\] is 2.5, not one of positive integers"),
    ({"fan_in_fan_out": "yes"}, "fan_in_fan_out is 'yes', not true or false"),
    ({"target_modules": [1, 2]}, r"target_modules is \[1, 2\], not a list of module names"),
    # Patterns whose matching time can explode, or that do not compile:
    ({"target_modules": "(a+)+$"}, r"target_modules pattern '\(a\+\)\+\$' is refused \(a repetition inside a rep"),
    ({"alpha_pattern": {"(fc|fc1)*": 2}}, r"alpha_pattern pattern '\(fc\|fc1\)\*' is refused \(a repetition over an alternation\)"),
    ({"alpha_pattern": {".*.*.*.*fc1": 2}}, r"alpha_pattern pattern .* is refused \(4 repetitions \(at most 3\)\)"),
    ({"rank_pattern": {"x" * 300: 4}}, r"rank_pattern pattern 'xxx.* is refused \(300 characters \(at most 200\)\)"),
    ({"rank_pattern": {"(fc)\\1": 4}}, r"rank_pattern pattern .* is refused \(a back-reference\)"),
    ({"alpha_pattern": {"[fc1": 2}}, r"alpha_pattern pattern .* is refused \(unterminated character set"),
])
def test_adapter_config_is_type_checked_and_its_patterns_bounded(tmp_path, config, message):
    folder = _adapter_folder(tmp_path, **config)
    with pytest.raises(UserError, match=f"adapter_config.json: {message}") as err:
        resolve_model_path(str(folder))  # the start-up path check: before any model loads
    assert "\n" not in str(err.value) and str(err.value).endswith(peft_adapter.FIX_ADAPTER_CONFIG)


def test_usual_patterns_pass_and_rank_pattern_sets_the_rank_checked_against_the_tensors(tmp_path):
    tok = load_hf_tokenizer("tiny-opt")
    folder = _adapter_folder(tmp_path, r=8, rank_pattern={r"layers\.\d+\.fc1": 4},
                             target_modules=r".*decoder\.layers\.\d+\.(fc1|self_attn\.(q|v)_proj)$",
                             alpha_pattern={"fc1": 2})
    create_hf_model(AutoModelForCausalLM, str(folder), tok)  # factors of rank 4, as rank_pattern says
    # A pattern naming the layer by its full causal-LM path also holds in a reward model's body, where the
    # layer is decoder.layers.0.fc1: the adapter's own key names it too.
    _edit_config(folder, rank_pattern={"model.decoder.layers.0.fc1": 4}, alpha_pattern={"model.decoder.layers.0.fc1": 2})
    create_critic_model(str(folder), tok, None)
    _edit_config(folder, rank_pattern={})
    with pytest.raises(UserError, match=r"adapter_model.safetensors holds LoRA factors of model.decoder.layers.0.fc1 "
                                        r"of rank 4 \(A \(4, 64\), B \(128, 4\)\) but adapter_config.json gives it "
                                        r"r = 8 \(r, rank_pattern\); correct it in adapter_config.json"):
        create_hf_model(AutoModelForCausalLM, str(folder), tok)


_FC1 = "base_model.model.model.decoder.layers.0.fc1"


@pytest.mark.parametrize("tensors,message", [
    ({f"{_FC1}.lora_A.weight": torch.zeros(64), f"{_FC1}.lora_B.weight": torch.zeros(128)},
     r"holds LoRA factors of model.decoder.layers.0.fc1 shaped A \(64,\), B \(128,\): a LoRA factor is a matrix"),
    ({f"{_FC1}.lora_A.weight": torch.zeros(0, 64), f"{_FC1}.lora_B.weight": torch.zeros(128, 0)},
     r"holds LoRA factors of .*fc1 shaped A \(0, 64\), B \(128, 0\): a LoRA factor is a matrix of rank >= 1"),
    ({f"{_FC1}.lora_A.weight": torch.full((4, 64), float("nan")), f"{_FC1}.lora_B.weight": torch.zeros(128, 4)},
     r"holds NaN or infinite values in '.*fc1.lora_A.weight': the adapter is damaged; train or export it again"),
    ({f"{_FC1}.lora_A.weight": torch.zeros(4, 64), f"{_FC1}.lora_B.weight": torch.full((128, 4), float("inf"))},
     "holds NaN or infinite values in '.*fc1.lora_B.weight'"),
    ({f"{_FC1}.lora_A.weight": torch.zeros(4, 64), f"{_FC1}.lora_B.weight": torch.zeros(128, 4),
      "base_model.model.model.decoder.layers.0.fc1.base_layer.bias": torch.full((128,), float("nan"))},
     "holds NaN or infinite values in '.*fc1.base_layer.bias'"),
    ({f"{_FC1}.lora_A.weight": torch.zeros(4, 64, dtype=torch.int64), f"{_FC1}.lora_B.weight": torch.zeros(128, 4)},
     "holds torch.int64 values in '.*fc1.lora_A.weight'"),
])
def test_adapter_tensors_are_refused_in_one_line_naming_the_file(tmp_path, tensors, message):
    folder = _adapter_folder(tmp_path)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    tok = load_hf_tokenizer("tiny-opt")
    with pytest.raises(UserError, match=f"{folder / 'adapter_model.safetensors'} {message}"):
        create_hf_model(AutoModelForCausalLM, str(folder), tok)


def test_a_corrupt_safetensors_file_is_one_line(tmp_path):
    folder = _adapter_folder(tmp_path)
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:40])  # cut short, as by a full disk or a broken copy
    with pytest.raises(UserError, match=f"cannot read {weights} \\(SafetensorError: .*\\): the file is damaged or "
                                        "not safetensors; copy or export the adapter again"):
        create_hf_model(AutoModelForCausalLM, str(folder), load_hf_tokenizer("tiny-opt"))


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(config))


def test_fan_in_fan_out_comes_from_the_layer_type_as_peft_decides_it(tmp_path):
    """nn.Linear: False whatever the config says (OPT's square q_proj would merge transposed), with PEFT's
    warning; the merged model is PEFT's own merge of the same folder."""
    base = resolve_model_path("tiny-opt")
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "v_proj"],
                        task_type="CAUSAL_LM")
    torch.manual_seed(5)
    get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), config).save_pretrained(
        str(tmp_path / "adapter"))
    _edit_config(tmp_path / "adapter", fan_in_fan_out=True)
    tok = load_hf_tokenizer(str(tmp_path / "adapter"))
    with pytest.warns(UserWarning, match="fan_in_fan_out is set to True but the target module"):
        peft_merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                                str(tmp_path / "adapter")).merge_and_unload()
    with pytest.warns(UserWarning, match=r"adapter_config.json: fan_in_fan_out is set to True but the target module "
                                         r"model.decoder.layers.0.self_attn.q_proj is `torch.nn.Linear`"):
        got = create_hf_model(AutoModelForCausalLM, str(tmp_path / "adapter"), tok).eval()
    torch.testing.assert_close(_logits(got, tok), _logits(peft_merged.eval(), tok), rtol=0, atol=1e-5)


def test_conv1d_layers_merge_with_fan_in_fan_out_whatever_the_config_says(tmp_path):
    """GPT-2's Conv1D keeps its weight (in, out): fan_in_fan_out is True there, as PEFT sets it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    GPT2LMHeadModel(gpt2).save_pretrained(str(tmp_path / "base"))
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["c_attn", "c_proj"],
                        fan_in_fan_out=True)
    torch.manual_seed(6)
    get_peft_model(GPT2LMHeadModel.from_pretrained(str(tmp_path / "base")), config).save_pretrained(
        str(tmp_path / "adapter"))
    _edit_config(tmp_path / "adapter", fan_in_fan_out=False)
    with pytest.warns(UserWarning, match="fan_in_fan_out is set to False but the target module is `Conv1D`"):
        expected = PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(str(tmp_path / "base")),
                                             str(tmp_path / "adapter")).merge_and_unload().state_dict()
    model = GPT2LMHeadModel.from_pretrained(str(tmp_path / "base"))
    with pytest.warns(UserWarning, match="fan_in_fan_out is set to False but the target module .* is Conv1D"):
        peft_adapter.merge_lora_adapter(model, peft_adapter.read_adapter(tmp_path / "adapter"))
    got = model.state_dict()
    changed = [k for k in expected if not torch.equal(expected[k], GPT2LMHeadModel.from_pretrained(
        str(tmp_path / "base")).state_dict()[k])]
    assert any("c_proj" in k for k in changed) and any("c_attn" in k for k in changed)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-6)


# ------------------------------------------------------------------ tied embeddings (tie_word_embeddings)
@pytest.mark.parametrize("name,modules_to_save,targets", [
    ("tiny-opt", ["lm_head"], ["q_proj", "v_proj"]),  # lm_head replaced: the embeddings stay the base's
    ("tiny-opt", ["lm_head", "embed_tokens"], ["q_proj"]),  # both replaced, each by its own tensor
    ("tiny-opt", None, ["q_proj", "lm_head"]),  # LoRA on lm_head (PEFT saves its base weight too), not the embeddings
    ("tiny-llama", None, ["q_proj", "lm_head"]),  # untied: the saved base weight is what the factors add to
], ids=["lm_head-saved", "both-saved", "lora-on-lm_head", "lora-on-untied-lm_head"])
def test_an_adapter_changing_a_tied_lm_head_unties_it_as_peft_applies_it(tmp_path, name, modules_to_save, targets):
    """OPT ties lm_head to the input embeddings. PeftModel changes only the modules the adapter names, so
    dschat unties the two before merging (not PEFT's merge_and_unload, which merges LoRA on a tied lm_head
    into the embeddings too), and the merged model saves and reloads untied."""
    base = resolve_model_path(name)
    tok = load_hf_tokenizer(name)
    torch.manual_seed(7)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, modules_to_save=modules_to_save, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for param in peft_model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.05)
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    expected = _logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                                 str(tmp_path / "adapter")).eval(), tok)
    got = create_hf_model(AutoModelForCausalLM, str(tmp_path / "adapter"), tok).eval()
    torch.testing.assert_close(_logits(got, tok), expected, rtol=0, atol=1e-5)
    assert got.lm_head.weight is not got.get_input_embeddings().weight and not got.config.tie_word_embeddings
    saved = save_hf_model(got, tok, tmp_path / "merged")
    reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    assert reloaded.lm_head.weight is not reloaded.get_input_embeddings().weight
    torch.testing.assert_close(_logits(reloaded, tok), expected, rtol=0, atol=1e-5)


def test_a_tied_weight_under_zero3_is_refused_before_anything_changes(tmp_path, monkeypatch):
    """Untying copies the shared weight, which dschat does not do for a ZeRO-3 partitioned one: one line."""
    base = resolve_model_path("tiny-opt")
    torch.manual_seed(8)
    get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), LoraConfig(
        r=4, target_modules=["q_proj"], modules_to_save=["lm_head"], task_type="CAUSAL_LM")).save_pretrained(
        str(tmp_path / "adapter"))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr("dschat.models.lora.is_zero3_param", lambda param: True)
    with pytest.raises(UserError, match=r"adapter changes model\.decoder\.embed_tokens and lm_head, which share one "
                                        r"weight; dschat unties them only without ZeRO-3: load it with a ZeRO stage"):
        peft_adapter.merge_lora_adapter(model, peft_adapter.read_adapter(tmp_path / "adapter"))
    assert model.lm_head.weight is model.get_input_embeddings().weight and model.config.tie_word_embeddings
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _readme_code(folder: Path) -> str:
    """The python block of the README.md written into the adapter ``folder``, pointing at it."""
    text = (folder / "README.md").read_text(encoding="utf-8")
    return text.split("```python\n", 1)[1].split("```", 1)[0].replace("path/to/lora_adapter", str(folder))


@pytest.mark.parametrize("only_lora", [False, True])
def test_the_readme_loads_an_adapter_of_a_run_that_grew_the_vocabulary(tmp_path, only_lora):
    """--add_eot_token grows the embeddings (1000 -> 1008 rows): the README's base + PeftModel failed on
    the saved embeddings' size. It now resizes the base first, and gives the merged model's logits; an
    adapter without the embeddings (--only_optimize_lora) lacks the new rows, and its README says so."""
    tok = load_hf_tokenizer("tiny-llama", add_special_tokens="<|endoftext|>")
    torch.manual_seed(0)
    model = convert_linear_layer_to_lora(create_hf_model(AutoModelForCausalLM, "tiny-llama", tok),
                                         LORA_MODULES["tiny-llama"], 4)
    if only_lora:
        only_optimize_lora_parameters(model, [])
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.05)
    out = save_hf_model(model.eval(), tok, tmp_path / "sft")
    folder = out / "lora_adapter"
    rows = model.get_input_embeddings().weight.shape[0]
    assert rows > AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-llama")).config.vocab_size
    code = _readme_code(folder)
    assert f"base.resize_token_embeddings({rows})" in code
    scope: dict = {}
    exec(compile(code, str(folder / "README.md"), "exec"), scope)  # noqa: S102 -- the README's own code
    expected = _logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval(), tok)
    got = _logits(scope["model"].float().eval(), tok)
    if only_lora:
        assert "base + adapter is not the trained model; load the merged model in `..`" in code
        torch.testing.assert_close(got[..., :1000], expected[..., :1000], rtol=0, atol=1e-5)  # the base's rows
    else:
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_the_readme_of_a_critic_over_an_upstream_step2_folder_loads_it_with_dschat(tmp_path):
    """A base in upstream's step-2 layout (pytorch_model.bin, rwtransformer.* keys) is not read by
    AutoModel, which drew the body at random under the README's code: it points at dschat's loader."""
    from dschat.models.adapter_card import adapter_card

    base = tmp_path / "upstream_step2"
    base.mkdir()
    torch.save({"rwtransformer.embed_tokens.weight": torch.zeros(4, 2), "v_head.weight": torch.zeros(1, 2)},
               base / "pytorch_model.bin")
    settings = {"modules_to_save": None, "bias": "none", "base_model_name_or_path": str(base), "r": 4,
                "lora_alpha": 1, "target_modules": ["q_proj"]}
    card = adapter_card(peft_adapter.AdapterExport(settings, {}, torch.zeros(1, 2)))
    assert "AutoModel.from_pretrained" not in card
    assert 'critic = create_critic_model("path/to/lora_adapter", tokenizer, None, rlhf_training=True)' in card
    (base / "model.safetensors").write_bytes(b"")  # dschat's --save_format both: AutoModel reads this one
    assert "AutoModel.from_pretrained" in adapter_card(peft_adapter.AdapterExport(settings, {}, torch.zeros(1, 2)))


@pytest.mark.parametrize("saved", [True, False])
def test_the_readme_of_a_hub_base_resizes_it_when_it_loads_with_fewer_rows(saved):
    """A hub id's config is not read at save time: the README's code checks the base it loaded."""
    from dschat.models.adapter_card import adapter_card

    settings = {"modules_to_save": ["embed_tokens", "lm_head"] if saved else None, "bias": "none",
                "base_model_name_or_path": "org/some-model", "r": 4, "lora_alpha": 1, "target_modules": ["q_proj"]}
    tensors = {"base_model.model.model.embed_tokens.modules_to_save.default.weight": torch.zeros(2, 2)} if saved else {}
    card = adapter_card(peft_adapter.AdapterExport(settings, tensors, None, 32008))
    code = card.split("```python\n", 1)[1].split("```", 1)[0]
    assert ("if base.get_input_embeddings().weight.shape[0] != 32008:  # the run resized the embeddings\n"
            "    base.resize_token_embeddings(32008)\n") in code
    assert ("this adapter lacks the new rows" in code) is (not saved)
    compile(code, "README.md", "exec")  # valid Python


def test_the_readme_of_a_table_cut_to_the_tokenizer_resizes_without_saying_rows_are_missing(tmp_path):
    """Step 3 may cut a larger table to its tokenizer's length (rounded up to 8): base + adapter, cut
    alike, is the trained model, so an adapter without embeddings lacks nothing."""
    from dschat.models.adapter_card import adapter_card

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 151936}))
    settings = {"modules_to_save": None, "bias": "none", "base_model_name_or_path": str(base), "r": 4,
                "lora_alpha": 1, "target_modules": ["q_proj"]}
    card = adapter_card(peft_adapter.AdapterExport(settings, {}, None, 151672))
    assert "base.resize_token_embeddings(151672)  # the run resized the embeddings: 151936 -> 151672 rows" in card
    assert "not the trained model" not in card and "grew" not in card
