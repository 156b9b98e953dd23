"""Upstream's module name ``raw_datasets``: the adapters, the dispatch and the phase selection, re-exported.

The code lives in one module per idea: the template and loading in :mod:`dschat.data.adapters.base`,
upstream's hub adapters in :mod:`dschat.data.adapters.upstream`, local data in
:mod:`dschat.data.adapters.local`, the dispatch table in :mod:`dschat.data.dispatch` and the rows of
each phase in :mod:`dschat.data.phases`. Code written against upstream's ``raw_datasets`` (and
``dschat.utils.data.raw_datasets``) keeps working through this module.
"""
from dschat.data.adapters.base import PREF_OPTIONAL, PREF_REQUIRED, PromptRawDataset, Sample
from dschat.data.adapters.local import (
    BUILTIN_NAME,
    BUILTIN_SAMPLES_NAME,
    BuiltinDataset,
    LocalJsonFileDataset,
    LocalPreferenceDataset,
    builtin_files,
    builtin_folders,
    find_local_jsonfile_dir,
)
from dschat.data.adapters.upstream import (
    CohereMiracljaqueries2212Dataset,
    CohereMiraclzhqueries2212Dataset,
    DahoasFullhhrlhfDataset,
    DahoasRmstaticDataset,
    DahoasSyntheticinstructgptjpairwiseDataset,
    HelloSimpleAIHC3ChineseDataset,
    LmqgQagjaquadDataset,
    LmqgQgjaquadDataset,
    MkqaChineseDataset,
    MkqaJapaneseDataset,
    OpenaiWebgptcomparisonsDataset,
    PvduySharegptalpacaoavicunaformatDataset,
    StanfordnlpSHPDataset,
    Wangrui6ZhihuKOLDataset,
    YitingxieRlhfrewarddatasetsDataset,
)
from dschat.data.dispatch import (
    ADAPTERS,
    DATASET_TABLE,
    LOCAL_FORMS,
    DatasetSource,
    get_raw_dataset,
    match_adapter,
    resolve_dataset,
)
from dschat.data.phases import PhasePlan, PhaseRows, empty_phase, plan_phase_data, require_eval, select_phase_rows

__all__ = [
    "PromptRawDataset",
    "DahoasRmstaticDataset",
    "DahoasFullhhrlhfDataset",
    "DahoasSyntheticinstructgptjpairwiseDataset",
    "YitingxieRlhfrewarddatasetsDataset",
    "OpenaiWebgptcomparisonsDataset",
    "StanfordnlpSHPDataset",
    "PvduySharegptalpacaoavicunaformatDataset",
    "Wangrui6ZhihuKOLDataset",
    "CohereMiraclzhqueries2212Dataset",
    "HelloSimpleAIHC3ChineseDataset",
    "MkqaChineseDataset",
    "MkqaJapaneseDataset",
    "CohereMiracljaqueries2212Dataset",
    "LmqgQgjaquadDataset",
    "LmqgQagjaquadDataset",
    "LocalJsonFileDataset",
    "LocalPreferenceDataset",
    "BuiltinDataset",
    "DATASET_TABLE",
    "DatasetSource",
    "match_adapter",
    "resolve_dataset",
    "get_raw_dataset",
    "find_local_jsonfile_dir",
    "PhaseRows",
    "PhasePlan",
    "select_phase_rows",
    "plan_phase_data",
    # Also importable here (dschat's own modules and tests import them from this module):
    "ADAPTERS",
    "BUILTIN_NAME",
    "BUILTIN_SAMPLES_NAME",
    "LOCAL_FORMS",
    "PREF_OPTIONAL",
    "PREF_REQUIRED",
    "Sample",
    "builtin_files",
    "builtin_folders",
    "empty_phase",
    "require_eval",
]
