"""A config's ``split`` section resolved once per run: every choice looked up in its registry, the model cut,
and its parameters sorted by owner.

``run_policy`` builds the :class:`SplitSetup` (through :meth:`SplitSetup.sharing`, the engine's view of it) and
the run's policy carries it to the split executor, so the model is cut and introspected once, and a choice's
registry is read in one place; the audit's replay builds its own on its copy of the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fedlm.config import SplitConfig
from fedlm.errors import UserError
from fedlm.federation.local_training import LocalSettings
from fedlm.federation.sharing import SharingPolicy
from fedlm.models.cut import SplitModel
from fedlm.split.modes import TrunkChoice
from fedlm.split.optimizer_state import OPTIMIZER_STATES, OptimizerState
from fedlm.split.parts import PARTS_POLICIES, PartsPolicy, SplitParts, split_model, split_parts
from fedlm.split.trunk import MessageHook, TrunkBackend
from fedlm.split.turns import CONNECTIONS, Connect, Connections


@dataclass(frozen=True)
class SplitSetup:
    """The ``split`` section (``spec``) resolved on a model: the trunk mode and wire precision (``trunk``), the
    parts policy, optimizer state and transport classes, the model cut (``server``) and its parameters by
    owner (``parts``). It holds classes, not their instances: each executor makes its own round state."""

    spec: SplitConfig
    trunk: TrunkChoice
    parts_policy: type[PartsPolicy]
    optimizer_state: type[OptimizerState]
    connections: Connect
    server: SplitModel
    parts: SplitParts

    @classmethod
    def cut(cls, model: torch.nn.Module, spec: SplitConfig) -> SplitSetup:
        """Resolve ``spec``'s choices, refuse a combination that cannot train, then cut and introspect ``model``."""
        trunk = TrunkChoice.of(spec)
        optimizer_state = OPTIMIZER_STATES[spec.optimizer_state]
        if optimizer_state.keeps_state and not trunk.mode.one_trunk:
            raise UserError("split.optimizer_state = carry needs one trunk, but trunk_mode: parallel trains a fresh "
                            "copy per client; use trunk_mode sequential or client_batch, or optimizer_state: reset")
        parts_policy = PARTS_POLICIES[spec.client_parts]
        server = split_model(model, spec)
        return cls(spec, trunk, parts_policy, optimizer_state, CONNECTIONS[spec.transport], server,
                   split_parts(server, parts_policy))

    def sharing(self) -> SplitSharing:
        """The engine's view: the trunk and the shared client parts are global, the kept ones local."""
        return SplitSharing(self.parts.trunk + self.parts.shared, self.parts.local, setup=self)

    def check_remote(self) -> None:
        """Refuse what clients on other machines cannot run: a lockstep trunk, or state kept per client."""
        if self.optimizer_state.keeps_state or self.parts.local or not self.trunk.mode.remote:
            raise UserError("split learning across machines runs trunk_mode sequential or parallel with "
                            "client_parts share or average and optimizer_state reset (client_batch's lockstep "
                            "and state kept per client need the clients in this process)")

    def trunk_backend(self, settings: LocalSettings, max_length: int | None = None) -> TrunkBackend:
        """The server's trunk over this cut (:meth:`~fedlm.split.modes.TrunkChoice.backend`)."""
        return self.trunk.backend(self.server, settings, max_length)

    def connect(self, backend: TrunkBackend, client_ids: list[str], hook: MessageHook | None) -> Connections:
        """The clients' sessions with ``backend`` in this process, over the config's ``split.transport``."""
        return self.connections(backend, client_ids, hook, self.trunk.wire_dtype)


@dataclass(frozen=True)
class SplitSharing(SharingPolicy):
    """A split run's sharing policy, carrying the setup it was read from to the run's split executor."""

    setup: SplitSetup = field(kw_only=True, repr=False, compare=False)
