#!/usr/bin/env python3
"""Multi-round chat with any actor: a step-1 or step-3 output folder, a hub id, or smollm2-135m.

    python inference/chatbot.py --path output/step3-models/1.3b/actor [--max_new_tokens 128]

Upstream's loop (inference/chatbot.py): ``Enter input (type 'quit' to exit, 'clear' to clean
memory):``, a ``Round n`` separator before each answer, ``quit`` exits and ``clear`` forgets the
conversation. An empty (or blank) line is no turn: the prompt comes again, and nothing joins the
conversation (upstream answered it as a question, ``" Human:  Assistant:"``). The conversation is
formatted with the model's chat template when its tokenizer has one, else in the text format of
dschat's data adapters and built-in dataset (upstream's convention, what the step scripts train
on): ``" Human: <question> Assistant:"``, the answer following with its leading space. Upstream's
chatbot sent ``" Human: ...\\n Assistant: "`` (a newline and a trailing space no training text has).
Differences from upstream, each fixing one of its bugs: the model is loaded once (not built
from its config and then loaded again), on the GPU when there is one and on the CPU otherwise (no
hard-coded ``cuda:0`` / ``.half()``), the tokenizer comes from the folder itself, tokens are printed
as they are generated, and the embedding is never shrunk below the checkpoint's size.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing: use its dschat
    sys.path.insert(0, str(ROOT))

from dschat.cli.shared import check_seed  # noqa: E402
from dschat.errors import UserError, cli_main  # noqa: E402
from dschat.eval.heldout import check_sampling  # noqa: E402  (torch-free: bad options fail in a blink)
from dschat.paths import step3_part  # noqa: E402

# bitsandbytes (imported by transformers) warns on AVX-512 CPUs without the optional `kernels`
# package; that line is noise in an interactive tool.
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)

PROMPT = "Enter input (type 'quit' to exit, 'clear' to clean memory): "
# dschat.data.adapters' convention: a prompt is " Human: " + question + " Assistant:" and the
# answer that follows starts with a space; a conversation is the turns one after the other.
HUMAN, ASSISTANT = " Human: ", " Assistant:"
STOP_TEXT = "Human:"  # a model in upstream's format starts the next (hallucinated) turn with it


def resolve_chat_folder(path: str) -> str:
    """The folder (or hub id) to load; a step-3 output root means its ``actor/``.

    Raises :class:`UserError` for a step-2 reward model and for anything that is not a causal LM.
    """
    from dschat.models.registry import resolve_model_path
    from dschat.models.reward_model import refuse_reward_model

    actor = step3_part(path, "actor")
    if actor is not None:
        print(f"(using the step-3 actor in {actor})", flush=True)
        return str(actor)
    resolved = resolve_model_path(path)
    refuse_reward_model(resolved, path, "chat with a step-1 output or a step-3 actor folder (<step-3 output>/actor)")
    return resolved


def check_format(tokenizer: Any, fmt: str) -> None:
    """``--format chat_template`` needs a tokenizer with a chat template."""
    if fmt == "chat_template" and not getattr(tokenizer, "chat_template", None):
        raise UserError("--format chat_template: this tokenizer has no chat template; use --format human_assistant")


def check_max_new_tokens(max_new_tokens: int, config: Any) -> None:
    """``--max_new_tokens`` must leave the question at least one of the model's positions
    (``max_position_embeddings``; a config without one is not checked)."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit and max_new_tokens >= limit:
        raise UserError(f"--max_new_tokens {max_new_tokens} leaves no room for the question in the model's {limit} "
                        f"positions (max_position_embeddings); give --max_new_tokens {limit - 1} or less")


def load(path: str, device: str = "auto", fmt: str = "auto",
         max_new_tokens: int | None = None) -> tuple[Any, Any, Any]:
    """(model, tokenizer, device) for chatting; ``fmt`` (``--format``), ``max_new_tokens``
    (:func:`check_max_new_tokens`) and ``device`` (``--device``: a torch device this machine has, see
    :func:`dschat.eval.scoring.pick_device`) are checked before the model loads."""
    folder = resolve_chat_folder(path)  # before the heavy imports: a bad path fails in a blink
    import torch
    from transformers import AutoModelForCausalLM

    from dschat.eval.scoring import pick_device
    from dschat.models.registry import is_adapter_folder, load_config
    from dschat.models.tokenizer import load_hf_tokenizer

    config = load_config(folder)
    architectures = getattr(config, "architectures", None) or []
    if architectures and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        raise UserError(f"{path} holds a {', '.join(architectures)}, not a causal language model; "
                        "chat with a step-1 or step-3 actor folder")
    if max_new_tokens is not None:
        check_max_new_tokens(max_new_tokens, config)
    dev = pick_device(device)  # --device: a CUDA device this machine lacks is one line, before loading
    # bf16 on a GPU that supports it (fp16 overflows some models; upstream forced .half()), fp32 on CPU.
    dtype = torch.bfloat16 if dev.type == "cuda" and torch.cuda.is_bf16_supported() else (
        torch.float16 if dev.type == "cuda" else torch.float32)
    tokenizer = load_hf_tokenizer(folder)
    check_format(tokenizer, fmt)
    if is_adapter_folder(folder):
        # A LoRA adapter folder: its base built and the adapter merged in, as training and serving load one
        # (a base that is itself an adapter folder too; transformers' own loading cannot chain them).
        from dschat.models.build import create_hf_model

        model = create_hf_model(AutoModelForCausalLM, folder, tokenizer).to(dev, dtype).eval()
    else:  # missing or damaged weights are one line (dschat.models.build.load_pretrained)
        from dschat.models.build import load_pretrained

        model = load_pretrained(AutoModelForCausalLM, folder, dtype=dtype).to(dev).eval()
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(8 * -(-len(tokenizer) // 8))  # a multiple of 8, as in training
    return model, tokenizer, dev


class Conversation:
    """The running history, in the chat template or in the Human/Assistant text of the training data.

    In the latter, ``text`` after two rounds is ``" Human: q1 Assistant: a1 Human: q2 Assistant:"``:
    each prompt exactly as the data adapters write one (``" Human: " + q + " Assistant:"``, no newline,
    no trailing space), each answer after it with its leading space, as in a training text
    (``prompt + " " + answer``), and the next turn's own leading space separating the turns.
    """

    def __init__(self, tokenizer: Any, fmt: str = "auto"):
        has_template = bool(getattr(tokenizer, "chat_template", None))
        check_format(tokenizer, fmt)
        self.tokenizer = tokenizer
        self.use_template = has_template if fmt == "auto" else fmt == "chat_template"
        self.clear()

    def clear(self) -> None:
        self.messages: list[dict[str, str]] = []
        self.text = ""
        self._asked = self.snapshot()  # the history before the question being answered

    def snapshot(self) -> tuple[list[dict[str, str]], str]:
        """The history as it is now, for :meth:`restore` (a turn interrupted before its answer)."""
        return list(self.messages), self.text

    def restore(self, saved: tuple[list[dict[str, str]], str]) -> None:
        self.messages, self.text = list(saved[0]), saved[1]

    def prompt_ids(self, user_text: str) -> list[int]:
        """Token ids of the whole conversation so far plus the new user turn, ready for the reply."""
        self._asked = self.snapshot()
        if self.use_template:
            self.messages.append({"role": "user", "content": user_text})
            ids = self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in some versions
                ids = ids["input_ids"]
            return list(ids)
        self.text += f"{HUMAN}{user_text}{ASSISTANT}"
        return self.tokenizer(self.text)["input_ids"]

    def add_reply(self, reply: str) -> None:
        """The answer to the question :meth:`prompt_ids` added. An empty one (the model ended its turn at
        once) takes the question back out: the turn is forgotten, as a chat template that wants user and
        assistant turns in alternation would refuse two questions in a row."""
        if not reply:
            self.restore(self._asked)
            return
        if self.use_template:
            self.messages.append({"role": "assistant", "content": reply})
        else:  # as the answer follows the prompt in training texts: one space (the reply was stripped)
            self.text += " " + reply


class StopAwareStreamer:
    """Prints decoded text as tokens arrive; in the Human/Assistant format it holds back what could
    be the start of the next ``Human:`` turn and stops there (upstream cut it after the fact)."""

    def __init__(self, tokenizer: Any, stop_text: str | None, out: Any = None):
        from transformers import TextStreamer

        self.out = out or sys.stdout
        self.stop_text = stop_text
        self.printed = ""
        self.pending = ""
        self.stopped = False
        streamer = self

        class _Streamer(TextStreamer):
            def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
                streamer.feed(text, stream_end)

        self.streamer = _Streamer(tokenizer, skip_prompt=True, skip_special_tokens=True)

    def feed(self, text: str, end: bool = False) -> None:
        if self.stopped:
            return
        self.pending += text
        if self.stop_text and self.stop_text in self.pending:
            self._emit(self.pending.split(self.stop_text, 1)[0].rstrip())
            self.pending, self.stopped = "", True
            return
        keep = 0
        if self.stop_text and not end:  # a suffix that may grow into the stop text stays pending
            for n in range(min(len(self.stop_text) - 1, len(self.pending)), 0, -1):
                if self.stop_text.startswith(self.pending[-n:]):
                    keep = n
                    break
        self._emit(self.pending[: len(self.pending) - keep])
        self.pending = self.pending[len(self.pending) - keep:]

    def _emit(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()
            self.printed += text


def _stopping_criteria(holder: StopAwareStreamer) -> Any:
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _Stop(StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> bool:
            return holder.stopped

    return StoppingCriteriaList([_Stop()])


def reply(model: Any, tokenizer: Any, device: Any, conversation: Conversation, user_text: str,
          args: argparse.Namespace) -> str:
    """Generate (streaming) the answer to ``user_text``; returns the answer text. It ends at any id of
    :func:`dschat.models.tokenizer.end_token_ids` (the tokenizer's EOS and the generation config's), as
    step 3's rollouts and the server do, and, through a chat template, at the token the template closes
    an answer with (:func:`dschat.models.tokenizer.template_turn_end_id`); in the Human/Assistant text,
    before a next ``Human:`` turn."""
    import torch

    from dschat.models.tokenizer import end_token_ids, generate_eos, template_turn_end_id

    ids = conversation.prompt_ids(user_text)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and len(ids) + args.max_new_tokens > limit:
        keep = max(1, limit - args.max_new_tokens)
        print(f"(conversation longer than the model's {limit} positions: keeping its last {keep} tokens; "
              "type 'clear' to start over)", flush=True)
        ids = ids[-keep:]
    streamer = StopAwareStreamer(tokenizer, None if conversation.use_template else STOP_TEXT)
    ends = end_token_ids(model, tokenizer)
    turn_end = template_turn_end_id(tokenizer) if conversation.use_template else None
    if turn_end is not None and turn_end not in ends:  # a base model's tokenizer with a ChatML template
        ends += (turn_end,)
    kwargs: dict[str, Any] = {"do_sample": args.sample}
    if args.sample:
        kwargs.update(temperature=args.temperature, top_p=args.top_p)
    else:  # clear the model's sampling defaults so greedy decoding does not warn about them
        kwargs.update(temperature=None, top_p=None, top_k=None)
    input_ids = torch.tensor([ids], device=device)
    with torch.no_grad():
        model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=args.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=generate_eos(ends),
            streamer=streamer.streamer,
            stopping_criteria=_stopping_criteria(streamer),
            **kwargs,
        )
    streamer.feed("", end=True)
    answer = streamer.printed.strip()
    print("" if answer else "(no answer: the model ended its turn at once)", flush=True)
    conversation.add_reply(answer)
    return answer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Chat with a trained actor (multi-round, streamed).")
    parser.add_argument("--path", type=str, required=True,
                        help="Directory containing trained actor model (a step-1 or step-3 output, a hub id, "
                             "or smollm2-135m)")
    parser.add_argument("--max_new_tokens", type=int, default=128, help="Maximum new tokens to generate per response")
    parser.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (with --sample)")
    parser.add_argument("--top_p", type=float, default=0.9, help="nucleus sampling (with --sample)")
    parser.add_argument("--seed", type=int, default=42, help="random seed (upstream's 42)")
    parser.add_argument("--format", choices=("auto", "chat_template", "human_assistant"), default="auto",
                        help="conversation format: the tokenizer's chat template when it has one (auto), or "
                             "the ' Human: ... Assistant:' text that dschat's step scripts train on")
    parser.add_argument("--device", default="auto", help="auto (GPU when available), cpu, cuda, cuda:1, ...")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """The chat loop: load the model once, then read a line per turn until ``quit`` or the end of
    the input; ``clear`` forgets the conversation, a blank line is no turn (the prompt again)."""
    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 1:
        raise UserError("--max_new_tokens must be at least 1")
    check_seed(args.seed)
    if args.sample:
        check_sampling(args.temperature, args.top_p, greedy="drop --sample")
    model, tokenizer, device = load(args.path, args.device, args.format, args.max_new_tokens)
    import torch  # lazy, as every heavy import in this file (load() has imported it)

    conversation = Conversation(tokenizer, args.format)
    # Sampling draws from torch's generators only (every CUDA device's too); transformers.set_seed
    # would also import transformers.trainer_utils, and with it peft and bitsandbytes.
    torch.manual_seed(args.seed)
    num_rounds = 0
    while True:
        try:
            user_text = input(PROMPT)
        except EOFError:  # end of piped input or Ctrl-D
            print()
            break
        except KeyboardInterrupt:  # Ctrl-C at the prompt: the end of the chat, as the shell's
            print()
            raise SystemExit(130) from None
        except UnicodeDecodeError:  # a strict UTF-8 locale: the line is lost, the conversation is not
            print("(that line is not UTF-8 text; type it again)", flush=True)
            continue
        # Bytes that are not UTF-8 (read with surrogateescape) become U+FFFD: a tokenizer refuses lone surrogates.
        user_text = user_text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        if not user_text.strip():  # a blank line asks nothing: no turn, no history, the prompt again
            continue
        if user_text.strip() == "quit":
            break
        if user_text.strip() == "clear":
            conversation.clear()
            num_rounds = 0
            print("(memory cleared)", flush=True)
            continue
        num_rounds += 1
        print("-" * 30 + f" Round {num_rounds} " + "-" * 30, flush=True)
        before = conversation.snapshot()
        try:
            reply(model, tokenizer, device, conversation, user_text, args)
        except KeyboardInterrupt:  # Ctrl-C while the answer is written: the turn is dropped, the chat goes on
            conversation.restore(before)
            num_rounds -= 1
            print("\n(interrupted: that turn is forgotten; type 'quit' to leave)", flush=True)
        except Exception as err:  # the chat template's own refusal (jinja's raise_exception) of the conversation
            if not type(err).__module__.startswith("jinja2"):
                raise
            conversation.restore(before)
            num_rounds -= 1
            print(f"(the chat template refused the conversation: {err}; that turn is forgotten; type 'clear' to "
                  "start over)", flush=True)


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
