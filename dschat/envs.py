"""Environments for multi-turn rollouts: ``module.path:factory`` loaded, called and checked.

A factory makes the environment of one episode from the dataset row of its prompt (all its
columns)::

    factory(row: dict) -> env
    env.step(answer: str) -> (observation, reward, done)

- ``observation``: what the environment says back before the actor's next turn: a ``str``, a chat
  message ``{"role": "user" | "tool", "content": str}`` (exactly those two keys), or ``None``; its
  text must encode as UTF-8 (no lone surrogates, as ``errors="surrogateescape"`` decoding leaves);
- ``reward``: this turn's reward, an ``int`` or ``float`` (not a bool) finite in float32, or ``None``;
- ``done``: ``True`` or ``False`` (a bool).

What goes wrong is the user's to fix, so it stops the run with one line (:class:`UserError`, exit
code 2) naming the environment's spec, the row and the turn: an unimportable spec (the same lines as
``--reward_fn``: :func:`dschat.rewards.load_callable`), a factory that returns no object with a
``step`` method, a call that raises or calls ``sys.exit``, a step that returns another shape or type,
or a call that outlasts ``timeout`` seconds. A :class:`UserError` raised by the environment passes as
it is.

**Concurrency and timeout.** :class:`EpisodeBatch` calls the factory, and then ``step`` of every live
episode, each in its own daemon worker thread (:class:`dschat.rewards.PendingCall`, the mechanism of
``--reward_fn_timeout``), all started together, so slow tools overlap; it then waits for each in row
order, at most until ``timeout`` seconds after the start (0: no limit). Python cannot stop a thread:
a call past its time is left running and the error stops the run, the process exits and the stuck
call with it. Since the environments of a batch run side by side, they must not share unguarded state.

:func:`render_observation` is the text appended to the conversation after an actor's turn.

Pure Python (torch only through :mod:`dschat.rewards`): no DeepSpeed, no models.
"""
from __future__ import annotations

import copy
import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, Union

from dschat.errors import UserError, exit_code, raised
from dschat.rewards import CallTimedOut, PendingCall, as_float32, check_timeout, load_callable

__all__ = ["Observation", "StepResult", "EpisodeState", "EnvironmentFactory", "EpisodeBatch",
           "load_environment", "render_observation", "observation_parts", "OBSERVATION_ROLES"]

#: The roles an observation's chat message may take.
OBSERVATION_ROLES = ("user", "tool")

#: ``str``, a chat message ``{"role": ..., "content": ...}``, or None.
Observation = Union[str, Mapping[str, str], None]

_SHAPE = "step(answer) must return a tuple (observation, reward, done)"


@dataclass(frozen=True)
class StepResult:
    """One checked ``step`` result: ``observation`` (str, a ``{"role", "content"}`` dict, or None),
    ``reward`` (a float, or None for no reward this turn), ``done``."""

    observation: Observation
    reward: float | None
    done: bool


_PROMPT_FIELD = "prompt"  # a row's prompt (dschat.data.prompt_columns.PROMPT_FIELD, a floor beside this one)


@dataclass
class EpisodeState:
    """One episode's progress. Invariants: ``turns <= max_turns``; ``cut`` implies ``done``; a done
    episode takes no more turns. ``reward`` sums the turn rewards (None counts 0)."""

    row: int  # the row's index, as error lines name it
    max_turns: int
    turns: int = 0
    reward: float = 0.0
    done: bool = False
    cut: bool = False  # reached max_turns before the environment said done (or, set by the player, out of room)
    # The row's prompt, shown in error lines (a batch index alone names no data row); not compared.
    prompt: str | None = field(default=None, compare=False)

    def where(self, turn: int | None = None) -> str:
        """``on row i (prompt '...', turn t)`` for error lines, as the reward functions' lines name a row."""
        parts = ([f"prompt {_shown(self.prompt)}"] if self.prompt is not None else []) + (
            [f"turn {turn}"] if turn is not None else [])
        return f"on row {self.row}" + (f" ({', '.join(parts)})" if parts else "")


@dataclass(frozen=True)
class EnvironmentFactory:
    """The loaded ``--env`` factory, its spec (``name``, for error lines) and the seconds one call may
    take (``timeout``; 0: no limit)."""

    name: str
    factory: Callable[[dict[str, Any]], Any] = field(repr=False)
    timeout: float = 0.0


def load_environment(spec: str, timeout: float = 0.0) -> EnvironmentFactory:
    """``"module.path:factory"`` -> :class:`EnvironmentFactory`; a bad spec or timeout is one
    :class:`UserError` line."""
    timeout = check_timeout(timeout, "--env_timeout")
    return EnvironmentFactory(spec, load_callable(spec, "--env", "dschat.envs_examples:calculator"), timeout)


def _shown(value: Any, limit: int = 60) -> str:
    """``repr(value)`` on one line, cut to ``limit`` characters (for error lines)."""
    try:
        flat = " ".join(repr(value).split())
    except ValueError:  # an int of more digits than Python converts to text
        flat = f"<{type(value).__name__} too large to show>"
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _check_step(env_name: str, where: str, raw: Any) -> StepResult:
    """``raw`` as a :class:`StepResult`, or the one line that says what is wrong with it."""
    def wrong(what: str, fix: str) -> UserError:
        return UserError(f"environment {env_name} {where}: {what}; {fix}")

    if not isinstance(raw, tuple) or len(raw) != 3:
        shown = f"a tuple of {len(raw)}" if isinstance(raw, tuple) else f"{type(raw).__name__} {_shown(raw)}"
        raise wrong(f"step returned {shown}", _SHAPE)
    observation, reward, done = raw
    if isinstance(observation, Mapping):
        if set(observation) != {"role", "content"} or observation["role"] not in OBSERVATION_ROLES \
                or not isinstance(observation["content"], str):
            raise wrong(f"step returned the observation {_shown(observation)}",
                        "a chat message is {'role': 'user' or 'tool', 'content': str}")
        observation = {"role": observation["role"], "content": observation["content"]}
    elif observation is not None and not isinstance(observation, str):
        raise wrong(f"step returned the observation {type(observation).__name__} {_shown(observation)}",
                    "an observation is a str, a chat message {'role': 'user' or 'tool', 'content': str}, or None")
    content = observation["content"] if isinstance(observation, Mapping) else observation
    try:  # a lone surrogate (bytes decoded with errors="surrogateescape") is no text a tokenizer takes
        if content is not None:
            content.encode("utf-8")
    except UnicodeEncodeError as err:
        raise wrong(f"step returned an observation that is not valid Unicode text ({_shown(content[err.start])} "
                    f"at character {err.start} cannot be encoded as UTF-8)", "decode a tool's output with "
                    "errors='replace' (not 'surrogateescape'), or return only valid text") from None
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
            raise wrong(f"step returned the reward {type(reward).__name__} {_shown(reward)}",
                        "a reward is an int or float, or None for no reward this turn")
        # The rewards are used in float32: 1e39 is finite here and inf there.
        try:
            finite = math.isfinite(as_float32(float(reward)))
        except OverflowError:  # an int beyond any float
            finite = False
        if not finite:
            raise wrong(f"step returned the reward {_shown(reward)}", "rewards must be finite in float32 (|x| < 3.4e38)")
        reward = float(reward)
    if type(done).__module__ == "numpy" and type(done).__name__ in ("bool", "bool_"):  # a comparison's, in numpy
        done = bool(done)
    if not isinstance(done, bool):
        raise wrong(f"step returned done = {type(done).__name__} {_shown(done)}", "done is True or False")
    return StepResult(observation, reward, done)


def _raise_failure(env_name: str, what: str, where: str, err: BaseException) -> None:
    """The one line for a call (``what``: ``"step"`` or ``"the factory"``) that raised, exited or
    timed out; a :class:`UserError` of the environment passes as it is."""
    if isinstance(err, UserError):
        raise err
    if isinstance(err, CallTimedOut):
        raise UserError(f"environment {env_name}: {what} did not return within --env_timeout {err.seconds:g} s "
                        f"{where}; make it faster or raise --env_timeout (0: no limit)") from None
    if isinstance(err, SystemExit):
        raise UserError(f"environment {env_name}: {what} called sys.exit({exit_code(err)}) {where}; raise an "
                        "exception or return (observation, reward, done) instead") from None
    raise UserError(f"environment {env_name}: {what} raised {raised(err)} {where}; fix the environment") from err


class EpisodeBatch:
    """The episodes of one batch of prompts: their environments and :class:`EpisodeState`.

    ``rows``: the dataset rows (all columns), one episode each; ``row_ids``: their indices for error
    lines (default 0..n-1); ``max_turns``: turns after which an episode is done and cut. Creating it
    calls the factory once per row (concurrently, under the factory's timeout).
    """

    def __init__(self, factory: EnvironmentFactory, rows: Sequence[Mapping[str, Any]],
                 max_turns: int, row_ids: Sequence[int] | None = None) -> None:
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise UserError(f"--max_turns must be a whole number >= 1, got {max_turns!r}")
        row_ids = list(range(len(rows))) if row_ids is None else list(row_ids)
        if len(row_ids) != len(rows):
            raise ValueError(f"{len(row_ids)} row ids for {len(rows)} rows")
        self.factory = factory
        prompts = [row.get(_PROMPT_FIELD) for row in rows]
        self.states = [EpisodeState(row=i, max_turns=max_turns, prompt=p if isinstance(p, str) else None)
                       for i, p in zip(row_ids, prompts)]
        self.last_seconds = 0.0  # wall time of the latest batch of calls
        self.total_seconds = 0.0  # summed over every batch of calls so far
        # A deep copy of each row: the factory may keep or change it, lists and dicts in it too (the
        # episodes of one prompt's group, and the dataset's record, must not see another's change).
        copies = [_copy_containers(dict(row)) for row in rows]
        made = self._run([(lambda r=row: factory.factory(r)) for row in copies], "the factory",
                         [s.where() for s in self.states])
        for env, state in zip(made, self.states):
            try:
                step = getattr(env, "step", None)
            except Exception as err:  # noqa: BLE001 -- a __getattr__ or a property of user code
                raise UserError(f"environment {factory.name}: looking up step on the {type(env).__name__} the "
                                f"factory returned {state.where()} raised {raised(err)}; return an object with "
                                "step(answer) -> (observation, reward, done)") from err
            if not callable(step):
                raise UserError(f"environment {factory.name}: the factory returned {type(env).__name__} "
                                f"{state.where()}, which has no step(answer) method; return an object with "
                                "step(answer) -> (observation, reward, done)")
        self.envs = made

    @property
    def done(self) -> bool:
        """Whether every episode is done."""
        return all(s.done for s in self.states)

    def step(self, answers: Sequence[str | None], *, waiting: Sequence[int] = ()) -> list[StepResult | None]:
        """Call ``step(answer)`` of every live episode concurrently (``answers[i]`` for episode i; the
        answers of done episodes are ignored) and update the states. The live episodes in ``waiting``
        take no step now (their turn goes on). Returns one :class:`StepResult` per episode stepped
        and None per other episode, in order."""
        if len(answers) != len(self.envs):
            raise ValueError(f"{len(answers)} answers for {len(self.envs)} episodes")
        skip = set(waiting)
        live = [i for i, s in enumerate(self.states) if not s.done and i not in skip]
        for i in live:
            if not isinstance(answers[i], str):
                raise TypeError(f"the answer of live episode {i} is {type(answers[i]).__name__}, not str")
        raw = self._run([(lambda e=self.envs[i], a=answers[i]: e.step(a)) for i in live], "step",
                        [self.states[i].where(self.states[i].turns + 1) for i in live])
        results: list[StepResult | None] = [None] * len(self.envs)
        for i, value in zip(live, raw):
            state = self.states[i]
            result = _check_step(self.factory.name, state.where(state.turns + 1), value)
            state.turns += 1
            state.reward += result.reward or 0.0
            state.done = result.done
            if not state.done and state.turns >= state.max_turns:
                state.done = state.cut = True
            results[i] = result
        return results

    def _run(self, calls: list[Callable[[], Any]], what: str, wheres: list[str]) -> list[Any]:
        """Start every call in its own worker thread, then wait for each in order until ``timeout``
        seconds after the start; the first failure in order is raised (see the module docstring)."""
        start = time.monotonic()
        pending = [PendingCall(call, f"environment {self.factory.name}") for call in calls]
        results = []
        for call, where in zip(pending, wheres):
            timeout = self.factory.timeout
            left = max(timeout - (time.monotonic() - start), 1e-3) if timeout else None
            value, err = call.wait(left)
            if isinstance(err, CallTimedOut):
                err = CallTimedOut(timeout)
            if err is not None:
                _raise_failure(self.factory.name, what, where, err)
            results.append(value)
        self.last_seconds = time.monotonic() - start
        self.total_seconds += self.last_seconds
        return results


_SENTINEL = "\x00dschat-answer\x00"


def render_observation(observation: Observation, tokenizer: Any) -> str:
    """The text to append after an actor's turn (its content, without an end-of-turn token) so that
    the conversation goes on with the observation and then the actor's next turn.

    With a chat template that renders the observation's role (``"user"`` for a plain string): the
    template's end of the assistant turn, the observation as a message, and the generation prompt
    of the next assistant turn, so ``prompt + answer + render(obs) + ...`` is what the template makes
    of the whole conversation (a template that trims or otherwise changes the content included: the
    rendering is recognised by the markup around it). Without a chat template, or one that refuses
    or drops that role: the observation's text as it is. None: ``""``. Its parts:
    :func:`observation_parts`.
    """
    return "".join(observation_parts(observation, tokenizer))


def observation_parts(observation: Observation, tokenizer: Any) -> tuple[str, str, str]:
    """:func:`render_observation`'s text in three parts: the template's markup before the content (the
    end of the assistant turn, the message's head), the content as the template rendered it, and the
    markup after it (the message's end, the next generation prompt). The markup is found by rendering
    a placeholder in the content's place; ``("", content, "")`` without a chat template, or with one
    that refuses or drops the role. None: ``("", "", "")``."""
    if observation is None:
        return "", "", ""
    message = ({"role": "user", "content": observation} if isinstance(observation, str)
               else {"role": observation["role"], "content": observation["content"]})
    bare = ("", message["content"], "")
    if not getattr(tokenizer, "chat_template", None):
        return bare
    frame = _after_answer({"role": message["role"], "content": _CONTENT}, tokenizer)
    text = _after_answer(message, tokenizer)
    if frame is None or frame.count(_CONTENT) != 1 or text is None:
        return bare
    before, _, after = frame.partition(_CONTENT)
    if not (text.startswith(before) and text.endswith(after) and len(before) + len(after) <= len(text)):
        return bare
    return before, text[len(before):len(text) - len(after)], after


_CONTENT = "\x00dschat-observation\x00"


def _after_answer(message: dict[str, str], tokenizer: Any) -> str | None:
    """What the chat template renders after an assistant answer for ``message`` and the next generation
    prompt; None when the template refuses the message (jinja's ``raise_exception`` and the like)."""
    conversation = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENTINEL}, message]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 -- a template's refusal of the role
        return None
    if not isinstance(text, str) or _SENTINEL not in text:
        return None
    return text.rsplit(_SENTINEL, 1)[1]


def _copy_containers(value: Any) -> Any:
    """``value`` with every dict, list, tuple and set in it copied, recursively (a dataset row's JSON
    values become the episode's own); other objects are shared as they are (a row handed to
    :class:`EpisodeBatch` from Python may hold objects that cannot be copied)."""
    if isinstance(value, dict):
        copied = copy.copy(value)  # its own type: a defaultdict keeps its default
        for key, item in value.items():
            copied[key] = _copy_containers(item)
        return copied
    if type(value) in (list, tuple, set):  # not a named tuple, whose constructor takes fields
        return type(value)(_copy_containers(item) for item in value)
    return value
