"""The chat CLI (inference/chatbot.py, chat.py) driven through stdin, plus its formatting pieces."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

sys.path.insert(0, str(REPO / "inference"))
import chatbot as C  # noqa: E402

from dschat.errors import UserError  # noqa: E402


def _chat(script: str, args: list[str], stdin: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, str(REPO / script), *args], input=stdin, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_two_rounds_clear_and_quit_on_a_tiny_model():
    proc = _chat("inference/chatbot.py", ["--path", "tiny-llama", "--max_new_tokens", "6"],
                 "Tell me about owls.\nAnd penguins?\nclear\nWhat about chess?\nquit\nnever read\n")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.count(C.PROMPT) == 5  # four inputs, then quit
    round1 = "-" * 30 + " Round 1 " + "-" * 30
    round2 = "-" * 30 + " Round 2 " + "-" * 30
    assert out.count(round1) == 2 and out.count(round2) == 1  # clear restarts the count
    assert out.index(round1) < out.index(round2) < out.index("(memory cleared)") < out.rindex(round1)
    # Something was generated after each separator.
    for chunk in out.split(round1)[1:] + out.split(round2)[1:]:
        answer = chunk.split(C.PROMPT)[0]
        assert answer.strip(), out


def test_a_blank_line_is_no_turn_and_the_prompt_comes_again():
    # An empty or blank line was answered as a turn (" Human:  Assistant:") and stayed in the history.
    proc = _chat("inference/chatbot.py", ["--path", "tiny-llama", "--max_new_tokens", "4"],
                 "\n   \nHello\n\t\nquit\n")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    after_each_prompt = out.split(C.PROMPT)[1:]  # blank, blank, Hello, tab, quit
    assert [bool(x.strip()) for x in after_each_prompt] == [False, False, True, False, False], out
    assert out.count(" Round ") == 1 and "-" * 30 + " Round 1 " + "-" * 30 in after_each_prompt[2]  # one turn


def test_chat_py_wraps_the_chatbot_and_ends_on_eof():
    proc = _chat("chat.py", ["--path", "tiny-opt", "--max_new_tokens", "4", "--sample", "--seed", "3"], "hello\n")
    assert proc.returncode == 0, proc.stderr
    assert "-" * 30 + " Round 1 " + "-" * 30 in proc.stdout


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads a process's command line from /proc")
def test_chat_py_becomes_the_chatbot_so_ctrl_c_reaches_it_alone():
    """A terminal's Ctrl-C goes to every process of the foreground group: a wrapper waiting on the
    chatbot took it too and killed the chatbot, ending the chat where the chatbot drops the turn and
    goes on. The wrapper's process is the chatbot's."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.Popen([sys.executable, str(REPO / "chat.py"), "--path", "tiny-opt", "--max_new_tokens", "4"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        seen = b""
        while not seen.endswith(C.PROMPT.encode()):  # the model is loaded and the chat waits for a question
            byte = proc.stdout.read(1)
            assert byte, proc.stderr.read().decode()
            seen += byte
        command = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert str(REPO / "inference" / "chatbot.py").encode() in command, command
        out, err = proc.communicate(b"hello\n", timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err.decode()
    assert "-" * 30 + " Round 1 " + "-" * 30 in out.decode()


@pytest.mark.parametrize("seed", ["-1", "99999999999999999999"])
def test_a_seed_out_of_range_is_one_line_before_the_model_loads(seed, tmp_path):
    """As the steps' --seed: torch.manual_seed raised an overflow after the model loaded (or took -1)."""
    with pytest.raises(UserError, match=r"^--seed must be from 0 to 4294967295 \(2\*\*32 - 1\), got "):
        C.main(["--path", str(tmp_path / "not loaded"), "--seed", seed])


def test_bad_path_is_one_line_and_exit_2(tmp_path):
    proc = _chat("inference/chatbot.py", ["--path", str(tmp_path / "nothing")], "")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: model path") and proc.stderr.strip().count("\n") == 0


def test_max_new_tokens_that_leaves_the_question_no_position_is_one_line_and_exit_2():
    """tiny-opt has 512 positions: 600 new tokens would drop the question (and index past them)."""
    proc = _chat("inference/chatbot.py", ["--path", "tiny-opt", "--max_new_tokens", "600", "--device", "cpu"],
                 "hello\n")
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert err.count("\n") == 0 and err.startswith("error: --max_new_tokens 600 leaves no room for the question")
    assert "model's 512 positions" in err and err.endswith("give --max_new_tokens 511 or less")
    assert "Round 1" not in proc.stdout


def test_reward_model_folder_is_refused_in_one_line(tmp_path):
    from dschat.models.build import create_critic_model
    from dschat.models.registry import resolve_model_path
    from dschat.models.save import save_hf_model
    from dschat.models.tokenizer import load_hf_tokenizer

    src = resolve_model_path("tiny-llama")
    tok = load_hf_tokenizer(src)
    save_hf_model(create_critic_model(src, tok, None), tok, tmp_path / "rm")
    proc = _chat("chat.py", ["--path", str(tmp_path / "rm")], "hi\n")
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert err.count("\n") == 0 and "is a reward model (a step-2 output or a sequence classifier)" in err


def test_an_adapter_on_an_adapter_loads_merged_as_training_saved_it(tmp_path):
    """A step-3 actor adapter whose run started from step 1's adapter names that adapter folder as its base:
    transformers' loading stopped there with a traceback; the chatbot merges the chain as training does."""
    import torch
    from transformers import AutoModelForCausalLM

    from dschat.models.build import create_hf_model
    from dschat.models.lora import convert_linear_layer_to_lora
    from dschat.models.save import save_hf_model
    from dschat.models.tokenizer import load_hf_tokenizer

    def trained_lora(base: str, seed: int):
        torch.manual_seed(seed)
        model = convert_linear_layer_to_lora(create_hf_model(AutoModelForCausalLM, base, tok), "layers.", 4)
        with torch.no_grad():
            for param in model.parameters():
                if param.requires_grad:
                    param.add_(torch.randn_like(param) * 0.05)
        return model.eval()

    tok = load_hf_tokenizer("tiny-llama")
    step1 = save_hf_model(trained_lora("tiny-llama", 0), tok, tmp_path / "s1")
    step3 = save_hf_model(trained_lora(str(step1 / "lora_adapter"), 1), tok, tmp_path / "s3")
    adapter = step3 / "lora_adapter"
    assert Path(json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]) == (
        step1 / "lora_adapter")
    model, _, device = C.load(str(adapter), device="cpu")
    merged = AutoModelForCausalLM.from_pretrained(step3, dtype=torch.float32).eval()
    batch = tok([" Human: Hi Assistant:"], return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, merged(**batch).logits, rtol=0, atol=1e-5)


def test_step3_output_root_means_its_actor(tmp_path):
    (tmp_path / "actor").mkdir()
    (tmp_path / "actor" / "config.json").write_text("{}")
    assert C.resolve_chat_folder(str(tmp_path)) == str(tmp_path / "actor")


def test_human_assistant_history_is_the_training_format():
    from dschat.models.tokenizer import load_hf_tokenizer

    conv = C.Conversation(load_hf_tokenizer("tiny-llama"))
    assert not conv.use_template  # the tiny tokenizer has no chat template
    conv.prompt_ids("Hi")
    assert conv.text == " Human: Hi Assistant:"
    conv.add_reply("Hello!")
    conv.prompt_ids("Bye")
    # Turns one after the other, each answer after its prompt with one space, as in a training text.
    assert conv.text == " Human: Hi Assistant: Hello! Human: Bye Assistant:"
    conv.clear()
    assert conv.text == ""


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-opt"])
def test_human_assistant_prompt_tokens_are_those_of_a_training_prompt(model):
    """The chatbot's prompt is a prompt of the built-in dataset (upstream's adapters' format), token for
    token, and a training text (prompt + answer) starts with exactly those tokens."""
    import json

    from dschat.data.adapters.local import builtin_files
    from dschat.models.tokenizer import load_hf_tokenizer

    tok = load_hf_tokenizer(model)
    train_file = next(f for f in builtin_files() if f.name.startswith("train"))
    row = json.loads(train_file.read_text().splitlines()[0])
    prompt = row["prompt"]  # " Human: <question> Assistant:"
    question = prompt[len(" Human: "):-len(" Assistant:")]
    assert prompt == " Human: " + question + " Assistant:"
    conv = C.Conversation(tok, "human_assistant")
    ids = conv.prompt_ids(question)
    assert conv.text == prompt
    assert ids == tok(prompt)["input_ids"]
    training_text = tok(prompt + row["chosen"])["input_ids"]
    assert training_text[: len(ids)] == ids  # no "\n" or trailing-space token the training data never has


def test_chat_template_is_used_when_the_tokenizer_has_one():
    from dschat.models.tokenizer import load_hf_tokenizer

    tok = load_hf_tokenizer("smollm2-135m")
    conv = C.Conversation(tok)
    assert conv.use_template
    ids = conv.prompt_ids("Hi")
    conv.add_reply("Hello!")
    ids2 = conv.prompt_ids("Bye")
    text = tok.decode(ids2)
    assert "Hi" in text and "Hello!" in text and text.rstrip().endswith("assistant")
    assert ids2[: len(ids) - 3] == ids[: len(ids) - 3]  # the history is a prefix
    forced = C.Conversation(tok, "human_assistant")
    assert not forced.use_template
    with pytest.raises(UserError, match="no chat template"):
        C.Conversation(load_hf_tokenizer("tiny-llama"), "chat_template")


def test_streamer_holds_back_and_stops_at_the_next_human_turn():
    from dschat.models.tokenizer import load_hf_tokenizer

    out = io.StringIO()
    streamer = C.StopAwareStreamer(load_hf_tokenizer("tiny-llama"), C.STOP_TEXT, out)
    streamer.feed("Owls hunt at night. H")
    assert out.getvalue() == "Owls hunt at night. "  # "H" may start "Human:"
    streamer.feed("uma")
    assert out.getvalue() == "Owls hunt at night. "
    streamer.feed("n: and you?")
    assert streamer.stopped and out.getvalue() == "Owls hunt at night. "  # nothing of "Human:" printed
    streamer.feed("more")
    assert out.getvalue() == "Owls hunt at night. "
    plain = C.StopAwareStreamer(load_hf_tokenizer("tiny-llama"), C.STOP_TEXT, io.StringIO())
    plain.feed("How are you? H")
    plain.feed("", end=True)  # at the end nothing is held back
    assert plain.printed == "How are you? H"


@pytest.mark.slow
def test_smollm2_answers_through_stdin():
    proc = _chat("inference/chatbot.py", ["--path", "smollm2-135m", "--max_new_tokens", "8"],
                 "What is a volcano?\nquit\n", timeout=240)
    assert proc.returncode == 0, proc.stderr
    answer = proc.stdout.split(" Round 1 " + "-" * 30, 1)[1].split(C.PROMPT)[0]
    assert len(answer.strip()) > 0


@pytest.mark.parametrize("damage", ["no weights", "truncated"])
def test_missing_or_damaged_weights_are_one_line_and_exit_2(damage, tmp_path):
    import shutil

    from dschat.models.registry import resolve_model_path

    source, folder = Path(resolve_model_path("tiny-opt")), tmp_path / "model"
    shutil.copytree(source, folder)
    weights = next(folder.glob("*.safetensors"))
    if damage == "no weights":
        weights.unlink()
    else:
        weights.write_bytes(weights.read_bytes()[:1000])
    proc = _chat("inference/chatbot.py", ["--path", str(folder), "--device", "cpu"], "hi\n")
    err = proc.stderr.strip()
    assert proc.returncode == 2 and err.count("\n") == 0 and "Traceback" not in err, err
    assert ("has no model weights" if damage == "no weights" else f"cannot read the weights in {weights}") in err


def test_a_line_that_is_not_utf8_is_asked_not_a_crash():
    env = dict(os.environ, HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="", PYTHONIOENCODING="utf-8:surrogateescape")
    proc = subprocess.run([sys.executable, str(REPO / "inference/chatbot.py"), "--path", "tiny-llama",
                           "--max_new_tokens", "3"], input=b"h\xffi\nquit\n", env=env, capture_output=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    assert "-" * 30 + " Round 1 " + "-" * 30 in proc.stdout.decode(errors="replace")


def test_an_empty_answer_takes_its_question_back_out_of_the_history():
    from dschat.models.tokenizer import load_hf_tokenizer

    conversation = C.Conversation(load_hf_tokenizer("tiny-llama"), "human_assistant")
    conversation.prompt_ids("hi")
    conversation.add_reply("hello")
    conversation.prompt_ids("again")
    conversation.add_reply("")
    assert conversation.text == " Human: hi Assistant: hello"
    templated = C.Conversation(load_hf_tokenizer("smollm2-135m"))
    templated.prompt_ids("hi")
    templated.add_reply("")
    assert templated.messages == []  # neither an empty assistant turn nor an unanswered question


def test_ctrl_c_drops_the_turn_being_answered_and_ends_the_chat_at_the_prompt(monkeypatch, capsys):
    seen = []

    def interrupted_once(model, tokenizer, device, conversation, user_text, args):
        seen.append(conversation.text)
        conversation.prompt_ids(user_text)
        if len(seen) == 1:
            raise KeyboardInterrupt
        conversation.add_reply("an answer")

    monkeypatch.setattr(C, "reply", interrupted_once)
    lines = iter(["first question", "second question"])

    def typed(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise KeyboardInterrupt from None

    monkeypatch.setattr("builtins.input", typed)
    with pytest.raises(SystemExit) as stop:
        C.main(["--path", "tiny-llama", "--format", "human_assistant", "--device", "cpu"])
    assert stop.value.code == 130
    out = capsys.readouterr().out
    assert "(interrupted: that turn is forgotten" in out
    assert seen == ["", ""]  # the interrupted turn left nothing in the history
    assert out.count("-" * 30 + " Round 1 " + "-" * 30) == 2


def test_a_device_dschat_does_not_run_on_is_one_line():
    from dschat.eval.scoring import pick_device

    with pytest.raises(UserError, match="'meta': dschat runs models on cpu or cuda"):
        pick_device("meta")
