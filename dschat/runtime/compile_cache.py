"""Where ``torch.compile`` keeps its cache: a folder of the user's own, not torch's ``/tmp`` default.

``torch.compile``'s inductor caches what it generates -- Python modules it imports, Triton kernels
and shared libraries it loads, pickled graph-cache entries -- under ``$TORCHINDUCTOR_CACHE_DIR``,
by default ``/tmp/torchinductor_<user>``. torch creates that folder when it is missing (already when
``torch._dynamo`` is imported) and never asks who owns it, so on a shared machine another account
can create it first, writable by all, and put files there that a later compile loads: code that runs
as the user. dschat compiles on CUDA (its Hybrid Engine's decode step, ``--generation_loop graphs``),
so before its first compile :func:`use_private_compile_cache` points the cache at
``cache_dir()/torch-compile`` (made 0700), unless the user named a folder, which must then be the
user's own, as every cache dschat reads (:func:`dschat.runtime.fs.check_trusted`). A cache in the
user's home also outlives ``/tmp``'s clean-ups, so a later run compiles from it.

Two things of torch 2.13 stay in its ``/tmp`` default whatever the variable says, with their paths
fixed at import: precompiled C++ headers (for C++ kernels, a CPU's, and cpp_wrapper mode), which are
turned off (``torch._inductor.config.cpp_cache_precompile_headers``) unless that folder is the
user's own; and Dynamo's precompile cache, used only with ``TORCH_CACHING_PRECOMPILE=1``.

Environment variables read here: ``TORCHINDUCTOR_CACHE_DIR`` (set when absent, or when it holds
torch's own default, which torch writes there at import) and ``TRITON_CACHE_DIR`` (only checked:
inductor keeps Triton's cache inside its own when it is absent).
"""
from __future__ import annotations

import os
from pathlib import Path

# Free where this is imported (dschat.rlhf.rollout_engine has imported torch._dynamo, which imports them).
import torch._inductor.config as inductor_config
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from dschat.paths import cache_dir
from dschat.runtime.fs import check_trusted, is_trusted, make_private_dir

__all__ = ["COMPILE_CACHE_ENV", "compile_cache_dir", "use_private_compile_cache"]

#: The variables naming torch.compile's cache folders (inductor's, and Triton's inside it by default).
COMPILE_CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def compile_cache_dir() -> Path:
    """``cache_dir()/torch-compile``: dschat's default for ``TORCHINDUCTOR_CACHE_DIR``."""
    return cache_dir() / "torch-compile"


def use_private_compile_cache() -> Path:
    """Make sure ``torch.compile`` reads and writes its cache only in folders of the user's own.

    A folder named by ``TORCHINDUCTOR_CACHE_DIR`` or ``TRITON_CACHE_DIR`` that exists must belong to
    the user and be writable by nobody else (else a :class:`~dschat.errors.UserError`, one line); one
    that does not exist yet torch creates. When ``TORCHINDUCTOR_CACHE_DIR`` is unset or holds torch's
    own ``/tmp`` default, it is set to :func:`compile_cache_dir`, created 0700 and checked the same
    way (``DSCHAT_CACHE_DIR`` may name a shared folder). Returns inductor's folder. Call it before a
    compile: torch reads the variable at each cache access.
    """
    torch_default = default_cache_dir()
    named = {var: os.environ.get(var) for var in COMPILE_CACHE_ENV}
    if named["TORCHINDUCTOR_CACHE_DIR"] == torch_default:
        named["TORCHINDUCTOR_CACHE_DIR"] = None  # what torch set at import, not the user's choice
    for var, value in named.items():
        if value and os.path.exists(value):
            check_trusted(value, var, "point it at a folder of your own, or unset it (dschat then uses "
                                      f"{compile_cache_dir()})")
    if not is_trusted(torch_default):
        inductor_config.cpp_cache_precompile_headers = False  # read from <torch_default>/precompiled_headers
    if named["TORCHINDUCTOR_CACHE_DIR"]:
        return Path(named["TORCHINDUCTOR_CACHE_DIR"])
    folder = make_private_dir(compile_cache_dir())
    check_trusted(folder, "torch.compile's cache folder", "set DSCHAT_CACHE_DIR or TORCHINDUCTOR_CACHE_DIR "
                                                          "to a folder of your own")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return folder
