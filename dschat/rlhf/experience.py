"""The PPO experience container, the masks derived from a generated batch, the buffer that collects a
rollout's experience and splits it into micro-batches, and the ranks' agreement on a rollout's sums
and failures (:func:`sum_over_ranks`, :func:`raise_together`).

One rollout batch on one rank is an :class:`Experience`: a typed container with one shape comment per
field (OpenRLHF's ``Experience``), replacing upstream's string-keyed dict. ``exp["logprobs"]`` and the
other upstream keys still work for code written against upstream.

Masks come from generation, never from ``ids != pad``, so an EOS that shares the pad id stays
visible (docs/upstream.md#pad-and-eos). The answer of a row is every generated token up to *and
including* the first EOS; a row that generated no EOS keeps all ``max_answer_seq_len`` tokens.

Index conventions are upstream's (see :mod:`dschat.rl_math`): ``seq`` is ``(B, L)`` with a prompt
left-padded to exactly ``P`` tokens; per-token tensors are ``(B, T)`` with ``T = L - 1`` and position
``i`` scoring token ``i + 1``; ``start = P - 1``.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Iterator, TypeVar

import torch

from dschat.errors import UserError
from dschat.rlhf.rollout.sampling import EndIds, is_end
from dschat.runtime.dist import all_reduce_sum, gather_ints

__all__ = ["Experience", "answer_mask", "sequence_masks", "SequenceMasks", "UPSTREAM_KEYS", "sum_over_ranks",
           "RolloutBuffer", "raise_together", "concat_rows"]

# Upstream's dict keys -> field names.
UPSTREAM_KEYS: dict[str, str] = {
    "prompts": "prompts",
    "logprobs": "logprobs",
    "ref_logprobs": "ref_logprobs",
    "value": "values",
    "rewards": "reward_score",  # each answer's score (not the per-token rewards of compute_rewards)
    "input_ids": "seq",
    "attention_mask": "attention_mask",
}


def answer_mask(answers: torch.Tensor, eos_token_id: EndIds | None) -> torch.Tensor:
    """1 for every generated token up to and including the first EOS, 0 after it.

    An EOS is any id of ``eos_token_id`` (one id or several: :data:`~dschat.rlhf.rollout.sampling.EndIds`).
    Shape: answers (B, A) generated ids; returns (B, A) int64. With ``eos_token_id=None`` every token
    is real. Tokens equal to the pad id *before* the first EOS count as real: the model generated them.
    """
    if eos_token_id is None:
        return torch.ones_like(answers, dtype=torch.long)
    is_eos = is_end(answers, eos_token_id).long()
    # Number of EOS strictly before each position: 0 up to and including the first EOS.
    eos_before = is_eos.cumsum(-1) - is_eos
    return (eos_before == 0).long()


@dataclass(frozen=True)
class SequenceMasks:
    """Masks of a generated batch. attention_mask / position_ids (B, L); answer_lengths (B,)."""

    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    answer_lengths: torch.Tensor


def sequence_masks(prompt_mask: torch.Tensor, seq: torch.Tensor, eos_token_id: EndIds | None) -> SequenceMasks:
    """Attention mask, position ids and answer lengths for ``seq = [left-padded prompt | answer]``.

    ``attention_mask`` is the prompt's own mask followed by :func:`answer_mask`; ``position_ids``
    count real tokens only (``cumsum(mask) - 1``, 0 on padding), the positions ``generate`` used, so
    left padding does not shift them (upstream passed none).

    Shape: prompt_mask (B, P), seq (B, L) with L >= P; returns (B, L), (B, L), (B,).
    """
    P = prompt_mask.shape[1]
    answers = answer_mask(seq[:, P:], eos_token_id)
    attention_mask = torch.cat([prompt_mask.to(answers.dtype).to(seq.device), answers], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return SequenceMasks(attention_mask, position_ids, answers.sum(-1))


@dataclass
class Experience:
    """One rollout batch on one rank (``B`` rows). Shapes: ``P`` prompt width, ``L`` sequence
    length, ``T = L - 1``, ``start = P - 1``.

    ``valid`` marks rows kept for training: answers of at most one token are dropped (upstream's
    ``valid_ans_len <= 1`` rule) by zeroing their ``action_mask`` rather than deleting the row, so
    every rank keeps the same number of micro-batches (docs/upstream.md#step-3-ppo). ``advantages`` /
    ``returns`` / ``loss_normalizer`` are filled in by the trainer before the PPO update
    (``DeepSpeedPPOTrainer.prepare_rollout``); left ``None`` they are computed per micro-batch as
    upstream does.
    """

    prompts: torch.Tensor  # (B, P) prompt ids, left-padded
    seq: torch.Tensor  # (B, L) prompt + generated answer (+ padding after the first EOS)
    attention_mask: torch.Tensor  # (B, L) 1 = real token: prompt tokens, answer up to and incl. EOS
    position_ids: torch.Tensor  # (B, L) cumsum(attention_mask) - 1, 0 on padding
    action_mask: torch.Tensor  # (B, T) attention_mask[:, 1:] of valid rows, 0 for dropped rows and observations
    logprobs: torch.Tensor  # (B, T) behaviour log-probs log pi_old(seq[:, 1:]) (actor, eval mode)
    ref_logprobs: torch.Tensor  # (B, T) reference-model log-probs
    values: torch.Tensor  # (B, T) critic values (eval mode)
    # (B,) each answer's score: the reward mix (reward model and --reward_fn functions, by weight), less
    # --missing_eos_penalty for an answer cut before its EOS; not clipped, no KL (upstream's key "rewards")
    reward_score: torch.Tensor
    valid: torch.Tensor  # (B,) bool: row trains (answer of more than one token; with --mask_truncated_answers, ended by EOS)
    advantages: torch.Tensor | None = None  # (B, T - start) GAE advantages (maybe whitened)
    returns: torch.Tensor | None = None  # (B, T - start) advantages + values
    loss_normalizer: float | None = None  # token (or answer) count of this micro-batch's optimizer step / (GA x world)
    sequence_advantages: torch.Tensor | None = None  # (B,) GRPO / RLOO / ReMax advantage of each answer
    # Multi-turn episodes (--env; None for one answer per prompt): (B, T) 1 where seq[:, t + 1] is an
    # environment's token (0 in action_mask there: no loss, KL or value target), and per episode (B,)
    # the actor turns played and whether max_turns or the length limit cut it.
    observation_mask: torch.Tensor | None = None
    turns: torch.Tensor | None = None
    cut: torch.Tensor | None = None

    # ---------------------------------------------------------------- container protocol
    def __len__(self) -> int:
        return int(self.seq.shape[0])

    def __getitem__(self, key: str | slice) -> Any:
        """``exp["logprobs"]`` (upstream keys, see :data:`UPSTREAM_KEYS`) or ``exp[a:b]`` (rows)."""
        if isinstance(key, slice):
            return self.rows(key)
        if key in UPSTREAM_KEYS:
            return getattr(self, UPSTREAM_KEYS[key])
        raise KeyError(f"{key!r}: Experience keys are {sorted(UPSTREAM_KEYS)} (or use the fields)")

    def keys(self) -> Iterator[str]:
        return iter(UPSTREAM_KEYS)

    @property
    def start(self) -> int:
        """First log-prob position that scores an answer token (``P - 1``)."""
        return int(self.prompts.shape[1]) - 1

    def rows(self, index: slice | torch.Tensor) -> "Experience":
        """The rows ``index`` of every batched tensor (what ``RolloutBuffer`` splits with)."""
        changes = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                changes[f.name] = value[index]
        return replace(self, **changes)

    def to(self, device: torch.device | str) -> "Experience":
        changes = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                   if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **changes)

    @property
    def num_valid(self) -> int:
        return int(self.valid.sum())


#: The (B, P) and (B, L) fields, and the (B, T) per-token ones, of an :class:`Experience` (see :func:`concat_rows`).
_PROMPT_FIELDS = ("prompts",)
_SEQUENCE_FIELDS = ("seq", "attention_mask", "position_ids")
_TOKEN_FIELDS = ("action_mask", "logprobs", "ref_logprobs", "values", "observation_mask")


def concat_rows(parts: list[Experience], pad_token_id: int) -> Experience:
    """The rows of ``parts`` (experiences of the same run, before the rollout is prepared) as one
    experience, in order, re-padded to common widths: each part's prompts are left-padded to the
    widest prompt ``P`` and its answers right-padded to the longest answer width ``A``
    (``L = P + A``). Id fields are padded with ``pad_token_id``, every other field with 0 (no
    attention, no action, position 0), so each row's tokens, masks, positions, log-probs and values
    keep their meaning: per-token column ``t`` still scores token ``t + 1``. One exception: a row that
    filled its part's last column gains padded columns after it, so a reward slot *after* the answer
    (PPO's ``reward_at="after_last"``) would move onto a zero log-prob; the sequence advantages of
    GRPO and RLOO, the only callers (``--dynamic_sampling``), do not read it.
    Shapes: part i is (B_i, P_i) / (B_i, L_i) / (B_i, L_i - 1) / (B_i,); returns (sum B_i, ...)."""
    if any(p.advantages is not None or p.returns is not None for p in parts):
        raise ValueError("concat_rows: join experiences before prepare_rollout fills in advantages")
    P = max(int(p.prompts.shape[1]) for p in parts)
    A = max(int(p.seq.shape[1] - p.prompts.shape[1]) for p in parts)
    joined = {}
    for f in fields(Experience):
        values = [getattr(p, f.name) for p in parts]
        if not isinstance(values[0], torch.Tensor):
            continue
        pieces = []
        for part, value in zip(parts, values):
            left, right = P - int(part.prompts.shape[1]), A - int(part.seq.shape[1] - part.prompts.shape[1])
            if f.name in _PROMPT_FIELDS:
                right = 0
            elif f.name not in _SEQUENCE_FIELDS and f.name not in _TOKEN_FIELDS:
                left = right = 0  # (B,) per-row fields
            fill = pad_token_id if f.name in ("prompts", "seq") else 0
            pieces.append(torch.nn.functional.pad(value, (left, right), value=fill) if left or right else value)
        joined[f.name] = torch.cat(pieces)
    return replace(parts[0], **joined)


def sum_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """``values`` summed over every rank, in float64: the one collective of a rollout's statistics,
    whitening moments and loss normalisers (one all-reduce; every rank must call it)."""
    return all_reduce_sum(torch.tensor(values, dtype=torch.float64, device=device)).tolist()


_T = TypeVar("_T")


def raise_together(call: Callable[[], _T], what: str, prefix: str = "") -> _T:
    """``call()``; when it raises a :class:`UserError` on any rank, every rank raises: that rank its own
    line (after ``prefix``), the others one saying that ``what`` (``"a reward function"``, ...) failed
    on another rank, so none is left waiting in a collective. Collective: one all-reduce. When that
    all-reduce itself fails (another rank gone, or its wait timed out) on a rank whose call failed,
    that rank still raises its own line (the collective's error as its cause)."""
    failure: UserError | None = None
    value = None
    try:
        value = call()
    except UserError as err:
        failure = UserError(f"{prefix}{err}") if prefix else err
    try:
        flags = gather_ints([0 if failure is None else 1])
    except Exception as err:  # noqa: BLE001 -- the collective's own failure; this rank's line says more
        if failure is None:
            raise
        raise failure from err
    if any(r[0] for r in flags):
        raise failure or UserError(f"{prefix}{what} failed on another rank (its line is in that rank's log)")
    return value  # type: ignore[return-value]


def _slice(batch: Any, start: int, stop: int) -> Any:
    if isinstance(batch, dict):
        return {k: v[start:stop] for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # NamedTuple: keep its type
        return type(batch)(*(x[start:stop] for x in batch))
    if isinstance(batch, (list, tuple)):
        return [x[start:stop] for x in batch]
    return batch[start:stop]


def _batch_size(batch: Any) -> int:
    if isinstance(batch, dict):
        return len(batch[next(iter(batch))])
    if isinstance(batch, (list, tuple)):
        return len(batch[0])
    return len(batch)


class RolloutBuffer:
    """Holds the generation batches of one rollout (``max_size`` of them), then splits them into
    micro-batches of ``small_batch_size`` rows (upstream's ``MiniDataset``).

    Step 3 gathers ``generation_batches`` rollouts, then trains on micro-batches of
    ``per_device_training_batch_size``. A large batch may be an :class:`Experience` or a tensor (by
    rows), a dict (per key: the PPO-ptx batches), a list/tuple (per element; returned as a list, as
    upstream) or a NamedTuple (kept as its type, its rows sliced: docs/upstream.md#small-fixes).
    """

    def __init__(self, max_size: int, small_batch_size: int) -> None:
        self.dataset: list[Any] = []
        self.max_size = max_size
        self.small_batch_size = small_batch_size

    def separate(self) -> list[Any]:
        """Split every stored large batch into small ones, in order; empties the buffer."""
        small_dataset = []
        for large_batch in self.dataset:
            for i in range(0, _batch_size(large_batch), self.small_batch_size):
                small_dataset.append(_slice(large_batch, i, i + self.small_batch_size))
        self.free()
        return small_dataset

    # Upstream's spelling.
    seperate = separate

    def add(self, data: Any) -> list[Any] | None:
        """Store ``data``; once ``max_size`` batches are held, return them split (else None)."""
        if len(self.dataset) >= self.max_size:
            raise ValueError("The dataset is full but we did not stop it. There is a bug in the code.")
        self.dataset.append(data)
        if len(self.dataset) == self.max_size:
            return self.separate()
        return None

    def free(self) -> None:
        self.dataset = []
