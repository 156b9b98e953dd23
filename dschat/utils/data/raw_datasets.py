"""Upstream import path ``dschat.utils.data.raw_datasets``: upstream's dataset adapters.

The hub adapters are :data:`dschat.data.adapters.upstream.HUB_ADAPTERS` (their names come from that
list), the template is :mod:`dschat.data.adapters.base`, dschat's local forms are
:mod:`dschat.data.adapters.local`.
"""
from dschat.data.adapters import upstream as _hub
from dschat.data.adapters.base import PromptRawDataset
from dschat.data.adapters.local import BuiltinDataset, LocalJsonFileDataset, LocalPreferenceDataset
from dschat.data.adapters.upstream import *  # noqa: F401,F403  (every name of HUB_ADAPTERS)

__all__ = ["PromptRawDataset", *_hub.__all__, "LocalJsonFileDataset", "LocalPreferenceDataset", "BuiltinDataset"]
