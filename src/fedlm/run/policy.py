"""Which parameters a run shares, keeps per client or freezes, resolved on the prepared model."""

from __future__ import annotations

from typing import Any

import torch

from fedlm.errors import UserError
from fedlm.federation.params import nbytes, trainable_names
from fedlm.federation.sharing import SharingPolicy, build_policy
from fedlm.models.introspect import parameter_groups
from fedlm.run.prepare import Prepared, num_clients_of
from fedlm.split.setup import SplitSetup


def run_policy(prep: Prepared) -> SharingPolicy:
    """The split section's parts, or the sharing section's; refuses downstream fine-tuning without one encoder
    before any training happens. A split run's policy carries its :class:`~fedlm.split.setup.SplitSetup` (the
    model cut and introspected here, once) to the run's executor."""
    config = prep.config
    policy = SplitSetup.cut(prep.model, config.split).sharing() if config.split is not None else sharing_policy(prep)
    if config.downstream and not encoder_is_global(policy):
        raise UserError("downstream fine-tuning needs one global encoder, but this run keeps blocks or embeddings "
                        "on the clients (sharing.critical_layer / isolated / split.client_parts local); drop "
                        "`downstream` or share every layer")
    return policy


def sharing_policy(prep: Prepared) -> SharingPolicy:
    """Resolve the config's sharing section on this model; parameters frozen for everyone stop needing grads."""
    names = trainable_names(prep.model)
    sizes = {cid: len(prep.client_train.get(cid, [])) for cid in range(num_clients_of(prep.config))}
    policy = build_policy(prep.config.sharing, prep.config.protocol.traits, names, sizes,
                          parameter_groups(prep.model))
    params = dict(prep.model.named_parameters())
    for name in policy.frozen_names:
        params[name].requires_grad_(False)
    return policy


def encoder_is_global(policy: SharingPolicy) -> bool:
    """Every embedding and block is shared, so one encoder exists (clients may keep pre-training heads,
    which downstream fine-tuning replaces anyway)."""
    return all(policy.group(name) == "head" for name in policy.local_names)


def describe_policy(policy: SharingPolicy, model: torch.nn.Module) -> dict[str, Any]:
    """What the run shares, for its directory: names and sizes of the global, local and frozen parts."""
    params = dict(model.named_parameters())

    def part(names: list[str]) -> dict[str, Any]:
        size = nbytes({n: params[n].detach() for n in names})
        return {"tensors": len(names), "fp32_bytes": size, "names": names}

    out = {"global": part(policy.global_names), "local": part(policy.local_names),
           "frozen": part(policy.frozen_names)}
    if policy.window is not None:
        out["freeze_window"] = {"epsilon": policy.window.epsilon, "gamma": policy.window.gamma,
                                "blocks": policy.window.blocks,
                                "blocks_frozen_per_client": {c: policy.window.count(c) for c in policy.window.sizes}}
    return out
