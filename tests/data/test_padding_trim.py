"""Dropping all-padding columns changes compute, not results."""
import torch
from transformers import AutoModelForCausalLM

from dschat.data.collators import drop_padding_columns
from dschat.models.registry import resolve_model_path
from dschat.models.reward_model import positions_from_mask
from dschat.models.tokenizer import load_hf_tokenizer
from dschat.rl_math.logprobs import causal_lm_loss, gather_log_probs


def test_drop_padding_columns_by_hand():
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 0, 0], [5, 6, 0, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]),
        "labels": torch.tensor([[5, 6, 7, -100, -100], [5, 6, -100, -100, -100]]),
        "note": "kept",
    }
    out = drop_padding_columns(batch)
    assert out["input_ids"].tolist() == [[5, 6, 7], [5, 6, 0]]
    assert out["labels"].tolist() == [[5, 6, 7], [5, 6, -100]]
    assert out["note"] == "kept"
    left = {"prompt": torch.tensor([[0, 0, 0, 8, 9], [0, 0, 7, 8, 9]]),
            "prompt_att_mask": torch.tensor([[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]])}
    out = drop_padding_columns(left, "prompt_att_mask", side="left")
    assert out["prompt"].tolist() == [[0, 8, 9], [7, 8, 9]]
    assert out["prompt_att_mask"].tolist() == [[0, 1, 1], [1, 1, 1]]
    full = {"attention_mask": torch.ones(2, 3, dtype=torch.long)}
    assert drop_padding_columns(full)["attention_mask"].shape == (2, 3)


def test_trimmed_batches_give_the_same_loss_and_log_probs():
    torch.manual_seed(0)
    tok = load_hf_tokenizer("tiny-llama")
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-llama")).eval()
    # Right padding (steps 1-2): the SFT loss is unchanged.
    enc = tok([" Human: Tell me about owls. Assistant: Owls hunt at night.", " Human: Hi Assistant: Hello."],
              padding="max_length", max_length=48, return_tensors="pt")
    labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
    full = {"input_ids": enc.input_ids, "attention_mask": enc.attention_mask, "labels": labels}
    trimmed = drop_padding_columns(full)
    assert trimmed["input_ids"].shape[1] < 48
    with torch.no_grad():
        a = causal_lm_loss(model(input_ids=full["input_ids"], attention_mask=full["attention_mask"]).logits, labels)
        b = causal_lm_loss(model(input_ids=trimmed["input_ids"], attention_mask=trimmed["attention_mask"]).logits,
                           trimmed["labels"])
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Left padding (step-3 prompts): log-probs of the real tokens are unchanged.
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * 6 + [1, 20, 21, 22], [pad] * 4 + [1, 30, 31, 32, 33, 34]])
    mask = (torch.arange(10) >= torch.tensor([[6], [4]])).long()
    small = drop_padding_columns({"prompt": ids, "prompt_att_mask": mask}, "prompt_att_mask", side="left")
    with torch.no_grad():
        lp_full = gather_log_probs(model(ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits[:, :-1], ids[:, 1:])
        s_ids, s_mask = small["prompt"], small["prompt_att_mask"]
        lp_small = gather_log_probs(model(s_ids, attention_mask=s_mask, position_ids=positions_from_mask(s_mask)).logits[:, :-1], s_ids[:, 1:])
    width = s_ids.shape[1]
    torch.testing.assert_close(lp_full[:, -(width - 1):][s_mask[:, 1:].bool()], lp_small[s_mask[:, 1:].bool()], rtol=1e-5, atol=1e-5)
