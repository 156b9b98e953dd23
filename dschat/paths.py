"""Where dschat keeps things it builds once: the embedded model, tiny test models."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$DSCHAT_CACHE_DIR``, else ``$XDG_CACHE_HOME/dschat``, else ``~/.cache/dschat``."""
    explicit = os.environ.get("DSCHAT_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "dschat"
