"""The training order: shuffled, a function of --seed and the epoch (make_train_loader's seeded
DistributedSampler), which resume and the data order of every step rest on."""
from __future__ import annotations

from dschat.training.loaders import make_train_loader


def _order(seed: int, epoch: int = 0, shuffle: bool = True) -> list[int]:
    loader = make_train_loader(list(range(20)), 4, None, seed, shuffle=shuffle)
    loader.sampler.set_epoch(epoch)
    return [int(x) for batch in loader for x in batch]


def test_the_order_is_shuffled_by_seed_and_epoch_and_repeats_for_both():
    first = _order(1)
    assert sorted(first) == list(range(20)) and first != list(range(20))
    assert _order(1) == first  # a function of (seed, epoch) only
    assert _order(2) != first
    assert _order(1, epoch=1) != first
    assert _order(1, shuffle=False) == list(range(20))
