"""Multi-turn episodes (``--env``): the actor answers, the environment replies, the actor answers again.

:class:`EpisodePlayer` plays the episodes of one batch of prompts through the
:class:`~dschat.rlhf.rollout.generator.RolloutGenerator` -- every decoding path it has (dschat's Hybrid
Engine, graphs, the sample loop, Hugging Face ``generate``; ZeRO-3 and LoRA as for one answer) -- and
the environments of :mod:`dschat.envs`. Each turn:

1. **generate**: every live episode's whole conversation so far (prompt, the actor's turns, the
   observations), left-padded, is a prompt for the generator. Where the generator decodes with the
   dschat loop, dschat's Hybrid Engine or CUDA graphs, it continues the batch's KV cache instead (a
   :class:`~dschat.rlhf.rollout.conversation.Conversation`: each row feeds only its tokens not yet
   cached -- its observation and the turn's last sampled token -- and every token keeps the position
   it has in its conversation); other paths prefill the whole conversation again (said once, with
   why). ``reuse_kv = False`` always prefills again;
2. **step**: each live environment gets the turn's text (decoded without special tokens),
   concurrently (:class:`~dschat.envs.EpisodeBatch`);
3. **observe**: an episode that goes on gets its observation appended
   (:func:`~dschat.envs.render_observation`: through the chat template as a user or tool message
   where the tokenizer has one, else as text). A turn ends at any of the generator's ``end_ids``
   ("EOS" below; for episodes they include the template's end of turn). When the rendered
   observation begins with the end id the actor's turn ended with (the template's end of the
   assistant turn), the observation's copy is left out, so the conversation is exactly what the
   template makes of it and the EOS stays the actor's action.

An episode ends when its environment says done, after ``max_turns`` turns, or when it reaches
``max_answer_seq_len`` tokens after the prompt (actor and observation tokens together); the last two
are **cut** (a turn that ends without EOS also cuts its episode, even one its environment ends:
it ran out of room). The environment is stepped with a cut turn too, so its reward counts, and a
one-turn environment gives the same episode as the single answer it replaces.

The result (:class:`Episodes`) is one sequence per episode, ``[left-padded prompt | episode | right
padding]``, with an observation mask: only the actor's tokens are actions.

**Collectives.** The generator's rollouts are collective (ZeRO-3 gathers, tensor-parallel groups), so
every rank plays the same number of turns: a rank whose episodes are all done generates for one
placeholder row (with a kept KV cache: its ended rows, which decode nothing) and discards it, until
no rank has a live episode. The turn's token budget is agreed over the ranks, so is whether the
decoder's log-probs are kept, and a failing environment (a :class:`~dschat.errors.UserError` line)
stops every rank together before the next collective; so does an observation the tokenizer fails on.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from dschat.envs import EnvironmentFactory, EpisodeBatch, observation_parts
from dschat.errors import UserError, raised
from dschat.rlhf.experience import raise_together
from dschat.rlhf.rollout.generator import RolloutGenerator
from dschat.rlhf.rollout.conversation import Conversation
from dschat.runtime.dist import gather_ints

__all__ = ["Episodes", "EpisodePlayer"]

_ENV = "an environment"  # what another rank's line says failed (raise_together)


@dataclass(frozen=True)
class Episodes:
    """One batch of played episodes (``B`` rows). ``P`` is the prompts' width, ``A`` the longest
    episode (``A <= max_answer_seq_len``)."""

    sequences: torch.Tensor  # (B, P + A) left-padded prompts, then each episode's tokens, then pad ids
    attention_mask: torch.Tensor  # (B, P + A) 1 on the prompt's and the episode's tokens
    observation_mask: torch.Tensor  # (B, P + A) 1 on the environment's tokens (never on the prompt)
    # (B, A) fp32 log-probs of the actor's tokens as sampled (logits / temperature); 0 on observation
    # tokens; after an episode shorter than A, those the decoder gave the pad ids it went on with (0
    # past them). None when a decoding path kept none, or did not give an episode's reward slot (the
    # first position after it): then the trainer runs the actor.
    logprobs: torch.Tensor | None
    ended: torch.Tensor  # (B,) bool: the last actor turn ended with EOS
    env_reward: torch.Tensor  # (B,) float32: the sum of the turns' rewards (None counts 0)
    turns: torch.Tensor  # (B,) int64: actor turns played
    cut: torch.Tensor  # (B,) bool: ended by max_turns or the length limit (a last turn without EOS included)
    env_seconds: float  # wall time spent in the environments' calls

    prompt_width: int  # P

    @property
    def actor_tokens(self) -> torch.Tensor:
        """(B,) int64: the actor's tokens of each episode."""
        P = self.prompt_width
        return (self.attention_mask[:, P:].long() - self.observation_mask[:, P:].long()).sum(1)


def _left_padded(rows: Sequence[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` of token ids -> (ids, mask), both (len(rows), max length), left-padded with ``pad_id``."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device)


@contextmanager
def _answer_budget(generator: RolloutGenerator, tokens: int) -> Iterator[None]:
    """The generator decodes at most ``tokens`` new tokens inside (every path reads the attribute per call)."""
    saved = generator.max_answer_seq_len
    generator.max_answer_seq_len = tokens
    try:
        yield
    finally:
        generator.max_answer_seq_len = saved


class EpisodePlayer:
    """Plays ``--env`` episodes with ``generator`` (see the module docstring).

    ``max_answer_seq_len`` bounds an episode's tokens after the prompt; ``max_context`` (the prompt
    and answer lengths together: what the decoding engines are sized for) bounds one turn's whole
    context and its answer.
    """

    def __init__(self, generator: RolloutGenerator, tokenizer: PreTrainedTokenizerBase, factory: EnvironmentFactory,
                 *, max_turns: int, max_answer_seq_len: int, max_context: int) -> None:
        self.generator = generator
        self.tokenizer = tokenizer
        self.factory = factory
        self.max_turns = max_turns
        self.max_answer_seq_len = max_answer_seq_len
        self.max_context = max_context
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.reuse_kv = True  # continue the conversation's KV cache where the decoding path can
        # The texts the tokenizer reads as special tokens (not to be forged by an observation's content).
        self._specials = [token.content for token in getattr(tokenizer, "added_tokens_decoder", {}).values()
                          if token.special and token.content]

    def observation_ids(self, observation: Any, ended_on: int | None) -> list[int]:
        """The token ids appended for ``observation`` after an actor turn (``ended_on``: the end id the
        turn's last token is, such as an ``<|eot_id|>`` of the generation config; None: the turn was cut).
        The rendered observation begins with the template's close of the answer; where that is the
        token the turn ended on, it is left out, so the end of turn is not repeated.

        The rendered text (:func:`~dschat.envs.observation_parts`) is tokenised whole, as the chat
        template would be; but where the observation's content holds the text of a special token (a
        tool's output quoting chat markup, an EOS), the content is tokenised as plain text between
        the template's markup before and after it, so it cannot forge a turn or end one."""
        before, content, after = observation_parts(observation, self.tokenizer)
        if not (before or content or after):
            return []
        if any(special in content for special in self._specials):
            pieces = [(before, False), (content, True), (after, False)]
            ids = [token for piece, plain in pieces if piece for token in
                   self.tokenizer(piece, add_special_tokens=False, split_special_tokens=plain)["input_ids"]]
        else:
            ids = list(self.tokenizer(before + content + after, add_special_tokens=False)["input_ids"])
        if ended_on is not None and ids and ids[0] == ended_on:
            ids = ids[1:]
        return ids

    def _step(self, batch: EpisodeBatch, live: list[int], waiting: list[int], texts: list[str | None],
              tokens: list[list[int]], ended: list[bool]) -> dict[int, list[int]]:
        """Step the turn's environments, end the episodes that are out of room, and tokenise the
        observation of each episode that goes on (by episode index). A failure of either is one
        :class:`~dschat.errors.UserError` line, for :func:`~dschat.rlhf.experience.raise_together`."""
        results = batch.step(texts, waiting=waiting)
        observed = {}
        for i in live:
            state = batch.states[i]
            if i in waiting:
                continue
            if not ended[i]:
                state.done = state.cut = True  # the turn ran out of room: cut, whatever the environment said
            elif not state.done and len(tokens[i]) >= self.max_answer_seq_len:
                state.done = state.cut = True  # no room for another turn
            if state.done:
                continue
            try:
                # The rendered observation may repeat the end-of-turn token the turn ended with.
                observed[i] = self.observation_ids(results[i].observation, tokens[i][-1] if ended[i] else None)
            except Exception as err:  # noqa: BLE001 -- the environment's text; every rank is to stop together
                raise UserError(f"environment {self.factory.name} {state.where(state.turns)}: the "
                                f"tokenizer failed on its observation ({raised(err)}); return "
                                "plain text the tokenizer takes") from err
        return observed

    def play(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, rows: Sequence[Mapping[str, Any]],
             row_ids: Sequence[int] | None = None) -> Episodes:
        """Play one episode per prompt row. Shapes: prompts, prompt_mask (B, P) left-padded; ``rows``:
        the B dataset rows (their environments' factory input). Collective (every rank calls it)."""
        B, P = prompts.shape
        device = prompts.device
        batch = raise_together(lambda: EpisodeBatch(self.factory, rows, self.max_turns, row_ids), _ENV)
        prompt_rows = [row[m.bool()].tolist() for row, m in zip(prompts.cpu(), prompt_mask.cpu())]
        tokens: list[list[int]] = [[] for _ in range(B)]  # each episode's tokens after the prompt
        roles: list[list[int]] = [[] for _ in range(B)]  # 1 = observation token
        logprobs: list[list[float]] | None = [[] for _ in range(B)]
        tails: list[list[float]] = [[] for _ in range(B)]  # the latest turn's log-probs after its EOS
        turn_start = [0] * B  # where each episode's current turn began in its tokens
        ended = [False] * B
        conversation = Conversation(limit=self.max_context) if self.reuse_kv else None
        while True:
            live = [i for i, s in enumerate(batch.states) if not s.done]
            contexts = [prompt_rows[i] + tokens[i] for i in live] or [prompt_rows[0]]  # a placeholder row
            remaining = max((self.max_answer_seq_len - len(tokens[i]) for i in live), default=0)
            headroom = self.max_context - max(len(c) for c in contexts)
            everyone = gather_ints([len(live), remaining, headroom])
            if not any(r[0] for r in everyone):
                break
            budget = max(1, min(max(r[1] for r in everyone), min(r[2] for r in everyone)))
            ids, mask = _left_padded(contexts, self.pad, device)
            if conversation is not None:
                conversation.next_turn([prompt_rows[i] + tokens[i] for i in range(B)],
                                       [not s.done for s in batch.states], self.pad)
            with _answer_budget(self.generator, budget):
                rollout = self.generator.rollout(ids, mask, conversation=conversation)
            reused = conversation is not None and conversation.reused
            # The rollout's row of each live episode: one per episode when the cache was continued.
            at = list(live) if reused else list(range(len(live)))
            width = conversation.width if reused else ids.shape[1]
            answers = rollout.sequences[:, width:].tolist()
            kept_lp = None if rollout.logprobs is None else rollout.logprobs.float().cpu().tolist()
            if kept_lp is None:
                logprobs = None
            texts: list[str | None] = [None] * B
            waiting = []  # turns the shared budget stopped before their own room ran out: they go on
            taken = [0] * B  # each row's answer tokens its conversation took
            for j, i in zip(at, live):
                whole = _until_end(answers[j], self.generator.end_ids)
                part = whole[: self.max_answer_seq_len - len(tokens[i])]
                ended[i] = bool(part) and part[-1] in self.generator.end_ids
                taken[i] = len(part)
                tokens[i] += part
                roles[i] += [0] * len(part)
                if logprobs is not None:
                    logprobs[i] += kept_lp[j][: len(part)]
                    # After an EOS the decoder went on with pad ids: their log-probs are the episode's
                    # if it ends here (the first is the reward slot's KL term, as for one answer).
                    tails[i] = kept_lp[j][len(part):] if len(part) == len(whole) else []
                if not ended[i] and len(part) == len(whole) == budget and len(tokens[i]) < self.max_answer_seq_len:
                    waiting.append(i)  # another row's context or room set this turn's budget
                    continue
                texts[i] = self.tokenizer.decode(tokens[i][turn_start[i]:], skip_special_tokens=True)
            if reused:
                conversation.keep(taken)
            # Every rank, its placeholder turn too.
            observed = raise_together(lambda: self._step(batch, live, waiting, texts, tokens, ended), _ENV)
            for i in live:
                state = batch.states[i]
                if i in waiting or state.done:
                    continue
                obs = observed[i]
                if len(obs) >= self.max_answer_seq_len - len(tokens[i]):
                    # No room for the actor after it: the episode ends with the actor's turn (its
                    # reward slot stays after the actor's last token).
                    state.done = state.cut = True
                    continue
                tails[i] = []
                tokens[i] += obs
                roles[i] += [1] * len(obs)
                if logprobs is not None:
                    logprobs[i] += [0.0] * len(obs)
                turn_start[i] = len(tokens[i])
        if conversation is not None:
            conversation.drop()  # its KV cache is freed before the batch is scored
        # An episode shorter than the batch has a reward slot after its last token; where the decoder
        # stopped with that turn it gave no log-prob there, and the actor scores the batch instead.
        # Every rank does the same (that scoring pass is collective under ZeRO-3).
        A = max(1, max(len(t) for t in tokens))
        unknown = logprobs is None or any(len(t) < A and not tail for t, tail in zip(tokens, tails))
        if any(r[0] for r in gather_ints([int(unknown)])):
            logprobs = None
        return self._assemble(prompts, prompt_mask, tokens, roles, logprobs, tails, ended, batch)

    def _assemble(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, tokens: list[list[int]],
                  roles: list[list[int]], logprobs: list[list[float]] | None, tails: list[list[float]],
                  ended: list[bool], batch: EpisodeBatch) -> Episodes:
        B, P = prompts.shape
        device = prompts.device
        A = max(1, max(len(t) for t in tokens))
        episode = torch.full((B, A), self.pad, dtype=prompts.dtype)
        real = torch.zeros((B, A), dtype=torch.long)
        observed = torch.zeros((B, A), dtype=torch.long)
        kept = torch.zeros((B, A), dtype=torch.float32)
        for i in range(B):
            n = len(tokens[i])
            episode[i, :n] = torch.tensor(tokens[i], dtype=prompts.dtype)
            real[i, :n] = 1
            observed[i, :n] = torch.tensor(roles[i], dtype=torch.long)
            if logprobs is not None:
                row = (logprobs[i] + tails[i])[:A]
                kept[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
        prompt_mask = prompt_mask.to(device).long()
        states = batch.states
        return Episodes(
            sequences=torch.cat([prompts, episode.to(device)], dim=1),
            attention_mask=torch.cat([prompt_mask, real.to(device)], dim=1),
            observation_mask=torch.cat([torch.zeros_like(prompt_mask), observed.to(device)], dim=1),
            logprobs=None if logprobs is None else kept.to(device),
            ended=torch.tensor(ended, dtype=torch.bool, device=device),
            env_reward=torch.tensor([s.reward for s in states], dtype=torch.float32, device=device),
            turns=torch.tensor([s.turns for s in states], dtype=torch.long, device=device),
            cut=torch.tensor([s.cut for s in states], dtype=torch.bool, device=device),
            env_seconds=batch.total_seconds, prompt_width=P,
        )


def _until_end(answer: list[int], end_ids: Sequence[int]) -> list[int]:
    """A generated row up to and including its first end id (all of it when there is none)."""
    first = next((k for k, token in enumerate(answer) if token in end_ids), None)
    return answer if first is None else answer[: first + 1]
