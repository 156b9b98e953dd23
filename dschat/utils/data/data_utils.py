"""Upstream import path ``dschat.utils.data.data_utils``: re-exports the data pipeline.

Upstream's module held the dispatcher, the split index, tokenisation, the cache, the collators and
the PPO-ptx loader; in dschat they live in :mod:`dschat.data` (split, dispatch, tokenization, prompt_dataset,
collators, unsupervised); its ``MiniDataset`` is step 3's rollout buffer,
:class:`dschat.rlhf.experience.RolloutBuffer`.
"""
from dschat.data.collators import DataCollatorReward, DataCollatorRLHF, set_epoch_if_distributed
from dschat.data.prompt_dataset import create_prompt_dataset
from dschat.data.dispatch import get_raw_dataset
from dschat.data.split import get_raw_dataset_split_index, get_shuffle_idx
from dschat.data.token_dataset import PromptDataset
from dschat.data.tokenization import create_dataset, create_dataset_split
from dschat.data.unsupervised import get_unsupervised_data
from dschat.rlhf.experience import RolloutBuffer as MiniDataset
from dschat.utils.data import raw_datasets  # noqa: F401  (upstream imported the module under this name)

__all__ = [
    "raw_datasets",
    "get_raw_dataset",
    "get_shuffle_idx",
    "get_raw_dataset_split_index",
    "PromptDataset",
    "create_dataset_split",
    "create_dataset",
    "create_prompt_dataset",
    "DataCollatorReward",
    "DataCollatorRLHF",
    "get_unsupervised_data",
    "MiniDataset",
    "set_epoch_if_distributed",
]
