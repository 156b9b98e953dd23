"""A rollout ends where Hugging Face ``generate`` (upstream's step 3) ends it: at the tokenizer's EOS
or at any id of the model's generation config ``eos_token_id``. Every decoding path on the CPU, the
answer masks and the multi-turn player use the same ids."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from dschat.models.tokenizer import end_token_ids
from dschat.rlhf.experience import sequence_masks
from dschat.rlhf.rollout.deepspeed_engine import HybridEngineDecision
from dschat.rlhf.rollout.generator import RolloutGenerator
from dschat.rlhf.rollout.sampling import DecodingSettings, is_end, next_token_scores

PROMPTS = torch.tensor([[3, 1, 40, 41], [1, 42, 43, 44]])  # tiny-llama ids: pad 3, bos 1
PROMPT_MASK = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
NEW_TOKENS = 6


def test_the_end_ids_are_the_tokenizers_eos_then_the_generation_configs_without_repeats():
    tok = SimpleNamespace(eos_token_id=2)
    assert end_token_ids(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[7, 2, 9])), tok) == (2, 7, 9)
    assert end_token_ids(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=5)), tok) == (2, 5)
    assert end_token_ids(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None)), tok) == (2,)
    assert end_token_ids(object(), tok) == (2,)  # a module without a generation config
    assert end_token_ids(object(), SimpleNamespace(eos_token_id=None)) == ()


def test_a_chat_templates_close_of_turn_is_found_when_it_is_a_special_token():
    """The chat CLI, the server's chat answers and step 3's multi-turn episodes also end there (not
    step 3's single answers: its data is not rendered through the template)."""
    from transformers import AutoTokenizer

    from dschat.models.embedded import materialize_smollm2
    from dschat.models.tokenizer import load_hf_tokenizer, template_turn_end_id

    folder = str(materialize_smollm2())
    assert template_turn_end_id(AutoTokenizer.from_pretrained(folder)) == 2  # <|im_end|>, also its EOS
    base = AutoTokenizer.from_pretrained(folder, eos_token="<|endoftext|>")
    assert (base.eos_token_id, template_turn_end_id(base)) == (0, 2)
    llama = load_hf_tokenizer("tiny-llama")
    assert template_turn_end_id(llama) is None  # no template
    llama.chat_template = "{% for m in messages %}{{ m['content'] }}\n\n{% endfor %}"
    assert template_turn_end_id(llama) is None  # turns closed by plain text
    llama.chat_template = "{% for m in messages %}{{ m['content'] }} </s>{% endfor %}"
    assert template_turn_end_id(llama) == llama.eos_token_id  # after the blank, as Llama 2's ' </s>'
    llama.chat_template = "{{ raise_exception('no') }}"
    assert template_turn_end_id(llama) is None


def test_every_end_id_is_masked_before_min_new_tokens_and_ends_a_row():
    logits = torch.zeros(2, 10)
    scores = next_token_scores(logits, DecodingSettings("greedy"), (2, 7), suppress_eos=True)
    assert torch.isinf(scores[:, [2, 7]]).all() and torch.isfinite(scores[:, [0, 1, 3, 4, 5, 6, 8, 9]]).all()
    tokens = torch.tensor([[5, 7, 0], [2, 4, 4]])
    assert is_end(tokens, (2, 7)).tolist() == [[False, True, False], [True, False, False]]
    assert is_end(tokens, 7).tolist() == [[False, True, False], [False, False, False]]


class _PlainEngine:
    """What RolloutGenerator uses of a DeepSpeed engine (``.module``), around a plain module."""

    def __init__(self, module):
        self.module = module


@pytest.fixture(scope="module")
def two_end_ids():
    """tiny-llama, its tokenizer, and an end id the greedy answer of prompt 0 meets at its third
    token (``stop``), named by the model's generation config beside the tokenizer's EOS."""
    from transformers import AutoModelForCausalLM

    from dschat.models.registry import resolve_model_path
    from dschat.models.tokenizer import load_hf_tokenizer

    tok = load_hf_tokenizer("tiny-llama")
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-llama")).eval()
    with torch.no_grad():
        plain = type(model).generate(model, PROMPTS, attention_mask=PROMPT_MASK, max_new_tokens=NEW_TOKENS,
                                     do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    answer = plain[0, PROMPTS.shape[1]:].tolist()
    # The first token after the first two that is new to the answer and not an EOS or a pad.
    at = next(k for k in range(2, NEW_TOKENS) if answer[k] not in answer[:k] + [tok.eos_token_id, tok.pad_token_id])
    stop = answer[at]
    model = copy.deepcopy(model)
    model.generation_config.eos_token_id = [tok.eos_token_id, stop]
    return model, tok, stop, at, plain


def _generator(model, tok, decision=HybridEngineDecision(False, False), **kwargs) -> RolloutGenerator:
    return RolloutGenerator(_PlainEngine(model), tok, decision=decision, decoding=DecodingSettings("greedy"),
                            max_answer_seq_len=NEW_TOKENS, zero_stage=0, cpu_decode_linear="off", **kwargs)


@pytest.mark.parametrize("path", ["dschat", "hf", "dschat-he"])
def test_a_rollout_stops_at_the_generation_configs_end_id_on_every_path(two_end_ids, path):
    model, tok, stop, at, plain = two_end_ids
    if path == "dschat-he":
        gen = _generator(model, tok, HybridEngineDecision(True, False, dschat_engine=True))
    else:
        gen = _generator(model, tok, generation_loop=path)
    assert gen.end_ids == (tok.eos_token_id, stop)
    seq = gen.rollout(PROMPTS, PROMPT_MASK).sequences
    assert gen.last_loop == path
    # What upstream's generate gives: it reads eos_token_id from the generation config.
    with torch.no_grad():
        expected = type(model).generate(model, PROMPTS, attention_mask=PROMPT_MASK, max_new_tokens=NEW_TOKENS,
                                        do_sample=False, pad_token_id=tok.pad_token_id)
    width = min(seq.shape[1], expected.shape[1])
    assert torch.equal(seq[:, :width], expected[:, :width])
    P = PROMPTS.shape[1]
    answer = seq[0, P:].tolist()
    assert answer[:at + 1] == plain[0, P:P + at + 1].tolist() and answer[at] == stop
    assert all(t == tok.pad_token_id for t in answer[at + 1:])  # the row ended there
    masks = sequence_masks(PROMPT_MASK, seq, gen.end_ids)
    assert int(masks.answer_lengths[0]) == at + 1  # the answer mask stops at the end id, inclusive
    assert bool(is_end(seq[:, P:], gen.end_ids).any(-1)[0])  # the row counts as ended (EOS rate, penalty)


def test_multi_turn_rollouts_also_end_at_the_chat_templates_end_of_turn():
    """A base model's tokenizer (EOS <|endoftext|>) with ChatML's template: episodes continue the
    conversation through the template, so their turns also end at <|im_end|>; single answers do not."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dschat.models.embedded import materialize_smollm2
    from dschat.models.registry import resolve_model_path

    base = AutoTokenizer.from_pretrained(str(materialize_smollm2()), eos_token="<|endoftext|>")
    im_end = base.convert_tokens_to_ids("<|im_end|>")
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-llama"))
    model.generation_config.eos_token_id = None
    assert _generator(model, base).end_ids == (base.eos_token_id,)
    assert _generator(model, base, chat_turn_end=True).end_ids == (base.eos_token_id, im_end)
    instruct = AutoTokenizer.from_pretrained(str(materialize_smollm2()))  # EOS <|im_end|>: not repeated
    assert _generator(model, instruct, chat_turn_end=True).end_ids == (im_end,)
    plain = copy.deepcopy(base)
    plain.chat_template = None  # no template: nothing added
    assert _generator(model, plain, chat_turn_end=True).end_ids == (base.eos_token_id,)


def test_an_episode_turn_ends_at_any_end_id():
    from dschat.rlhf.episodes import _until_end

    assert _until_end([5, 6, 7, 2, 8], (2, 7)) == [5, 6, 7]
    assert _until_end([5, 6, 2, 7], (2, 7)) == [5, 6, 2]
    assert _until_end([5, 6], (2, 7)) == [5, 6]


def test_a_tensor_parallel_member_keeps_its_rows_up_to_where_each_met_any_end_id():
    from dschat.rlhf.rollout.tensor_parallel import own_answer_length

    assert own_answer_length(torch.tensor([[5, 7, 0, 0], [2, 0, 0, 0]]), (2, 7)) == 2
    assert own_answer_length(torch.tensor([[5, 7, 0, 0], [2, 0, 0, 0]]), 2) == 4  # 7 alone ends nothing


def test_a_reward_model_of_another_tokenizer_reads_an_answer_ended_at_any_end_id_as_ended():
    """The answer's last token is a generation-config end id of the actor: it is dropped and the reward
    tokenizer's EOS closes the text, as for the tokenizer's own EOS."""
    from dschat.models.reward_inputs import CrossTokenizerInputs
    from dschat.models.tokenizer import load_hf_tokenizer

    actor, reward = load_hf_tokenizer("tiny-llama"), load_hf_tokenizer("tiny-opt")
    prompt, answer = "Human: hello there Assistant:", " I am fine"
    p = actor(prompt)["input_ids"]
    stop = 400  # an id that is no special token of the actor
    row = p + actor(answer, add_special_tokens=False)["input_ids"] + [stop]
    seq, mask = torch.tensor([row]), torch.ones(1, len(row), dtype=torch.long)
    ids, got = CrossTokenizerInputs(actor, reward, None, end_ids=(actor.eos_token_id, stop))(seq, mask, len(p))
    assert ids[0, :int(got.sum())].tolist() == reward(prompt + answer + "</s>")["input_ids"]
    # Without it among the end ids the answer did not end: its token is text, and no EOS is added.
    ids, got = CrossTokenizerInputs(actor, reward, None)(seq, mask, len(p))
    assert reward.eos_token_id not in ids[0, 1:int(got.sum())].tolist()


def test_the_eval_cli_stops_an_answer_at_any_end_id(two_end_ids):
    from dschat.eval.heldout import EvalSettings
    from dschat.eval.scoring import generate

    model, tok, _, _, _ = two_end_ids
    model = copy.deepcopy(model)
    settings = EvalSettings(do_sample=False, max_new_tokens=NEW_TOKENS)
    model.generation_config.eos_token_id = tok.eos_token_id
    free = generate(model, tok, ["Human: hello there Assistant:"], settings).response_ids[0]
    k = next(k for k in range(1, len(free)) if free[k] not in free[:k] + [tok.eos_token_id, tok.pad_token_id])
    model.generation_config.eos_token_id = [tok.eos_token_id, free[k]]
    stopped = generate(model, tok, ["Human: hello there Assistant:"], settings)
    assert stopped.response_ids == [free[:k + 1]] and stopped.ended == [True]
