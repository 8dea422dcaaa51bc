"""The Flower executor with Flower's SecAgg+ between the nodes and the ServerApp (``fedlm.flower.secagg``).

A subclass, not an option of :class:`~fedlm.flower.executor.FlowerExecutor`: only the exchange differs (four
SecAgg+ stages in place of one message per job); routing, wait limits and error naming are the plain one's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from flwr.serverapp import Grid

from fedlm.errors import UserError
from fedlm.federation.codecs import Codec
from fedlm.federation.executor import ClientJob, Result
from fedlm.flower.executor import FlowerExecutor
from fedlm.flower.nodes import NodeDirectory
from fedlm.flower.secagg import FREEZE_REFUSAL, SecAggSettings, SecureAggregation


class SecureFlowerExecutor(FlowerExecutor):
    """Every surviving client's report holds the round's secure aggregate, never its own update."""

    def __init__(self, grid: Grid, nodes: NodeDirectory | dict[int, int], codec: Codec, experiment: str,
                 settings: SecAggSettings, client_sizes: Mapping[int, int], **kwargs: Any) -> None:
        super().__init__(grid, nodes, codec, experiment, **kwargs)
        self.secure = SecureAggregation(grid, settings, client_sizes, self._error_reason)

    def _exchange(self, routed: list[tuple[ClientJob, int]], wait: float | None,
                  on_reply: Callable[[int], None] | None = None) -> dict[int, Result]:
        if on_reply is not None:  # only split rounds listen for replies, and they refuse secure aggregation
            raise ValueError("secure aggregation's four exchanges have no per-reply hook")
        if any(job.frozen for job, _ in routed):
            raise UserError(FREEZE_REFUSAL)
        return self.secure.run(routed, self.codec, self.experiment, self.extra, wait)
