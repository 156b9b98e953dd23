"""DAPO's dynamic sampling (``--dynamic_sampling``, GRPO and RLOO): a generation batch of only
informative groups.

A group (the ``K = --num_generations`` answers to one prompt, consecutive rows) whose rewards are all
equal (after the ``--clip_reward_value`` clamp the advantages apply) has a zero reward advantage under
a group baseline, so it trains nothing but the KL term. :class:`GroupFilter` keeps the groups of
different rewards with at least one answer that trains
(:func:`~dschat.rl_math.critic_free.informative_groups`) from one
generation batch and from as many more as step 3's loop draws from the prompt loader, until every
rank holds a full batch of ``G`` such groups or ``--max_sampling_rounds`` generation batches were
drawn. The batch it hands back has the usual ``G x K`` rows (fewer when the epoch's last, short
prompt batch ends it) (:func:`~dschat.rlhf.experience.concat_rows`):
the first ``G`` informative groups in the order they came; when a rank is still short, the latest
equal-reward groups fill it, masked out of the loss (``valid`` false, a zero action mask) as dropped
answers are, so every rank keeps the same micro-batch count. The other groups are dropped.

Collectives: :meth:`GroupFilter.wants_more` and :meth:`GroupFilter.batch` each run one all-reduce,
and every rank draws the same number of generation batches (one loop decision for all ranks).
Nothing is carried from one batch to the next, so a checkpoint needs no state of its own: the prompt
loader's position counts every generation batch drawn.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from dschat.rl_math.critic_free import informative_groups
from dschat.rlhf.experience import Experience, concat_rows, sum_over_ranks
from dschat.runtime.dist import print_rank_0

__all__ = ["GroupFilter", "SamplingStats"]


@dataclass
class SamplingStats:
    """Dynamic sampling over the generation batches of a rollout, summed over every rank."""

    batches: int = 0  # generation batches handed to training
    rounds: int = 0  # generation batches drawn (per rank; every rank draws as many), skipped steps' too
    groups: int = 0  # groups generated (a skipped generation batch's too)
    dropped_groups: int = 0  # groups of equal rewards or no answer that trains (a skipped batch's), not trained on
    surplus_groups: int = 0  # informative groups beyond a full batch, not trained on
    masked_groups: int = 0  # equal-reward groups that filled a short batch, masked out of the loss

    @property
    def rounds_per_batch(self) -> float:
        """Generation batches drawn per generation batch trained (a skipped step's draws included)."""
        return self.rounds / max(self.batches, 1)


class GroupFilter:
    """Collects informative groups for one generation batch at a time (module docstring).

    ``groups_per_batch`` is ``G`` (rows per generation batch / ``group_size``); rewards are compared
    after the clamp to ``+-clip_reward_value``; ``pad_token_id`` pads the ids of joined batches;
    ``device`` holds the all-reduced counts.
    """

    def __init__(self, *, group_size: int, groups_per_batch: int, max_rounds: int, clip_reward_value: float,
                 pad_token_id: int, device: torch.device) -> None:
        self.group_size = group_size
        self.clip_reward_value = clip_reward_value
        self.groups_per_batch = groups_per_batch
        self.max_rounds = max_rounds
        self.pad_token_id = pad_token_id
        self.device = device
        self.stats = SamplingStats()
        self._reset()

    def _reset(self) -> None:
        self.kept: list[Experience] = []  # informative groups, K rows each, in arrival order
        self.spare: list[Experience] = []  # the latest equal-reward groups, at most G
        self.rounds = 0
        self.seen = self.dropped = 0

    @property
    def short(self) -> bool:
        """Whether this rank still lacks informative groups for a full batch."""
        return len(self.kept) < self.groups_per_batch

    def add(self, experience: Experience | None, groups: int | None = None) -> None:
        """One drawn generation batch. ``None``: step 3 skipped it on every rank (no answer anywhere
        long enough, or uncut under ``--mask_truncated_answers``): its ``groups`` (default ``G``; fewer
        for the epoch's short last prompt batch) were generated and none of their answers trains, so
        they count as sampled and dropped, and none is kept."""
        self.rounds += 1
        if experience is None:
            skipped = self.groups_per_batch if groups is None else groups
            self.seen += skipped
            self.dropped += skipped
            return
        k, clip = self.group_size, self.clip_reward_value
        informative = informative_groups(experience.reward_score.float().clamp(-clip, clip), k)
        trains = experience.valid.view(-1, k).any(dim=1).to(informative.device)  # a row with an action
        self.seen += len(informative)
        for g, differs in enumerate((informative & trains).tolist()):
            # A copy of the group's rows: the batch's other rows are not kept alive.
            group = experience.rows(torch.arange(g * k, (g + 1) * k, device=experience.seq.device))
            if differs:
                self.kept.append(group)
            else:
                self.dropped += 1
                self.spare = (self.spare + [group])[-self.groups_per_batch:]

    def wants_more(self) -> bool:
        """Whether the loop draws another generation batch: some rank is short and rounds are left.
        Collective (one all-reduce); every rank gets the same answer."""
        if self.rounds >= self.max_rounds:
            return False
        return sum_over_ranks([float(self.short)], self.device)[0] > 0

    def batch(self) -> Experience | None:
        """The batch to train on, or ``None`` when no rank found any informative group (the step is
        skipped, as when every answer is dropped; one line says so). Collective (one all-reduce).
        Resets for the next batch; the statistics add up until :meth:`pop_stats`."""
        kept = self.kept[:self.groups_per_batch]
        missing = self.groups_per_batch - len(kept)
        fill = [_masked(group) for group in self.spare[max(len(self.spare) - missing, 0):]] if missing > 0 else []
        parts = kept + fill  # fewer than G groups only when the epoch's last prompt batch was short
        informative, seen, dropped, surplus, masked, empty = sum_over_ranks(
            [float(len(kept)), float(self.seen), float(self.dropped), float(len(self.kept) - len(kept)),
             float(len(fill)), float(not parts)], self.device)
        stats = self.stats
        stats.rounds += self.rounds
        stats.groups += int(seen)
        stats.dropped_groups += int(dropped)
        stats.surplus_groups += int(surplus)
        stats.masked_groups += int(masked)
        rounds = self.rounds
        self._reset()
        if informative == 0 or empty:
            print_rank_0(f"Dynamic sampling: no group of different rewards on any rank in {rounds} generation "
                         "batches; skipping this step (no update)")
            return None
        stats.batches += 1
        return concat_rows(parts, self.pad_token_id)

    def pop_stats(self) -> SamplingStats:
        """The statistics since the last call (one rollout's), and a fresh start."""
        stats, self.stats = self.stats, SamplingStats()
        return stats


def _masked(group: Experience) -> Experience:
    """``group`` kept for its shape only: no row trains (as a dropped answer)."""
    return replace(group, valid=torch.zeros_like(group.valid), action_mask=torch.zeros_like(group.action_mask))
