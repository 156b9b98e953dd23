"""An actor (a causal LM) answering requests: loading it, and the batching worker that decodes them
through step 3's own decoding loops.

* :func:`resolve_actor` / :func:`load_actor_engine`: MODEL as a causal LM -- a step-1 or step-3 output
  folder (a step-3 output root means its ``actor/``), a registry name (``tiny-opt``, ``smollm2-135m``),
  a hub id, or a PEFT LoRA adapter folder (its base built and the adapter merged) -- loaded as step 3
  builds its actor (:func:`dschat.models.build.create_hf_model`, fp32) with its own tokenizer.
* :class:`Job`: one prompt to answer (token ids, ``max_tokens``, stop strings, decoding settings,
  an optional seed) and ``emit``, through which the worker reports :class:`Delta` text pieces and
  one final :class:`Done` (or :class:`Failed`).
* The decoders (``--decoding_engine``, :func:`pick_decoder`): :class:`HybridEngineDecoder`, step 3's
  :class:`~dschat.rlhf.rollout.dschat_engine.DschatHybridEngine` (``auto`` where its decode model
  covers the family), and :class:`LoopDecoder`, step 3's
  :func:`~dschat.rlhf.rollout.sample_loop.sample_loop` (every other family). Both decode a batch of
  left-padded prompts with the settings of its jobs and follow it row by row through the loop's
  ``on_step`` callback, :class:`RowFollower`: a row ends at an EOS (``stop``; the EOS is counted, not
  shown; any id of :attr:`ActorEngine.eos_ids`: the tokenizer's and the model's generation config's,
  where ``generate`` stops; a chat answer's also at :attr:`ActorEngine.turn_end`), at the first stop
  string in its text (``stop``; the text is cut before it), after its own ``max_tokens`` (``length``)
  or at the next token after its job was cancelled (its client went away; ``length``), and the loop
  pads it from there as a row that wrote EOS; decoding stops when every row has ended. A row's text
  is emitted as it grows; text that could still be the start of a stop string, or ends in an
  incomplete character, is held back until it cannot, so the pieces emitted for a row join to its
  final text.
* :class:`Batcher`: a background thread. It takes the oldest waiting job, waits up to
  ``max_wait_s`` for more, and decodes together up to ``max_batch_size`` waiting jobs that share its
  decoding settings (greedy, or temperature / top-k / top-p) and fit with it in the model's positions
  (:func:`select_batch`: widest prompt + largest ``max_tokens``, where a job whose ``max_tokens`` was
  not given, :attr:`Job.fill`, counts as one token and is then capped to the room the batch's widest
  prompt leaves, never below half of its own room); other jobs wait for a later batch, in arrival order. A job with a seed is decoded
  alone, after ``torch.manual_seed(seed)``. :func:`start_batcher` picks the decoder, warms it up on
  the worker thread and names it for the startup line.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from transformers import AutoModelForCausalLM

from dschat.errors import UserError
from dschat.eval.scoring import pick_device
from dschat.models.build import create_hf_model
from dschat.models.decoder.layouts import unsupported_reason
from dschat.models.registry import load_config, resolve_model_path
from dschat.models.tokenizer import end_token_ids, load_hf_tokenizer, template_turn_end_id
from dschat.paths import is_short_name, step3_part
from dschat.rlhf.rollout.dschat_engine import ENGINE_NAME, DschatHybridEngine
from dschat.rlhf.rollout.sample_loop import sample_loop
from dschat.rlhf.rollout.sampling import DecodingSettings
from dschat.serve.reward_scorer import encode_text

__all__ = ["ActorEngine", "Batcher", "DECODING_ENGINES", "Delta", "Done", "Failed", "HybridEngineDecoder", "Job",
           "LoopDecoder", "RowFollower", "end_ids", "engine_unsupported", "load_actor_engine", "pick_decoder",
           "resolve_actor", "select_batch", "start_batcher"]

DECODING_ENGINES = ("auto", "dschat", "loop")  # --decoding_engine


# ------------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------------
def resolve_actor(model: str) -> str:
    """The folder (or hub id) of the causal LM ``model`` names; one :class:`UserError` line otherwise."""
    folder = Path(model).expanduser()
    actor = step3_part(model, "actor")
    if actor is not None:  # a step-3 output root
        return str(actor)
    if not is_short_name(model) and folder.is_dir() and not (folder / "config.json").is_file():
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
    the model takes), ``name`` (the model id the server answers to) and ``eos_ids``: the token ids
    that end an answer, the tokenizer's EOS and every id of the model's ``generation_config``
    ``eos_token_id`` (an int or a list: e.g. an end-of-turn id), as ``generate`` stops on them;
    ``turn_end``: the token the chat template closes an answer with, which also ends a chat answer
    (:func:`~dschat.models.tokenizer.template_turn_end_id`; a base model's ChatML ``<|im_end|>``). The
    tokenizer is used under a lock: requests are encoded in the server's worker threads while the
    decoding worker decodes answers."""

    name: str
    folder: str
    model: Any = field(repr=False)
    tokenizer: Any = field(repr=False)
    max_positions: int
    eos_ids: frozenset[int]
    turn_end: int | None = None
    _tokenizer_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """The most characters text of at most ``max_positions`` tokens can have: that many times the
        longest token's string (a vocabulary entry's raw string is never shorter than the text it
        decodes to: ``Ġ`` for a space, ``<0x0A>`` for a byte). A longer prompt cannot fit, and is
        refused before it is tokenised."""
        longest = max((len(token) for token in self.tokenizer.get_vocab()), default=1)
        return self.max_positions * max(longest, 1)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, prompt: str) -> list[int]:
        """A completion prompt's token ids (the tokenizer's special tokens added, as ``tokenizer(prompt)``);
        :class:`~dschat.serve.reward_scorer.UnencodableText` for a prompt the tokenizer cannot encode
        (a lone surrogate: :func:`~dschat.serve.reward_scorer.encode_text`)."""
        with self._tokenizer_lock:
            return encode_text(self.tokenizer, prompt)

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
    engine = ActorEngine(model, folder, net, tokenizer, int(limit), end_ids(net, tokenizer),
                         template_turn_end_id(tokenizer))
    engine.max_prompt_chars  # noqa: B018 -- read the vocabulary now, before any request or the decoding worker
    return engine


def end_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """The ids that end an answer (:func:`~dschat.models.tokenizer.end_token_ids`, as step 3's rollouts)."""
    return frozenset(end_token_ids(model, tokenizer))


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
    status: int = 500  # the HTTP status the request is answered with (503: the server is shutting down)


#: What a request still open when the server begins to shut down is answered (HTTP 503).
SHUTTING_DOWN = "the server is shutting down; send the request again to a running server"


@dataclass(eq=False)
class Job:
    """One prompt to answer. ``emit`` is called from the worker thread (it must be thread-safe).

    ``fill``: ``max_tokens`` was not asked for; the answer may take as many tokens as fit. Submitted
    with ``max_tokens`` the room its own prompt leaves, it is capped by :func:`select_batch` to the
    room the widest prompt of its batch leaves."""

    prompt_ids: list[int]
    max_tokens: int
    stop: tuple[str, ...]
    settings: DecodingSettings
    emit: Callable[[Delta | Done | Failed], None]
    seed: int | None = None
    cancelled: bool = False  # set by the client's side: the worker ends the row at its next token
    fill: bool = False
    turn_end: int | None = None  # a chat answer's: ActorEngine.turn_end, an end id for this job too

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
    """How many characters at the end of ``text`` may still change: the incomplete characters
    (``"\ufffd"``) it ends with, plus the longest suffix of the text before them that is a proper
    prefix of a stop string."""
    base = text.rstrip("\ufffd")
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(base)), longest, -1):
            if base.endswith(stop[:n]):
                longest = n
                break
    return len(text) - len(base) + longest


def _step(row: _Row, token: int, eos: frozenset[int], engine: ActorEngine) -> None:
    """Row ``row`` gets ``token``: emit the text it adds and end the row when it should (``eos``: the
    ids that end it, counted and not shown)."""
    job = row.job
    row.count += 1
    if token in eos or token == job.turn_end:
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


class RowFollower:
    """The ``on_step`` callback (:data:`dschat.rlhf.rollout.sampling.StepCallback`) of one batch: row
    ``i`` answers ``jobs[i]``; rows past the jobs (filler rows of a fixed-size batch) end at the first
    step. Each step it hands every running row its token (:func:`_step`: emit text, end at an EOS of
    :attr:`ActorEngine.eos_ids`, a stop string, ``max_tokens`` or a cancelled job)
    and returns the rows that have ended."""

    def __init__(self, engine: ActorEngine, jobs: Sequence[Job], rows: int) -> None:
        self.engine, self.rows, self.width = engine, [_Row(job) for job in jobs], rows
        self.eos = engine.eos_ids

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        for row, value in zip(self.rows, token.tolist()):
            if not row.done:
                _step(row, value, self.eos, self.engine)
        ended = [row.done for row in self.rows] + [True] * (self.width - len(self.rows))
        return torch.tensor(ended, dtype=torch.bool, device=token.device)

    def close(self) -> None:
        """After the loop: a row it left running (it cannot, as its ``max_new_tokens`` is the largest
        ``max_tokens``) is reported as failed rather than left waiting."""
        for row in self.rows:
            if not row.done:
                row.done = True
                row.job.emit(Failed("decoding ended before this answer did"))


def _left_padded(jobs: Sequence[Job], pad: int, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, P)`` left-padded prompt ids and attention mask; rows past the jobs repeat the first prompt."""
    prompts = [job.prompt_ids for job in jobs] + [jobs[0].prompt_ids] * (rows - len(jobs))
    width = max(len(ids) for ids in prompts)
    ids = torch.full((rows, width), pad, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    for i, row in enumerate(prompts):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device)


# ------------------------------------------------------------------------------------------------
# The decoding engines: step 3's loops, followed row by row
# ------------------------------------------------------------------------------------------------
class LoopDecoder:
    """Step 3's sample loop (:func:`dschat.rlhf.rollout.sample_loop.sample_loop`) on the loaded model."""

    name = "loop"

    def __init__(self, engine: ActorEngine) -> None:
        self.engine = engine
        self.device = next(engine.model.parameters()).device

    def describe(self) -> str:
        return "dschat's sample loop (dschat/rlhf/rollout/sample_loop.py, on the Hugging Face model)"

    def warm_up(self) -> None:
        """Nothing to prepare."""

    @torch.no_grad()
    def decode(self, jobs: Sequence[Job]) -> None:
        """Decode ``jobs`` (one :attr:`Job.key`) together, reporting through each job's ``emit``."""
        tokenizer, (settings, seed) = self.engine.tokenizer, jobs[0].key
        prompts, mask = _left_padded(jobs, tokenizer.pad_token_id, len(jobs), self.device)
        if seed is not None:
            torch.manual_seed(seed)
        follower = RowFollower(self.engine, jobs, len(jobs))
        sample_loop(self.engine.model, prompts, mask, decoding=settings, max_new_tokens=max(j.max_tokens for j in jobs),
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, keep_logprobs=False,
                    on_step=follower)
        follower.close()


class HybridEngineDecoder:
    """Step 3's :class:`~dschat.rlhf.rollout.dschat_engine.DschatHybridEngine` with the loaded model's
    weights (copied once into its inference layout). Where its decode step is compiled (CUDA: CUDA
    graphs), every batch has ``max_batch_size`` rows and the KV cache the model's whole
    ``max_positions``, so one graph is compiled and captured (by :meth:`warm_up`, on the worker
    thread) and replayed for every batch; elsewhere (eager) a batch has as many rows as jobs."""

    name = "dschat"

    def __init__(self, engine: ActorEngine, max_batch_size: int) -> None:
        tokenizer = engine.tokenizer
        self.engine = engine
        self.device = next(engine.model.parameters()).device
        self.he = DschatHybridEngine(engine.model.config, decoding=DecodingSettings(decoding="greedy"),
                                     max_new_tokens=1, eos_token_id=tokenizer.eos_token_id,
                                     pad_token_id=tokenizer.pad_token_id)
        self.fixed_rows = max_batch_size if self.he.compiled_on(self.device) else None
        if self.fixed_rows is not None:
            self.he.cache_multiple = engine.max_positions  # one cache shape: the capacity is max_positions
        self.he.keep_packed = True  # the served weights never change: CPU oneDNN copies kept per batch size
        self.he.refresh(engine.model)

    def describe(self) -> str:
        return self.he.summary(self.device)

    @torch.no_grad()
    def warm_up(self) -> None:
        """Decode two tokens of a one-token prompt: on CUDA this compiles and captures the decode step."""
        pad = self.engine.tokenizer.pad_token_id
        first = self.engine.tokenizer.bos_token_id
        job = Job([pad if first is None else first], 2, (), DecodingSettings(decoding="greedy"), lambda event: None)
        self.he.decoding, self.he.max_new_tokens = job.settings, 2
        self.he.decode(*_left_padded([job], pad, self.fixed_rows or 1, self.device), keep_logprobs=False)

    @torch.no_grad()
    def decode(self, jobs: Sequence[Job]) -> None:
        """Decode ``jobs`` (one :attr:`Job.key`) together, reporting through each job's ``emit``."""
        (settings, seed), rows = jobs[0].key, self.fixed_rows or len(jobs)
        prompts, mask = _left_padded(jobs, self.engine.tokenizer.pad_token_id, rows, self.device)
        self.he.decoding, self.he.max_new_tokens = settings, max(job.max_tokens for job in jobs)
        if seed is not None:
            torch.manual_seed(seed)
        follower = RowFollower(self.engine, jobs, rows)
        self.he.decode(prompts, mask, keep_logprobs=False, on_step=follower)
        follower.close()


Decoder = LoopDecoder | HybridEngineDecoder


def pick_decoder(engine: ActorEngine, choice: str, max_batch_size: int) -> tuple[Decoder, str]:
    """``--decoding_engine choice`` for ``engine``'s model: the decoder and why it was picked (one phrase).

    ``auto``: dschat's Hybrid Engine where its decode model covers the family, else the sample loop;
    ``dschat``: the Hybrid Engine or one :class:`UserError` line; ``loop``: the sample loop."""
    if choice not in DECODING_ENGINES:
        raise UserError(f"--decoding_engine must be one of {', '.join(DECODING_ENGINES)}, got {choice!r}")
    if choice == "loop":
        return LoopDecoder(engine), "asked by --decoding_engine loop"
    why_not = unsupported_reason(engine.model.config)
    if why_not is not None:
        if choice == "dschat":
            raise UserError(engine_unsupported(engine.model.config, engine.name) or why_not)
        return LoopDecoder(engine), f"{ENGINE_NAME} not used: {why_not}"
    how = "asked by --decoding_engine dschat" if choice == "dschat" else "its decode model covers this family"
    return HybridEngineDecoder(engine, max_batch_size), how


def engine_unsupported(config: Any, name: str) -> str | None:
    """None when dschat's Hybrid Engine can serve a model of ``config``, else the ``--decoding_engine
    dschat`` refusal (one line)."""
    why_not = unsupported_reason(config)
    if why_not is None:
        return None
    return f"--decoding_engine dschat: {ENGINE_NAME} cannot decode {name} ({why_not}); use --decoding_engine auto or loop"


# ------------------------------------------------------------------------------------------------
# The batching worker
# ------------------------------------------------------------------------------------------------
def _fits(rows: Sequence[Job], max_positions: int) -> bool:
    """Whether ``rows`` decode together within ``max_positions``: every row steps until the longest
    answer ends, so the widest prompt plus the largest asked ``max_tokens`` must fit; a
    :attr:`Job.fill` row asks for one token and takes the room left, which must be at least half of
    its own room (``max_tokens`` as submitted): another request's long prompt may cut its answer, to
    no less than half of that room."""
    room = max_positions - max(len(job.prompt_ids) for job in rows)
    asked = max((job.max_tokens for job in rows if not job.fill), default=1)
    return asked <= room and all(2 * room >= job.max_tokens for job in rows if job.fill)


def select_batch(waiting: Sequence[Job], limit: int, max_positions: int) -> list[Job]:
    """The batch of the oldest job ``waiting[0]``: it, then the waiting jobs with its key that fit with
    the batch so far (:func:`_fits`), in arrival order, ``limit`` jobs at most. Each :attr:`Job.fill`
    job of the batch has its ``max_tokens`` capped to the room the batch's widest prompt leaves."""
    batch = list(waiting[:1])  # the oldest job fits alone (a request's prompt + max_tokens is checked)
    for job in waiting[1:]:
        if len(batch) < limit and job.key == batch[0].key and _fits([*batch, job], max_positions):
            batch.append(job)
    room = max_positions - max(len(job.prompt_ids) for job in batch)
    for job in batch:
        if job.fill:
            job.max_tokens = min(job.max_tokens, room)
    return batch


class Batcher:
    """Decodes submitted jobs on one background thread with ``decoder``, batching those that wait (see
    the module docstring). The thread first warms the decoder up (:attr:`warm_up_error`: what it
    raised, else None; the constructor returns after it). :meth:`submit` never blocks; a batch that
    raises reports :class:`Failed` to each of its jobs still running and the worker goes on;
    :meth:`shut_down` answers every open job 503."""

    def __init__(self, decoder: Decoder, max_batch_size: int, max_wait_s: float) -> None:
        self.decoder, self.max_batch_size, self.max_wait_s = decoder, max_batch_size, max_wait_s
        self.max_positions = decoder.engine.max_positions
        self._waiting: list[Job] = []
        self._ready = threading.Condition()
        # The sizes of the last batches decoded, in order (for tests and benchmarks).
        self.batch_sizes: collections.deque[int] = collections.deque(maxlen=4096)
        self.warm_up_error: Exception | None = None
        self._running: list[Job] = []  # the batch being decoded
        self._closing = False
        warmed = threading.Event()
        threading.Thread(target=self._run, args=(warmed,), name="dschat-serve-decode", daemon=True).start()
        warmed.wait()

    def submit(self, job: Job) -> None:
        with self._ready:
            if self._closing:
                job.emit(Failed(SHUTTING_DOWN, 503))
                return
            self._waiting.append(job)
            self._ready.notify()

    def load(self) -> dict[str, int]:
        """``{"waiting": jobs waiting, "decoding": jobs in the batch being decoded}`` (what an actor's
        ``GET /health`` reports)."""
        with self._ready:
            return {"waiting": len(self._waiting), "decoding": len(self._running)}

    def shut_down(self) -> None:
        """The server begins to stop: every job waiting or decoding is answered 503 at once (its rows
        stop at their next token) and later ones are refused, rather than cut by the server's grace
        limit without an OpenAI error body."""
        with self._ready:
            if self._closing:  # a second signal: they were answered
                return
            self._closing = True
            jobs, self._waiting = [*self._waiting, *self._running], []
        for job in jobs:
            job.cancelled = True
            with contextlib.suppress(Exception):  # a request gone (its loop closed)
                job.emit(Failed(SHUTTING_DOWN, 503))

    def _take(self) -> list[Job]:
        """The next batch: the oldest job and, after waiting up to ``max_wait_s`` for the batch to fill,
        the other waiting jobs with its key that fit with it (one job when it has a seed)."""
        with self._ready:
            while not self._waiting:
                self._ready.wait()
            key = self._waiting[0].key
            limit = 1 if key[1] is not None else self.max_batch_size
            deadline = time.monotonic() + self.max_wait_s
            while sum(job.key == key for job in self._waiting) < limit and (left := deadline - time.monotonic()) > 0:
                self._ready.wait(left)
            batch = select_batch(self._waiting, limit, self.max_positions)
            self._waiting = [job for job in self._waiting if job not in batch]
            self._running = batch
            return batch

    def _run(self, warmed: threading.Event) -> None:
        try:
            self.decoder.warm_up()
        except Exception as err:  # noqa: BLE001 - reported to the caller (dschat.serve.cli says it, falls back)
            self.warm_up_error = err
        finally:
            warmed.set()
        while True:
            try:
                batch = self._take()
            except Exception as err:  # noqa: BLE001 - choosing a batch failed: those waiting are answered
                with self._ready:
                    batch, self._waiting = self._waiting, []
                self._fail(batch, f"batching failed: {type(err).__name__}: {err}")
                continue
            self.batch_sizes.append(len(batch))
            try:
                self.decoder.decode(batch)
            except Exception as err:  # noqa: BLE001 - reported to the requests; the server goes on
                self._fail(batch, f"decoding failed: {type(err).__name__}: {err}")
            with self._ready:
                self._running = []

    @staticmethod
    def _fail(jobs: list[Job], message: str) -> None:
        """Answer each of ``jobs`` :class:`Failed` (500); a request already gone is passed over."""
        for job in jobs:
            try:
                job.emit(Failed(message))
            except Exception:  # noqa: BLE001 - a request gone (its loop closed): the worker goes on
                pass


def start_batcher(engine: ActorEngine, choice: str, max_batch_size: int, max_wait_s: float) -> tuple[Batcher, str]:
    """A :class:`Batcher` decoding with ``--decoding_engine choice`` (:func:`pick_decoder`) and the
    phrase for the startup line: the engine and why. If dschat's Hybrid Engine fails its warm-up
    (compiling its decode step), ``auto`` serves with the sample loop instead and says why; ``dschat``
    is one :class:`UserError` line."""
    decoder, why = pick_decoder(engine, choice, max_batch_size)
    batcher = Batcher(decoder, max_batch_size, max_wait_s)
    err = batcher.warm_up_error
    if err is not None:
        failed = f"{ENGINE_NAME} failed its warm-up ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
        if choice == "dschat":
            raise UserError(f"--decoding_engine dschat: {failed}; use --decoding_engine loop")
        if isinstance(decoder, LoopDecoder):
            raise err
        batcher.decoder, why = LoopDecoder(engine), failed  # no job was submitted yet
    return batcher, f"{batcher.decoder.describe()}: {why}"
