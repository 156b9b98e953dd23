"""Model builders, the reward model's end scores, and saving as real Hugging Face folders."""
import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from dschat.errors import UserError
from dschat.models.save import gathered_state_dict, save_hf_model
from dschat.models.tiny import build_tiny_model
from dschat.models.tokenizer import load_hf_tokenizer
from dschat.models.build import (
    configure_dropout,
    create_critic_model,
    create_hf_model,
    padded_vocab_size,
    resize_vocab,
)
from dschat.models.reward_model import RewardModel, last_token_index, positions_from_mask


@pytest.mark.parametrize(
    "config_vocab, tokenizer_len, expected",
    [
        (1000, 1000, 1000),  # already a multiple of 8
        (1000, 1001, 1008),  # one added token -> next multiple of 8
        (32000, 32001, 32008),  # LLaMA-2 + [PAD], as upstream
        (50272, 50265, 50272),  # OPT: checkpoint bigger than tokenizer, kept
        (151936, 151665, 151936),  # never shrink below the checkpoint (upstream would)
        (49155, 49152, 49160),  # checkpoint size not a multiple of 8 -> rounded up
    ],
)
def test_padded_vocab_size(config_vocab, tokenizer_len, expected):
    assert padded_vocab_size(config_vocab, tokenizer_len) == expected


def test_configure_dropout_sets_every_key_the_config_has():
    from transformers import OPTConfig

    cfg = OPTConfig()
    assert (cfg.dropout, cfg.attention_dropout) == (0.1, 0.0)
    configure_dropout(cfg, 0.3)
    assert (cfg.dropout, cfg.attention_dropout) == (0.3, 0.3)
    assert not hasattr(cfg, "hidden_dropout")  # keys the config lacks are not invented
    cfg2 = OPTConfig()
    configure_dropout(cfg2, None)
    assert cfg2.dropout == 0.1


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-opt", "tiny-opt-quirk"])
def test_create_hf_model_pad_and_vocab(name):
    tok = load_hf_tokenizer(name)
    tok.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})  # 1001 tokens
    model = create_hf_model(AutoModelForCausalLM, name, tok)
    assert model.get_input_embeddings().weight.shape[0] == 1008
    assert model.config.pad_token_id == tok.pad_token_id
    assert model.config.end_token_id == tok.eos_token_id
    assert tok.padding_side == "right"


def test_a_resize_leaves_the_random_state_and_a_zero3_weight_of_the_same_rows_is_not_resized(monkeypatch):
    """transformers draws a fresh embedding's init for a resize (under ZeRO-3 even for the same size):
    the dropout masks and LoRA factors of one --seed then differed between ZeRO 0 and ZeRO 3."""
    model = create_hf_model(AutoModelForCausalLM, "tiny-opt", load_hf_tokenizer("tiny-opt"))
    weight = model.get_input_embeddings().weight
    rows, hidden = weight.shape
    state = torch.get_rng_state()
    resize_vocab(model, rows + 8)
    assert model.get_input_embeddings().weight.shape[0] == rows + 8
    assert torch.equal(torch.get_rng_state(), state)
    # A ZeRO-3 weight: partitioned away (local shape 0), its full shape in ds_shape.
    weight = model.get_input_embeddings().weight
    weight.data, weight.ds_shape = torch.empty(0), torch.Size([rows + 8, hidden])
    monkeypatch.setattr(model, "resize_token_embeddings", lambda n: pytest.fail(f"resized to {n}"))
    resize_vocab(model, rows + 8)


def _reward_model(name, seed=0):
    torch.manual_seed(seed)
    tok = load_hf_tokenizer(name)
    return create_critic_model(name, tok, None, num_padding_at_beginning=1), tok


def test_reward_end_scores_use_last_real_token_even_when_eos_is_pad():
    # tiny-opt-quirk: pad == eos == bos == 2. Rows are right-padded pairs [chosen; rejected].
    rm, tok = _reward_model("tiny-opt-quirk")
    rm.eval()
    pad = tok.pad_token_id
    assert pad == tok.eos_token_id == tok.bos_token_id
    ids = torch.tensor(
        [
            [pad, 10, 11, 12, pad, pad, pad],  # chosen 0: BOS, 3 tokens, EOS (==pad), padding
            [pad, 10, 11, pad, pad, pad, pad],  # chosen 1: BOS, 2 tokens, EOS, padding
            [pad, 10, 13, pad, pad, pad, pad],  # rejected 0
            [pad, 10, 11, 14, 15, pad, pad],  # rejected 1
        ]
    )
    mask = torch.tensor(
        [
            [1, 1, 1, 1, 1, 0, 0],  # EOS at index 4 is real
            [1, 1, 1, 1, 0, 0, 0],  # EOS at index 3
            [1, 1, 1, 1, 0, 0, 0],  # EOS at index 3
            [1, 1, 1, 1, 1, 1, 0],  # EOS at index 5
        ]
    )
    with torch.no_grad():
        values = rm.forward_value(ids, attention_mask=mask, return_value_only=True)
        out = rm(input_ids=ids, attention_mask=mask)
    # The scored token is the EOS: indices 4, 3 (chosen) and 3, 5 (rejected).
    assert torch.equal(out["chosen_mean_scores"], values[[0, 1], [4, 3]])
    assert torch.equal(out["rejected_mean_scores"], values[[2, 3], [3, 5]])
    # Without a mask, upstream's rule with num_padding_at_beginning=1 (BOS skipped) stops at the
    # first pad after the text -- the EOS -- and scores the token before it: indices 3, 2 / 2, 4.
    with torch.no_grad():
        out_upstream = rm(input_ids=ids)
    assert torch.equal(out_upstream["chosen_mean_scores"], values[[0, 1], [3, 2]])
    assert torch.equal(out_upstream["rejected_mean_scores"], values[[2, 3], [2, 4]])
    # forward_value end score: last real token after the prompt.
    with torch.no_grad():
        fv = rm.forward_value(ids, attention_mask=mask, prompt_length=2)
    assert torch.equal(fv["chosen_end_scores"], values[[0, 1, 2, 3], [4, 3, 3, 5]])
    # Without a mask, upstream's rule: the token before the first pad after the prompt (the EOS is
    # that pad), so indices 3, 2, 2, 4.
    with torch.no_grad():
        unmasked = rm.forward_value(ids, return_value_only=True)
        fv = rm.forward_value(ids, prompt_length=2)
    assert torch.equal(fv["chosen_end_scores"], unmasked[[0, 1, 2, 3], [3, 2, 2, 4]])


def test_value_head_takes_the_body_dtype():
    # A body built under ZeRO-3 is already bf16/fp16 and DeepSpeed will not cast the head: its ZeRO-3
    # optimizer asserted on the mixed dtypes (seen on a GPU).
    body = AutoModel.from_pretrained(build_tiny_model("tiny-llama"), dtype=torch.bfloat16)
    rm = RewardModel(body, load_hf_tokenizer("tiny-llama"))
    assert rm.v_head.weight.dtype == torch.bfloat16


def test_positions_from_left_padded_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert positions_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]
    assert last_token_index(mask).tolist() == [4, 3]


def test_reward_values_ignore_left_padding_for_llama():
    # Position ids from the mask make a left-padded row score like the unpadded row.
    rm, tok = _reward_model("tiny-llama")
    rm.eval()
    pad = tok.pad_token_id
    row = torch.tensor([[tok.bos_token_id, 20, 21, 22]])
    padded = torch.tensor([[pad, pad, tok.bos_token_id, 20, 21, 22]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    with torch.no_grad():
        plain = rm.forward_value(row, attention_mask=torch.ones_like(row), return_value_only=True)
        left = rm.forward_value(padded, attention_mask=mask, return_value_only=True)
    torch.testing.assert_close(left[:, 2:], plain, rtol=1e-4, atol=1e-5)


def test_saved_causal_lm_reloads_with_identical_logits(tmp_path):
    from transformers import pipeline

    tok = load_hf_tokenizer("tiny-llama")
    model = create_hf_model(AutoModelForCausalLM, "tiny-llama", tok).eval()
    out = save_hf_model(model, tok, tmp_path / "actor")
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = tok(" Human: Tell me about owls. Assistant:", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)
    assert AutoTokenizer.from_pretrained(out)(" owls").input_ids == tok(" owls").input_ids
    gen = pipeline("text-generation", model=str(out), device="cpu")
    assert isinstance(gen("Owls", max_new_tokens=3, do_sample=False)[0]["generated_text"], str)


def test_a_tied_lm_head_is_written_once_and_upstreams_bin_keeps_both_keys(tmp_path):
    """A tied lm_head (OPT, SmolLM2, Qwen, Gemma) was copied apart from the embeddings and written as a
    second full matrix (+21% on SmolLM2-135M); the folder still reloads with the same logits."""
    from safetensors import safe_open

    tok = load_hf_tokenizer("tiny-opt")
    model = create_hf_model(AutoModelForCausalLM, "tiny-opt", tok).eval()
    assert model.lm_head.weight is model.model.decoder.embed_tokens.weight
    state = gathered_state_dict(model)
    assert state["lm_head.weight"] is state["model.decoder.embed_tokens.weight"]  # one copy, both keys
    out = save_hf_model(model, tok, tmp_path / "actor", save_format="both")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.decoder.embed_tokens.weight" in f.keys()
    upstream = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert torch.equal(upstream["lm_head.weight"], upstream["model.decoder.embed_tokens.weight"])
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = tok(" Human: Tell me about owls. Assistant:", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)


def test_saved_tokenizer_json_keeps_no_truncation_from_tokenizing_the_data(tmp_path):
    """Building the data cache calls the tokenizer with ``max_length`` and ``truncation=True``, which
    stays set on the fast tokenizer's backend: the saved tokenizer.json (the model's and its LoRA
    adapter's) must not carry it, or a ``tokenizers`` reader cuts every text at that length."""
    from tokenizers import Tokenizer

    from dschat.models.lora import convert_linear_layer_to_lora

    tok = load_hf_tokenizer("tiny-opt")
    model = convert_linear_layer_to_lora(create_hf_model(AutoModelForCausalLM, "tiny-opt", tok), "decoder.layers.", 2)
    tok(["owls " * 50], max_length=8, truncation=True, padding="max_length")
    assert tok.backend_tokenizer.truncation is not None  # what the data cache's tokenisation leaves
    out = save_hf_model(model, tok, tmp_path / "actor")
    text = "owls " * 50
    for folder in (out, out / "lora_adapter"):
        saved = Tokenizer.from_file(str(folder / "tokenizer.json"))
        assert saved.truncation is None and saved.padding is None
        assert saved.encode(text).ids == tok(text).input_ids
    assert tok(text, max_length=8, truncation=True).input_ids == tok(text).input_ids[:8]  # still truncates on call


def test_lora_is_fused_into_the_saved_weights(tmp_path):
    from dschat.models.lora import convert_linear_layer_to_lora

    tok = load_hf_tokenizer("tiny-opt")
    model = create_hf_model(AutoModelForCausalLM, "tiny-opt", tok)
    model = convert_linear_layer_to_lora(model, "decoder.layers.", 4).eval()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "lora_left_weight"):
                m.lora_left_weight.normal_(std=0.5)  # make the LoRA branch matter
    state = gathered_state_dict(model)
    assert not any("lora" in k for k in state)
    out = save_hf_model(model, tok, tmp_path / "actor")
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = tok(" Human: Tell me about owls. Assistant:", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reloaded(ids).logits, rtol=1e-4, atol=1e-4)
    # The live model still has its LoRA factors unfused (saving must not disturb training).
    assert all(not getattr(m, "fuse_lora", False) for m in model.modules() if hasattr(m, "lora_left_weight"))


def test_reward_model_round_trip_and_strict_loading(tmp_path):
    rm, tok = _reward_model("tiny-llama", seed=1)
    with torch.no_grad():
        rm.v_head.weight.normal_()
    rm.eval()
    out = save_hf_model(rm, tok, tmp_path / "critic")
    assert (out / "v_head.safetensors").exists()
    # The body is a plain HF base model.
    AutoModel.from_pretrained(out)
    loaded = create_critic_model(str(out), tok, None, rlhf_training=True).eval()
    ids = tok([" Human: hi Assistant: hello", " Human: hi Assistant: bye"], return_tensors="pt", padding=True)
    with torch.no_grad():
        a = rm.forward_value(ids.input_ids, attention_mask=ids.attention_mask, return_value_only=True)
        b = loaded.forward_value(ids.input_ids, attention_mask=ids.attention_mask, return_value_only=True)
    assert torch.equal(a, b)

    # A step-1 (causal LM) folder is not a critic.
    actor_dir = save_hf_model(create_hf_model(AutoModelForCausalLM, "tiny-llama", tok), tok, tmp_path / "actor")
    with pytest.raises(UserError, match="not a step-2 reward model output"):
        create_critic_model(str(actor_dir), tok, None, rlhf_training=True)

    # A value head from another model width fails loudly.
    from safetensors.torch import save_file

    save_file({"v_head.weight": torch.zeros(1, 7)}, str(out / "v_head.safetensors"))
    with pytest.raises(UserError, match="has shape"):
        create_critic_model(str(out), tok, None, rlhf_training=True)


def test_critic_body_from_a_different_model_fails_loudly(tmp_path):
    # An OPT body saved where a LLaMA critic is expected: the keys do not match.
    rm_opt, tok_opt = _reward_model("tiny-opt")
    out = save_hf_model(rm_opt, tok_opt, tmp_path / "critic")
    import json

    cfg = json.loads((out / "config.json").read_text())
    llama_cfg = json.loads((build_tiny_model("tiny-llama") / "config.json").read_text())
    llama_cfg["vocab_size"] = cfg["vocab_size"]
    (out / "config.json").write_text(json.dumps(llama_cfg))
    with pytest.raises(UserError, match="does not match its model"):
        create_critic_model(str(out), tok_opt, None, rlhf_training=True)


def test_a_crash_mid_save_keeps_the_previous_folder(tmp_path):
    tok = load_hf_tokenizer("tiny-llama")
    model = create_hf_model(AutoModelForCausalLM, "tiny-llama", tok)
    out = save_hf_model(model, tok, tmp_path / "actor")
    before = (out / "model.safetensors").read_bytes()

    class Exploding:
        def save_pretrained(self, *_a, **_k):
            raise RuntimeError("disk full")

    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="disk full"):
        save_hf_model(model, Exploding(), tmp_path / "actor")
    assert (out / "model.safetensors").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["actor"]  # no partial folder left behind


def test_reward_model_rejects_head_mask():
    rm, _ = _reward_model("tiny-llama")
    with pytest.raises(ValueError, match="head_mask"):
        rm.forward_value(torch.tensor([[1, 2]]), head_mask=torch.ones(1))
    assert isinstance(rm, RewardModel)


def test_save_keeps_logs_and_open_handles_in_the_output_folder(tmp_path):
    # Upstream's recipes write training.log and TensorBoard runs into the model's output folder.
    tok = load_hf_tokenizer("tiny-llama")
    model = create_hf_model(AutoModelForCausalLM, "tiny-llama", tok)
    out = tmp_path / "actor"
    (out / "step1_tensorboard").mkdir(parents=True)
    (out / "step1_tensorboard" / "events.out").write_text("tb")
    (out / "model-00001-of-00002.safetensors").write_text("stale shard from an older save")
    log = open(out / "training.log", "w")  # the launcher's tee keeps this handle open
    log.write("before save\n")
    log.flush()
    save_hf_model(model, tok, out)
    log.write("after save\n")
    log.close()
    assert (out / "training.log").read_text() == "before save\nafter save\n"
    assert (out / "step1_tensorboard" / "events.out").read_text() == "tb"
    assert not (out / "model-00001-of-00002.safetensors").exists()  # old model files are replaced
    assert (out / "model.safetensors").exists()
    from dschat.runtime import fs

    assert oct((out / "model.safetensors").stat().st_mode & 0o777) == oct(0o666 & ~fs._umask())  # as open() makes
