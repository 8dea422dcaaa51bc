"""Reading a Flower run's settings: run config keys with the app's defaults, and yes/no/auto values.

Light on purpose (Flower and ``fedlm.errors`` only): the node's ClientApp reads its node config through
:func:`truthy` in the short-lived process a SuperNode starts for every message (``fedlm.flower.nodeapp``).
What the ServerApp decides from these keys (secure aggregation, the relay, split dispatch) is in
``fedlm.flower.placement``, which needs the heavy stack.
"""

from __future__ import annotations

from collections.abc import Mapping

from flwr.app import Context, UserConfigValue

from fedlm.errors import UserError

SWITCH_WORDS: dict[str, bool | None] = {"auto": None, "true": True, "1": True, "yes": True,
                                        "false": False, "0": False, "no": False}


def setting(context: Context, key: str, defaults: Mapping[str, UserConfigValue],
            fallback: UserConfigValue | None = None) -> UserConfigValue | None:
    """Run config (non-empty) first, then the app's defaults, then ``fallback``."""
    value = context.run_config.get(key)
    if value in (None, ""):
        value = defaults.get(key)
    return fallback if value in (None, "") else value


def truthy(value: object) -> bool:
    """A yes/no value as TOML or a command line gives it (``true``, ``"yes"``, ``1``); anything else is no."""
    return value is True or SWITCH_WORDS.get(str(value).strip().lower()) is True


def switch(context: Context, key: str, defaults: Mapping[str, UserConfigValue]) -> bool | None:
    """A run config key that reads ``auto`` (None, the default), ``true`` or ``false``; anything else is refused
    rather than read as false."""
    value = str(setting(context, key, defaults, "auto")).strip().lower()
    if value not in SWITCH_WORDS:
        raise UserError(f"run config {key}={value!r}: use auto, true or false")
    return SWITCH_WORDS[value]
