"""What a reward model of another tokenizer reads: an answer's text rendered and tokenised its way.

A reward model whose tokenizer differs from the actor's (another family, another vocabulary) cannot
read the actor's token ids. Each (prompt, answer) is decoded with the actor's tokenizer, rendered as
text for the reward model (:func:`reward_text`), tokenised with its tokenizer and cut to its maximum
length keeping the end (:func:`encode_for_reward`): the score is read at the last token.

* A Hugging Face sequence classifier (``template``: ``RewardModel.reads_chat_template``) whose
  tokenizer has a chat template (``tokenizer.chat_template``): the conversation rendered by that
  template, which closes the turn itself. A prompt (and answer: an episode's turns) in a chat markup
  the actor's template wrote (ChatML, Llama 3's headers, Gemma's turns; :func:`chat_messages`) is
  read back as its messages, system and observation turns included; any other prompt is one user turn
  (upstream's ``Human: ... Assistant:`` markers of a one-turn prompt stripped) and the answer the
  assistant's.
* Otherwise (a step-2 model, whatever its tokenizer: step 2 trains on ``prompt + answer + EOS``, never
  through a template): the dataset's text, ``prompt + answer``, as they are, and the reward
  tokenizer's EOS when the answer ended with the actor's EOS; its own special tokens (a BOS) added as
  its tokenizer adds them.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import torch

__all__ = ["UNBOUNDED_LENGTH", "CHAT_MARKUPS", "chat_messages", "user_turn", "reward_text", "reward_max_length", "encode_for_reward",
           "CrossTokenizerInputs", "right_padded"]

#: transformers' ``model_max_length`` of a tokenizer that sets none (``VERY_LARGE_INTEGER``) is above this.
UNBOUNDED_LENGTH = 10**9
_ONE_TURN = re.compile(r"^\s*Human:\s*(?P<user>.*?)\s*Assistant:\s*$", re.DOTALL)


def user_turn(prompt: str) -> str:
    """The user's words of a prompt: a one-turn ``Human: X Assistant:`` prompt (upstream's datasets)
    gives ``X``; any other prompt is kept whole, stripped of surrounding whitespace."""
    match = _ONE_TURN.match(prompt)
    if match and "Human:" not in match.group("user") and "Assistant:" not in match.group("user"):
        return match.group("user")
    return prompt.strip()


#: Chat markups a template writes turns in: (a turn's start, the end of its role, a turn's end).
CHAT_MARKUPS = (
    ("<|im_start|>", "\n", "<|im_end|>"),  # ChatML: SmolLM2, Qwen
    ("<|start_header_id|>", "<|end_header_id|>\n\n", "<|eot_id|>"),  # Llama 3
    ("<start_of_turn>", "\n", "<end_of_turn>"),  # Gemma ("model" is the assistant)
)
_ROLE = re.compile(r"^[A-Za-z_]+$")


def chat_messages(text: str) -> list[dict[str, str]] | None:
    """The messages of a conversation written in one of :data:`CHAT_MARKUPS` (special tokens kept),
    ending with the assistant's (unfinished) turn: the prompt's generation prompt and the answer, or an
    episode's last turn; None when ``text`` is in none of them. What comes before the first turn (a
    BOS) is dropped."""
    for start, role_end, end in CHAT_MARKUPS:
        if start not in text:
            continue
        messages = []
        for turn in text.split(start)[1:]:
            role, found, rest = turn.partition(role_end)
            if not found or not _ROLE.match(role):
                return None
            messages.append({"role": "assistant" if role == "model" else role, "content": rest.split(end, 1)[0]})
        return messages if messages[-1]["role"] == "assistant" else None
    return None


def reward_text(tokenizer: Any, prompt: str, answer: str, ended: bool, *, template: bool = True,
                marked: str | None = None) -> tuple[str, bool]:
    """The text the reward model reads, and whether its chat template rendered it (then it holds its
    special tokens already). ``ended``: the answer ended with the actor's EOS; ``template``: the model
    reads its tokenizer's chat template, where there is one (a sequence classifier's); ``marked``: the
    prompt and answer with their special tokens (default ``prompt + answer``), read for a chat markup
    (:func:`chat_messages`). A template that refuses those turns gets them as alternating user and
    assistant turns, and one that refuses those the user turn and the answer."""
    if template and getattr(tokenizer, "chat_template", None):
        pair = [{"role": "user", "content": user_turn(prompt)}, {"role": "assistant", "content": answer}]
        messages = chat_messages(prompt + answer if marked is None else marked) or pair
        # A template's refusal (Gemma's of a system turn, or of roles that do not alternate): the
        # conversation in user and assistant turns, then the one pair every template takes.
        for tried in (messages, _alternating(messages)):
            try:
                return tokenizer.apply_chat_template(tried, tokenize=False), True
            except Exception:  # noqa: BLE001 -- the template's own check (jinja's raise_exception)
                continue
        return tokenizer.apply_chat_template(pair, tokenize=False), True
    suffix = tokenizer.eos_token if ended and tokenizer.eos_token else ""
    return prompt + answer + suffix, False


def _alternating(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """``messages`` as user and assistant turns that alternate, a user's first: a system turn's words at
    the start of the next user turn (a user turn of their own before an assistant's), any other role's
    (an episode's ``tool`` observation) a user turn, and turns of one role in a row joined."""
    turns: list[dict[str, str]] = []
    system: list[str] = []
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "system":
            system.append(content)
            continue
        role = "assistant" if role == "assistant" else "user"
        if role == "assistant" and (system or not turns):  # the turns open with a user's
            turns.append({"role": "user", "content": "\n\n".join(system)})
            system = []
        if role == "user" and system:
            content, system = "\n\n".join([*system, content]), []
        if turns and turns[-1]["role"] == role:
            turns[-1] = {"role": role, "content": f"{turns[-1]['content']}\n\n{content}"}
        else:
            turns.append({"role": role, "content": content})
    return turns


def reward_max_length(tokenizer: Any, config: Any) -> int | None:
    """The most tokens the reward model reads: the smaller of its positions
    (``max_position_embeddings``) and its tokenizer's ``model_max_length``; None when neither is set."""
    limits = [getattr(config, "max_position_embeddings", None), getattr(tokenizer, "model_max_length", None)]
    limits = [int(n) for n in limits if isinstance(n, int) and 0 < n < UNBOUNDED_LENGTH]
    return min(limits) if limits else None


def encode_for_reward(tokenizer: Any, prompt: str, answer: str, ended: bool, max_length: int | None, *,
                      template: bool = True, marked: str | None = None) -> list[int]:
    """The reward model's token ids of (prompt, answer): :func:`reward_text` (``template``, ``marked``:
    see there) tokenised by ``tokenizer``, the last ``max_length`` ids kept (the end score is read at
    the last one)."""
    text, templated = reward_text(tokenizer, prompt, answer, ended, template=template, marked=marked)
    ids = tokenizer(text, add_special_tokens=not templated)["input_ids"]
    return ids[-max_length:] if max_length else ids


class CrossTokenizerInputs:
    """A rollout batch of the actor's token ids re-tokenised for a reward model of another tokenizer.

    ``actor_tokenizer`` decodes; ``reward_tokenizer`` encodes (:func:`encode_for_reward`), at most
    ``max_length`` tokens a row. An answer ended when its last real token is one of ``end_ids`` (the
    rollout's end ids, :func:`dschat.models.tokenizer.end_token_ids`; default the actor tokenizer's EOS).
    ``template``: the reward model reads its tokenizer's chat template (:func:`reward_text`)."""

    def __init__(self, actor_tokenizer: Any, reward_tokenizer: Any, max_length: int | None,
                 end_ids: Sequence[int] | None = None, *, template: bool = True) -> None:
        self.template = template
        # Only a template reads the rows' text with special tokens (for a chat markup): decoded only then.
        self.reads_template = template and bool(getattr(reward_tokenizer, "chat_template", None))
        self.actor_tokenizer = actor_tokenizer
        self.reward_tokenizer = reward_tokenizer
        self.max_length = max_length
        self.end_ids = tuple(end_ids) if end_ids is not None else (actor_tokenizer.eos_token_id,)

    def rows(self, seq: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int) -> list[list[int]]:
        """The reward model's ids of each row of ``seq`` (B, L): a left-padded prompt of ``prompt_length``
        columns, then the answer; ``attention_mask`` (B, L) marks the real tokens of both."""
        rows = []
        for row, mask in zip(seq.tolist(), attention_mask.bool().tolist()):
            prompt = [t for t, m in zip(row[:prompt_length], mask[:prompt_length]) if m]
            answer = [t for t, m in zip(row[prompt_length:], mask[prompt_length:]) if m]
            # The answer's real tokens end at an end id when it ended (an episode's turns end so too:
            # only the last one decides, and the whole conversation after the prompt is scored).
            ended = bool(answer) and answer[-1] in self.end_ids
            if ended:
                answer = answer[:-1]
            marked = self.actor_tokenizer.decode(prompt + answer) if self.reads_template else None
            rows.append(encode_for_reward(
                self.reward_tokenizer, self.actor_tokenizer.decode(prompt, skip_special_tokens=True),
                self.actor_tokenizer.decode(answer, skip_special_tokens=True), ended, self.max_length,
                template=self.template, marked=marked))
        return rows

    def __call__(self, seq: torch.Tensor, attention_mask: torch.Tensor,
                 prompt_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, mask)`` (B, T'), right-padded with the reward tokenizer's pad, on ``seq``'s device."""
        return right_padded(self.rows(seq, attention_mask, prompt_length), self.reward_tokenizer.pad_token_id,
                            seq.device)


def right_padded(rows: Sequence[Sequence[int]], pad_id: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` (B, max row length) of token rows, right-padded with ``pad_id``."""
    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, :len(row)] = 1
    return ids.to(device), mask.to(device)
