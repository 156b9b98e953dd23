"""Reward models of another family and sequence classifiers (CPU, tiny models): the text a reward
model of another tokenizer reads, a one-label ``*ForSequenceClassification`` folder loaded as a
reward model (its score equal to transformers' own), and a multi-label one refused."""
from __future__ import annotations


import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from dschat.errors import UserError
from dschat.eval.scoring import Samples, load_reward, reward_scores
from dschat.models.build import create_critic_model
from dschat.models.registry import resolve_model_path
from dschat.models.reward_inputs import (CrossTokenizerInputs, chat_messages, encode_for_reward, reward_max_length,
                                         reward_text, user_turn)
from dschat.models.reward_model import check_critic_folder, critic_format
from dschat.models.tokenizer import load_hf_tokenizer
from dschat.rlhf.heldout.setup import resolve_judges

from helpers.step3 import make_classifier

TEXTS = ["Human: hello there Assistant: hi", "Human: a much longer prompt, to pad the other row Assistant: yes</s>"]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}")


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-opt"])
def test_a_one_label_classifier_scores_as_transformers_does(model, tmp_path):
    folder = make_classifier(model, tmp_path / "rm")
    assert critic_format(folder) == "classifier"
    tokenizer = load_hf_tokenizer(str(folder))
    reference = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    reward = create_critic_model(str(folder), tokenizer, None, rlhf_training=True).eval()
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")  # right padding: rows of two lengths
    assert not bool(batch.attention_mask.all())
    with torch.no_grad():
        expected = reference(**batch).logits.squeeze(-1)
        got = reward.forward_value(batch.input_ids, batch.attention_mask, prompt_length=2)["chosen_end_scores"]
    assert torch.equal(got, expected), (got, expected)
    # The evaluation report and --eval_judge load it the same way.
    judge, _ = load_reward(folder, torch.device("cpu"))
    with torch.no_grad():
        assert torch.equal(judge.forward_value(batch.input_ids, batch.attention_mask, prompt_length=2)[
            "chosen_end_scores"], expected)


def test_a_multi_label_classifier_is_refused_in_one_line(tmp_path):
    folder = make_classifier("tiny-opt", tmp_path / "three", num_labels=3)
    expected = f"{folder} is a sequence classifier with num_labels 3; a reward model gives one score"
    for check in (lambda: check_critic_folder(folder, str(folder), "--reward_model_name_or_path"),
                  lambda: create_critic_model(str(folder), load_hf_tokenizer("tiny-opt"), None, rlhf_training=True),
                  lambda: resolve_judges([str(folder)], ["dschat/builtin"])):
        with pytest.raises(UserError) as err:
            check()
        assert str(err.value).startswith(expected) and "num_labels=1" in str(err.value)
        assert "\n" not in str(err.value)


def test_the_text_without_a_chat_template_is_prompt_and_answer_as_they_are():
    tokenizer = load_hf_tokenizer("tiny-opt")
    assert reward_text(tokenizer, "Human: hi Assistant:", " ok", ended=True) == ("Human: hi Assistant: ok</s>", False)
    assert reward_text(tokenizer, "Human: hi Assistant:", " ok", ended=False) == ("Human: hi Assistant: ok", False)
    # Its own BOS added as its tokenizer adds it; cut keeping the end.
    ids = encode_for_reward(tokenizer, "Human: hi Assistant:", " ok", True, None)
    assert ids == tokenizer("Human: hi Assistant: ok</s>")["input_ids"] and ids[0] == tokenizer.bos_token_id
    assert encode_for_reward(tokenizer, "Human: hi Assistant:", " ok", True, 3) == ids[-3:]
    assert reward_max_length(tokenizer, AutoConfig.from_pretrained(resolve_model_path("tiny-opt"))) == 512


def test_the_chat_template_renders_a_user_and_an_assistant_turn():
    tokenizer = load_hf_tokenizer("tiny-opt")
    tokenizer.chat_template = TEMPLATE
    assert user_turn(" Human: what is 2+2? Assistant: ") == "what is 2+2?"
    assert user_turn("Human: a Assistant: b Human: c Assistant:") == "Human: a Assistant: b Human: c Assistant:"
    text, templated = reward_text(tokenizer, " Human: what is 2+2? Assistant:", " 4", ended=True)
    assert templated and text == "<|user|>what is 2+2?</s><|assistant|> 4</s>"
    assert encode_for_reward(tokenizer, " Human: what is 2+2? Assistant:", " 4", True, None) == tokenizer(
        text, add_special_tokens=False)["input_ids"]


def test_a_rollout_batch_is_decoded_and_retokenised_for_the_reward_model():
    actor, reward = load_hf_tokenizer("tiny-llama"), load_hf_tokenizer("tiny-opt")
    prompts, answers = ["Human: hello there Assistant:", "Human: hi Assistant:"], [" I am fine", " yes"]
    width = 12
    seq, mask = [], []
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        p = actor(prompt)["input_ids"]
        a = actor(answer, add_special_tokens=False)["input_ids"] + ([actor.eos_token_id] if i == 0 else [])
        row = [actor.pad_token_id] * (width - len(p)) + p + a
        seq.append(row + [actor.pad_token_id] * (24 - len(row)))
        mask.append([0] * (width - len(p)) + [1] * (len(p) + len(a)) + [0] * (24 - len(row)))
    inputs = CrossTokenizerInputs(actor, reward, max_length=None)
    ids, got_mask = inputs(torch.tensor(seq), torch.tensor(mask), width)
    expected = [reward(prompts[0] + answers[0] + "</s>")["input_ids"], reward(prompts[1] + answers[1])["input_ids"]]
    for row, m, want in zip(ids.tolist(), got_mask.tolist(), expected):
        assert row[:sum(m)] == want and all(t == reward.pad_token_id for t in row[sum(m):])
    # Cut to the reward model's length, keeping the end (the score is read at the last token).
    short, _ = CrossTokenizerInputs(actor, reward, max_length=4)(torch.tensor(seq), torch.tensor(mask), width)
    assert short[0].tolist() == expected[0][-4:]


def test_an_eval_judge_of_another_tokenizer_reads_the_rendered_text(tmp_path):
    folder = make_classifier("tiny-opt", tmp_path / "judge")
    judge, judge_tokenizer = load_reward(folder, torch.device("cpu"))
    judge_tokenizer.chat_template = TEMPLATE
    actor = load_hf_tokenizer("tiny-llama")
    prompt, answer = "Human: hello there Assistant:", " fine"
    samples = Samples([prompt], [actor(prompt)["input_ids"]], [actor(answer, add_special_tokens=False)["input_ids"]],
                      [answer], [False])
    text = "<|user|>hello there</s><|assistant|> fine</s>"
    batch = judge_tokenizer(text, add_special_tokens=False, return_tensors="pt")
    reference = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        expected = reference(**batch).logits.squeeze().item()
    assert reward_scores(judge, judge_tokenizer, samples, actor, 1) == [expected]


def test_a_step2_reward_model_reads_the_datasets_text_even_when_its_tokenizer_has_a_chat_template(tmp_path):
    """Step 2 trains on prompt + answer + EOS, never through a template: a step-2 output of a chat
    family (SmolLM2's tokenizer has a template) scoring another family's answers reads that text, as
    it would the actor's own ids; a Hugging Face classifier reads its template (the test above)."""
    from dschat.eval.scoring import score_sequences
    from dschat.models.save import save_hf_model

    tokenizer = load_hf_tokenizer("tiny-opt")
    tokenizer.chat_template = TEMPLATE
    save_hf_model(create_critic_model("tiny-opt", tokenizer, None), tokenizer, tmp_path / "rm")
    judge, judge_tokenizer = load_reward(tmp_path / "rm", torch.device("cpu"))
    assert judge_tokenizer.chat_template and not judge.reads_chat_template
    assert load_reward(make_classifier("tiny-opt", tmp_path / "cls"), torch.device("cpu"))[0].reads_chat_template
    actor = load_hf_tokenizer("tiny-llama")
    prompt, answer = "Human: hello there Assistant:", " fine"
    samples = Samples([prompt, prompt], [actor(prompt)["input_ids"]] * 2,
                      [actor(answer, add_special_tokens=False)["input_ids"]] * 2, [answer] * 2, [True, False])
    rows = [judge_tokenizer(prompt + answer + "</s>")["input_ids"], judge_tokenizer(prompt + answer)["input_ids"]]
    assert rows[0][0] == judge_tokenizer.bos_token_id
    expected = score_sequences(judge, rows, judge_tokenizer.pad_token_id, 2)
    assert reward_scores(judge, judge_tokenizer, samples, actor, 2) == expected and expected[0] != expected[1]
    # Step 3's re-tokenised rollout rows: the same text.
    ids = [actor(prompt)["input_ids"] + actor(answer, add_special_tokens=False)["input_ids"] + [actor.eos_token_id]]
    inputs = CrossTokenizerInputs(actor, judge_tokenizer, None, template=judge.reads_chat_template)
    P = len(actor(prompt)["input_ids"])
    assert inputs.rows(torch.tensor(ids), torch.ones(1, len(ids[0])), P) == rows[:1]


def test_a_prompt_in_the_actors_chat_markup_reaches_the_reward_models_template_as_its_messages():
    """A chat-formatted prompt (ChatML, as the word-game data's) decoded without its special tokens
    gave the reward model "system\\nYou are...\\nuser\\n..." as the user's words; it now reads the
    system and user turns, and an episode's observation turns, as messages of its own template."""
    actor, reward = load_hf_tokenizer("smollm2-135m"), load_hf_tokenizer("tiny-opt")
    reward.chat_template = TEMPLATE
    prompt = actor.apply_chat_template([{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Guess the word."}],
                                       add_generation_prompt=True, tokenize=False)
    p = actor(prompt, add_special_tokens=False)["input_ids"]
    turns = "cookie<|im_end|>\n<|im_start|>user\nwarmer<|im_end|>\n<|im_start|>assistant\ncake"
    expected = {"cookie": "<|system|>Be brief.</s><|user|>Guess the word.</s><|assistant|>cookie</s>",
                turns: ("<|system|>Be brief.</s><|user|>Guess the word.</s><|assistant|>cookie</s><|user|>warmer</s>"
                        "<|assistant|>cake</s>")}
    for answer, text in expected.items():
        a = actor(answer, add_special_tokens=False)["input_ids"] + [actor.eos_token_id]
        seq = torch.tensor([[actor.pad_token_id] * 2 + p + a])
        mask = torch.tensor([[0, 0] + [1] * (len(p) + len(a))])
        (row,) = CrossTokenizerInputs(actor, reward, None).rows(seq, mask, len(p) + 2)
        assert row == reward(text, add_special_tokens=False)["input_ids"]
    # The evaluation report's path: the prompt's text as the dataset has it.
    assert reward_text(reward, prompt, "cookie", True) == (expected["cookie"], True)


@pytest.mark.parametrize("text, messages", [
    ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|><|start_header_id|>user<|end_header_id|>"
     "\n\nU<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nA",
     [("system", "S"), ("user", "U"), ("assistant", "A")]),
    ("<bos><start_of_turn>user\nU<end_of_turn>\n<start_of_turn>model\nA", [("user", "U"), ("assistant", "A")]),
    ("Human: hi Assistant: ok", None),
    ("<|im_start|>user\nU<|im_end|>\n", None),  # no assistant turn at the end: not a prompt and answer
])
def test_chat_markups_are_read_back_as_messages(text, messages):
    got = chat_messages(text)
    assert (None if got is None else [(m["role"], m["content"]) for m in got]) == messages


def test_a_template_that_refuses_a_system_turn_gets_it_in_the_first_user_turn():
    reward = load_hf_tokenizer("tiny-opt")
    reward.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}"
                            "{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}")
    prompt = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nGuess.<|im_end|>\n<|im_start|>assistant\n"
    assert reward_text(reward, prompt, "cookie", True) == ("<|user|>Be brief.\n\nGuess.</s><|assistant|>cookie</s>", True)


def test_a_template_that_wants_alternating_turns_gets_an_episodes_tool_turns_as_user_turns():
    """Gemma's (and Mistral's) templates raise on roles that do not alternate user/assistant: an
    episode's ``tool`` observation was a jinja traceback mid-rollout."""
    reward = load_hf_tokenizer("tiny-opt")
    reward.chat_template = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}")
    prompt = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nGuess.<|im_end|>\n<|im_start|>assistant\n"
    answer = "cookie<|im_end|>\n<|im_start|>tool\nwarmer<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n" \
             "<|im_start|>assistant\ncake"
    assert reward_text(reward, prompt, answer, True) == (
        "<|user|>Be brief.\n\nGuess.</s><|assistant|>cookie</s><|user|>warmer\n\nagain</s><|assistant|>cake</s>", True)
    # Turns that open with the assistant's (or system words before it) get a user turn first.
    assert reward_text(reward, "x", "", True, marked="<|im_start|>system\nS<|im_end|>\n<|im_start|>assistant\nA") == (
        "<|user|>S</s><|assistant|>A</s>", True)
    # A template that takes one exchange only gets the user turn and the answer, as before.
    reward.chat_template = ("{% if messages|length != 2 %}{{ raise_exception('one exchange') }}{% endif %}"
                            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}")
    assert reward_text(reward, "Human: hi Assistant:", " ok", True, marked=prompt + answer) == (
        "<|user|>hi</s><|assistant|> ok</s>", True)
