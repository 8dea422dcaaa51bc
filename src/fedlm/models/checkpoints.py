"""Is a checkpoint there? One line saying why not, before transformers tries (and retries) to load it.

transformers answers a mistyped directory with a hub lookup, an empty directory with "install
sentencepiece", and an unknown hub name with a minute of retries and a hundred-line traceback. Here a name
is a local directory with a config.json, a model in the Hugging Face cache, or (online) a model the hub
knows; the hub is asked once, with a short timeout, and not at all when HF_HUB_OFFLINE is set.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from huggingface_hub import constants, model_info, try_to_load_from_cache
from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

from fedlm.errors import UserError

HUB_TIMEOUT_S = 10.0
_SAVED = "a directory written by save_pretrained (a run's model/ directory) or a hub model name"
_MODEL_FILES = ("config.json",)
# what AutoTokenizer reads without a model config (a tokenizer's own save_pretrained writes both)
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "config.json")


def checked_checkpoint(name: str, *, tokenizer_only: bool = False) -> str | Path:
    """``name`` as transformers should load it: an existing directory, or a hub name known to be loadable.
    ``tokenizer_only``: only its tokenizer is wanted, so a directory with a tokenizer and no model will do."""
    path = Path(name).expanduser()
    files = _TOKENIZER_FILES if tokenizer_only else _MODEL_FILES
    if path.is_dir():
        if any((path / file).is_file() for file in files):
            return path
        if not any(path.iterdir()):
            raise UserError(f"checkpoint directory {path} is empty: give {_SAVED}")
        if tokenizer_only:
            raise UserError(f"checkpoint directory {path} holds neither a tokenizer (tokenizer_config.json) nor a "
                            f"model (config.json): give {_SAVED}")
        if any((path / file).is_file() for file in _TOKENIZER_FILES):
            raise UserError(f"checkpoint directory {path} holds only a tokenizer (no config.json), so it has no model "
                            f"to load: set model.preset to train a fresh model with its tokenizer, or give {_SAVED}")
        raise UserError(f"checkpoint directory {path} has no config.json, so it is not a saved model: give {_SAVED}")
    if path.exists():
        raise UserError(f"checkpoint {name} is a file, not a model directory: give {_SAVED}")
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise UserError(f"checkpoint directory {path} does not exist: give {_SAVED}")
    _check_hub(name, files)
    return name


def offline() -> bool:
    """HF_HUB_OFFLINE as set now (huggingface_hub reads it once, at import)."""
    value = os.environ.get("HF_HUB_OFFLINE")
    return constants.HF_HUB_OFFLINE if value is None else value.strip().upper() in constants.ENV_VARS_TRUE_VALUES


@functools.cache
def _check_hub(name: str, files: tuple[str, ...] = _MODEL_FILES) -> None:
    """A hub name: cached (one of ``files``), else asked of the hub once (never while offline)."""
    try:
        if any(isinstance(try_to_load_from_cache(name, file), str) for file in files):
            return
    except HFValidationError:
        raise UserError(f"checkpoint {name!r} is neither a local directory nor a valid hub model name: "
                        f"give {_SAVED}") from None
    if offline():
        raise UserError(f"checkpoint {name!r}: no such local directory, and HF_HUB_OFFLINE is set but the model "
                        "is not in the Hugging Face cache; give a local directory, or unset HF_HUB_OFFLINE to "
                        "download it")
    try:
        model_info(name, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        raise UserError(f"checkpoint {name!r} is gated on the Hugging Face hub: accept its terms there and "
                        "log in (hf auth login)") from None
    except RepositoryNotFoundError:
        raise UserError(f"checkpoint {name!r}: no such local directory, and the Hugging Face hub has no model "
                        "of that name (check the spelling; a private model needs hf auth login)") from None
    except Exception as err:  # connection, proxy, TLS and HTTP errors of every kind
        raise UserError(f"checkpoint {name!r}: no such local directory, and the Hugging Face hub cannot be "
                        f"reached ({type(err).__name__}); check the network, or set HF_HUB_OFFLINE=1 to use a "
                        "cached copy") from None
