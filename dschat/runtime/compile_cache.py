"""Where ``torch.compile`` keeps its cache: a folder of the user's own, not torch's ``/tmp`` default.

``torch.compile``'s inductor caches what it generates -- Python modules it imports, Triton kernels
and shared libraries it loads, pickled graph-cache entries -- under ``$TORCHINDUCTOR_CACHE_DIR``,
by default ``/tmp/torchinductor_<user>``. torch creates that folder when it is missing (already when
``torch._dynamo`` is imported) and never asks who owns it, so on a shared machine another account
can create it first, writable by all, and put files there that a later compile loads: code that runs
as the user. dschat compiles on CUDA (its Hybrid Engine's decode step, ``--generation_loop graphs``),
so before its first compile :func:`use_private_compile_cache` points the cache at
``cache_dir()/torch-compile`` (made 0700), unless the user named a folder, which must then be the
user's own, as every cache dschat reads (:func:`dschat.runtime.trust.check_trusted`). A cache in the
user's home also outlives ``/tmp``'s clean-ups, so a later run compiles from it.

torch 2.13 keeps two things in its ``/tmp`` default whatever the variable says, their paths fixed
at import: precompiled C++ headers (for C++ kernels, a CPU's, and cpp_wrapper mode), turned off here
(``torch._inductor.config.cpp_cache_precompile_headers``) unless that folder is the user's own; and
the pad-mm benchmark memo, used only with ``TORCHINDUCTOR_ENABLE_CACHING_MODULE=1`` (off by default).

Environment variables read here: ``TORCHINDUCTOR_CACHE_DIR`` (set when absent, or when it holds
torch's own default, which torch writes there at import) and ``TRITON_CACHE_DIR`` (checked, not set:
inductor keeps Triton's cache inside its own folder when it is absent).
"""
from __future__ import annotations

import os
from pathlib import Path

# Free where this is imported (dschat.rlhf.rollout.dschat_engine has imported torch._dynamo, which imports them).
import torch._inductor.config as inductor_config
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from dschat.errors import UserError
from dschat.paths import cache_dir
from dschat.runtime.trust import is_trusted, make_trusted_dir

__all__ = ["COMPILE_CACHE_ENV", "compile_cache_dir", "use_private_compile_cache"]

#: The variables naming torch.compile's cache folders (inductor's, and Triton's inside it by default).
COMPILE_CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def compile_cache_dir() -> Path:
    """``cache_dir()/torch-compile``: dschat's default for ``TORCHINDUCTOR_CACHE_DIR``."""
    return cache_dir() / "torch-compile"


def use_private_compile_cache() -> Path:
    """Make sure ``torch.compile`` reads and writes its cache only in folders of the user's own.

    Inductor's folder is ``TORCHINDUCTOR_CACHE_DIR`` when the user set it, else :func:`compile_cache_dir`
    (the variable also holds torch's own ``/tmp`` default once ``torch._dynamo`` is imported: that is
    replaced). A missing folder is created 0700; an existing one must belong to the user and be
    writable by nobody else (else a :class:`~dschat.errors.UserError`, one line). A ``TRITON_CACHE_DIR``
    outside it is held to the same rule (inside it, torch set it to its own subfolder). Sets the
    variable and returns the folder. Call it before a compile: torch reads the variable at each access.
    """
    torch_default = default_cache_dir()
    named = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if named == torch_default:
        named = None  # what torch set at import, not the user's choice
    folder = Path(named) if named else compile_cache_dir()
    fix = (f"point it at a folder of your own, or unset it (dschat then uses {compile_cache_dir()})" if named else
           "set DSCHAT_CACHE_DIR or TORCHINDUCTOR_CACHE_DIR to a folder of your own")
    _private_folder(folder, "TORCHINDUCTOR_CACHE_DIR" if named else "torch.compile's cache folder", fix)
    triton = os.environ.get("TRITON_CACHE_DIR")
    if triton and not Path(triton).resolve().is_relative_to(folder.resolve()):
        _private_folder(Path(triton), "TRITON_CACHE_DIR",
                        "point it at a folder of your own, or unset it (inductor then keeps it inside its own)")
    if not is_trusted(torch_default):
        inductor_config.cpp_cache_precompile_headers = False  # read from <torch_default>/precompiled_headers
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return folder


def _private_folder(folder: Path, what: str, fix: str) -> None:
    """``folder`` made 0700 when missing, and refused unless it is the user's own (one line each)."""
    try:
        make_trusted_dir(folder, what, fix)
    except OSError as err:  # a read-only home, a file on the way
        raise UserError(f"{what} {folder} cannot be created ({err.strerror or err}); {fix}") from None
