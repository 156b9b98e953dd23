"""The chat CLI's reply() as it drives generate: where an answer ends (a next ``Human:`` turn, every end
id, the chat template's own end of turn), which tokens of a long conversation it keeps, and what an empty
answer or a template's refusal leaves in the history. The model is scripted (its answer is fixed); the
tokenizers, chat templates and the streamer are the real ones."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from helpers import REPO

sys.path.insert(0, str(REPO / "inference"))
import chatbot as C  # noqa: E402

from dschat.models.tokenizer import load_hf_tokenizer  # noqa: E402

# A template that wants user and assistant turns in alternation, as Llama 2's, Mistral's and Gemma's do.
ALTERNATING = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
               "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class ScriptedModel:
    """Answers each generate call with the next of ``answers`` (token ids), written into generate's
    streamer token by token and ended as Hugging Face generate ends one: at any of its ``eos_token_id``,
    when its stopping criteria say so, or at ``max_new_tokens``. Records each call's input ids."""

    def __init__(self, answers: list[list[int]], positions: int = 2048, config_eos: list[int] | None = None):
        self.answers = list(answers)
        self.config = SimpleNamespace(max_position_embeddings=positions)
        self.generation_config = SimpleNamespace(eos_token_id=config_eos)
        self.inputs: list[list[int]] = []

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, eos_token_id, streamer,
                 stopping_criteria, **kwargs):
        self.inputs.append(input_ids[0].tolist())
        ends = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
        streamer.put(input_ids)  # the prompt, which the streamer skips
        sequence = input_ids
        for token in self.answers.pop(0)[:max_new_tokens]:
            streamer.put(torch.tensor([token]))
            sequence = torch.cat([sequence, torch.tensor([[token]])], dim=1)
            if token in ends or bool(torch.as_tensor(stopping_criteria(sequence, None)).all()):
                break
        streamer.end()
        return sequence


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _args(max_new_tokens=32):
    return C.build_parser().parse_args(["--path", "unused", "--max_new_tokens", str(max_new_tokens)])


@pytest.fixture(scope="module")
def smollm2_base():
    """SmolLM2's tokenizer as a base model's: EOS <|endoftext|>, its ChatML turns closed by <|im_end|>."""
    from transformers import AutoTokenizer

    from dschat.models.embedded import materialize_smollm2
    return AutoTokenizer.from_pretrained(str(materialize_smollm2()), eos_token="<|endoftext|>")


def test_a_human_assistant_answer_ends_before_the_next_human_turn(capsys):
    tok = load_hf_tokenizer("tiny-llama")
    model = ScriptedModel([_ids(tok, " Paris is the capital. Human: and Rome? Assistant: Rome is")])
    conversation = C.Conversation(tok, "human_assistant")
    assert C.reply(model, tok, "cpu", conversation, "capital?", _args()) == "Paris is the capital."
    assert conversation.text == " Human: capital? Assistant: Paris is the capital."
    assert "Human:" not in capsys.readouterr().out


def test_an_answer_ends_at_an_end_id_of_the_generation_config():
    tok = load_hf_tokenizer("tiny-llama")
    stop = _ids(tok, " Paris.")[-1]
    model = ScriptedModel([_ids(tok, " Paris. Rome. Berlin.")], config_eos=[stop])
    assert C.reply(model, tok, "cpu", C.Conversation(tok, "human_assistant"), "capital?", _args()) == "Paris."


def test_a_chat_templates_end_of_turn_ends_the_answer_where_it_is_no_end_id(smollm2_base):
    """A base model's tokenizer (EOS <|endoftext|>) with a ChatML template: without <|im_end|> as a stop
    the answer ran on into made-up turns, shown as 'user' lines and kept in the history."""
    tok = smollm2_base
    assert tok.eos_token_id != tok.convert_tokens_to_ids("<|im_end|>")
    model = ScriptedModel([_ids(tok, "Paris.<|im_end|>\n<|im_start|>user\nAnd Rome?<|im_end|>")])
    conversation = C.Conversation(tok)
    assert C.reply(model, tok, "cpu", conversation, "capital?", _args()) == "Paris."
    assert conversation.messages == [{"role": "user", "content": "capital?"}, {"role": "assistant", "content": "Paris."}]


def test_a_conversation_longer_than_the_model_keeps_its_last_tokens(capsys):
    tok = load_hf_tokenizer("tiny-llama")
    conversation = C.Conversation(tok, "human_assistant")
    question = " ".join(f"word{i}" for i in range(80))
    whole = C.Conversation(tok, "human_assistant").prompt_ids(question)
    model = ScriptedModel([_ids(tok, " fine")], positions=64)
    C.reply(model, tok, "cpu", conversation, question, _args(16))
    assert len(whole) > 48 and model.inputs == [whole[-48:]]
    assert "keeping its last 48 tokens" in capsys.readouterr().out


def _chat(monkeypatch, capsys, tok, model, lines):
    monkeypatch.setattr(C, "load", lambda *args, **kwargs: (model, tok, "cpu"))
    typed = iter(lines)
    monkeypatch.setattr("builtins.input", lambda prompt="": next(typed))
    C.main(["--path", "unused", "--max_new_tokens", "16"])
    return capsys.readouterr().out


def test_an_empty_answer_forgets_its_turn_so_an_alternating_template_goes_on(monkeypatch, capsys, smollm2_base):
    """The model ended its turn at once: the question is taken back out, or the next round would send two
    user turns in a row, which such a template refuses (the chat ended in a traceback)."""
    tok = smollm2_base
    tok.chat_template = ALTERNATING
    end = tok.convert_tokens_to_ids("<|im_end|>")
    model = ScriptedModel([[end], _ids(tok, "Sure.") + [end]])
    out = _chat(monkeypatch, capsys, tok, model, ["hi", "hello again", "quit"])
    assert "(no answer: the model ended its turn at once)" in out and "Sure." in out
    alone = tok.apply_chat_template([{"role": "user", "content": "hello again"}], add_generation_prompt=True,
                                    tokenize=True)
    assert model.inputs[1] == list(alone.get("input_ids", alone) if hasattr(alone, "get") else alone)


def test_a_template_that_refuses_the_conversation_is_one_line_and_the_chat_goes_on(monkeypatch, capsys,
                                                                                   smollm2_base):
    tok = smollm2_base
    tok.chat_template = ("{% if messages | length > 2 %}{{ raise_exception('only one question, please') }}{% endif %}"
                         + ALTERNATING)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    model = ScriptedModel([_ids(tok, "One.") + [end], _ids(tok, "Two.") + [end]])
    out = _chat(monkeypatch, capsys, tok, model, ["first", "second", "clear", "third", "quit"])
    assert "(the chat template refused the conversation: only one question, please; that turn is forgotten; " \
           "type 'clear' to start over)" in out
    assert "One." in out and "Two." in out and len(model.inputs) == 2  # the refused turn never reached generate
