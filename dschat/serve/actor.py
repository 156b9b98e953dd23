"""An actor (a causal LM) answering requests: loading it, and the batching worker that decodes them.

* :func:`resolve_actor` / :func:`load_actor_engine`: MODEL as a causal LM -- a step-1 or step-3 output
  folder (a step-3 output root means its ``actor/``), a registry name (``tiny-opt``, ``smollm2-135m``),
  a hub id, or a PEFT LoRA adapter folder (its base built and the adapter merged) -- loaded as step 3
  builds its actor (:func:`dschat.models.build.create_hf_model`, fp32) with its own tokenizer.
* :class:`Job`: one prompt to answer (token ids, ``max_tokens``, stop strings, decoding settings,
  an optional seed) and ``emit``, through which the worker reports :class:`Delta` text pieces and
  one final :class:`Done` (or :class:`Failed`).
* :class:`Batcher`: a background thread. It takes the oldest waiting job, waits up to
  ``max_wait_s`` for more, and decodes together up to ``max_batch_size`` waiting jobs that share its
  decoding settings (greedy, or temperature / top-k / top-p); jobs with other settings wait for a
  later batch, in arrival order. A job with a seed is decoded alone, after ``torch.manual_seed(seed)``.
* :func:`decode_batch`: the decoding loop of :func:`dschat.rlhf.rollout.sample_loop.sample_loop`
  (left-padded prompts, position ids from the mask, one forward per token with a ``DynamicCache``,
  :func:`~dschat.rlhf.rollout.sampling.next_token_scores` and
  :func:`~dschat.rlhf.rollout.sampling.draw`), stepping each row on its own: a row ends at EOS
  (``stop``; the EOS is counted, not shown), at the first stop string in its text (``stop``; the text
  is cut before it) or after its own ``max_tokens`` (``length``), and its text is emitted as it grows.
  Text that could still be the start of a stop string, or ends in an incomplete character, is held
  back until it cannot; the pieces emitted for a row join to its final text.
"""
from __future__ import annotations

import inspect
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from dschat.errors import UserError
from dschat.eval.scoring import pick_device
from dschat.models.build import create_hf_model
from dschat.models.registry import load_config, resolve_model_path
from dschat.models.tokenizer import load_hf_tokenizer
from dschat.rlhf.rollout.sampling import DecodingSettings, draw, next_token_scores

__all__ = ["ActorEngine", "Batcher", "Delta", "Done", "Failed", "Job", "decode_batch", "load_actor_engine",
           "resolve_actor"]


# ------------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------------
def resolve_actor(model: str) -> str:
    """The folder (or hub id) of the causal LM ``model`` names; one :class:`UserError` line otherwise."""
    folder = Path(model).expanduser()
    if folder.is_dir() and not (folder / "config.json").is_file():
        if (folder / "actor" / "config.json").is_file():  # a step-3 output root
            return str(folder / "actor")
        if not (folder / "adapter_config.json").is_file():
            raise UserError(f"{folder} is not a model folder (no config.json); pass a step-1 or step-3 actor "
                            "folder, a step-2 reward model, a PEFT adapter folder or a registry name (tiny-opt)")
    resolved = resolve_model_path(model)
    architectures = getattr(load_config(resolved), "architectures", None) or []
    if architectures and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        raise UserError(f"{model} holds a {', '.join(architectures)}, not a causal language model; serve a "
                        "step-1 or step-3 actor folder or a step-2 reward model")
    return resolved


@dataclass
class ActorEngine:
    """A loaded actor: ``model`` (eval mode), ``tokenizer``, ``max_positions`` (prompt + answer tokens
    the model takes) and ``name`` (the model id the server answers to). The tokenizer is used under a
    lock: requests are encoded on the server's event loop while the worker decodes answers."""

    name: str
    folder: str
    model: Any = field(repr=False)
    tokenizer: Any = field(repr=False)
    max_positions: int
    _tokenizer_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, prompt: str) -> list[int]:
        """A completion prompt's token ids (the tokenizer's special tokens added, as ``tokenizer(prompt)``)."""
        with self._tokenizer_lock:
            return list(self.tokenizer(prompt)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        """Answer tokens as text, special tokens left out."""
        with self._tokenizer_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation's token ids through the chat template, ready for the assistant's turn."""
        with self._tokenizer_lock:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding in some versions
            ids = ids["input_ids"]
        return list(ids)


def load_actor_engine(model: str, *, device: str = "auto") -> ActorEngine:
    """The actor ``model`` names (see :func:`resolve_actor`) on ``device`` ("auto": the GPU if there is one)."""
    folder = resolve_actor(model)
    tokenizer = load_hf_tokenizer(folder)
    net = create_hf_model(AutoModelForCausalLM, folder, tokenizer).to(pick_device(device)).eval()
    limit = getattr(net.config, "max_position_embeddings", None) or tokenizer.model_max_length
    return ActorEngine(model, folder, net, tokenizer, int(limit))


# ------------------------------------------------------------------------------------------------
# Jobs and what the worker reports
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Delta:
    text: str


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (max_tokens)
    prompt_tokens: int
    completion_tokens: int  # tokens decoded, the ending EOS included


@dataclass(frozen=True)
class Failed:
    message: str


@dataclass(eq=False)
class Job:
    """One prompt to answer. ``emit`` is called from the worker thread (it must be thread-safe)."""

    prompt_ids: list[int]
    max_tokens: int
    stop: tuple[str, ...]
    settings: DecodingSettings
    emit: Callable[[Delta | Done | Failed], None]
    seed: int | None = None
    cancelled: bool = False  # set by the client's side: the worker ends the row at its next token

    @property
    def key(self) -> tuple[DecodingSettings, int | None]:
        """Jobs of one batch share this."""
        return self.settings, self.seed


@dataclass(eq=False)
class _Row:
    job: Job
    tokens: list[int] = field(default_factory=list)
    count: int = 0
    sent: int = 0
    done: bool = False


def _held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of ``text`` may still change: an incomplete character, or the
    longest suffix that is a proper prefix of a stop string."""
    if text.endswith("\ufffd"):
        return len(text) - len(text.rstrip("\ufffd"))
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def _step(row: _Row, token: int, eos: int, engine: ActorEngine) -> None:
    """Row ``row`` gets ``token``: emit the text it adds and end the row when it should."""
    job = row.job
    row.count += 1
    if token == eos:
        finish = "stop"
        text = engine.decode(row.tokens)
    else:
        row.tokens.append(token)
        text = engine.decode(row.tokens)
        cuts = [i for i in (text.find(stop) for stop in job.stop) if i >= 0]
        if cuts:
            finish, text = "stop", text[: min(cuts)]
        elif row.count >= job.max_tokens or job.cancelled:
            finish = "length"
        else:
            safe = len(text) - _held_back(text, job.stop)
            if safe > row.sent:
                job.emit(Delta(text[row.sent:safe]))
                row.sent = safe
            return
    if len(text) > row.sent:
        job.emit(Delta(text[row.sent:]))
    row.done = True
    job.emit(Done(finish, len(job.prompt_ids), row.count))


@torch.inference_mode()
def decode_batch(engine: ActorEngine, jobs: Sequence[Job]) -> None:
    """Decode ``jobs`` (one :attr:`Job.key`) together, reporting through each job's ``emit``.

    The prompts are left-padded into one ``(B, P)`` batch; each step decodes one ``(B,)`` column and
    rows that have ended get the pad token until every row has ended."""
    model, tokenizer = engine.model, engine.tokenizer
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    settings, seed = jobs[0].key
    device = next(model.parameters()).device
    width = max(len(job.prompt_ids) for job in jobs)
    ids = torch.full((len(jobs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(jobs), width), dtype=torch.long)
    for i, job in enumerate(jobs):
        ids[i, width - len(job.prompt_ids):] = torch.tensor(job.prompt_ids, dtype=torch.long)
        mask[i, width - len(job.prompt_ids):] = 1
    ids, mask = ids.to(device), mask.to(device)
    if seed is not None:
        torch.manual_seed(seed)
    accepted = set(inspect.signature(model.forward).parameters)
    extra: dict[str, Any] = {"use_cache": True}
    if "logits_to_keep" in accepted:
        extra["logits_to_keep"] = 1
    position = None
    if "position_ids" in accepted:
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # (B, P), as generate derives them
        extra["position_ids"], position = positions, positions[:, -1:]
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=ids, attention_mask=mask, past_key_values=cache, **extra).logits[:, -1].float()
    rows = [_Row(job) for job in jobs]
    for _ in range(max(job.max_tokens for job in jobs)):
        scores = next_token_scores(logits, settings, eos, suppress_eos=False)  # (B, V)
        token = draw(torch.softmax(scores, dim=-1)) if settings.sample else torch.argmax(scores, dim=-1)  # (B,)
        for row, value in zip(rows, token.tolist()):
            if not row.done:
                _step(row, value, eos, engine)
        if all(row.done for row in rows):
            return
        ended = torch.tensor([row.done for row in rows], device=device)
        token = token.masked_fill(ended, pad)
        mask = torch.cat([mask, mask.new_ones((len(jobs), 1))], dim=-1)
        if position is not None:
            position = position + 1
            extra["position_ids"] = position
        logits = model(input_ids=token[:, None], attention_mask=mask, past_key_values=cache,
                       **extra).logits[:, -1].float()


# ------------------------------------------------------------------------------------------------
# The batching worker
# ------------------------------------------------------------------------------------------------
class Batcher:
    """Decodes submitted jobs on one background thread, batching those that wait (see the module
    docstring). :meth:`submit` never blocks; a batch that raises reports :class:`Failed` to each of its
    jobs still running and the worker goes on."""

    def __init__(self, engine: ActorEngine, max_batch_size: int, max_wait_s: float) -> None:
        self.engine, self.max_batch_size, self.max_wait_s = engine, max_batch_size, max_wait_s
        self._waiting: list[Job] = []
        self._ready = threading.Condition()
        self.batch_sizes: list[int] = []  # every batch decoded, in order (for tests and benchmarks)
        threading.Thread(target=self._run, name="dschat-serve-decode", daemon=True).start()

    def submit(self, job: Job) -> None:
        with self._ready:
            self._waiting.append(job)
            self._ready.notify()

    def _take(self) -> list[Job]:
        """The next batch: the oldest job and, after waiting up to ``max_wait_s`` for the batch to fill,
        the other waiting jobs with its key (one job when it has a seed)."""
        with self._ready:
            while not self._waiting:
                self._ready.wait()
            key = self._waiting[0].key
            limit = 1 if key[1] is not None else self.max_batch_size
            deadline = time.monotonic() + self.max_wait_s
            while sum(job.key == key for job in self._waiting) < limit and (left := deadline - time.monotonic()) > 0:
                self._ready.wait(left)
            batch = [job for job in self._waiting if job.key == key][:limit]
            self._waiting = [job for job in self._waiting if job not in batch]
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            self.batch_sizes.append(len(batch))
            try:
                decode_batch(self.engine, batch)
            except Exception as err:  # noqa: BLE001 - reported to the requests; the server goes on
                for job in batch:
                    job.emit(Failed(f"decoding failed: {type(err).__name__}: {err}"))
