"""Secure aggregation through Flower's SecAgg+: the ServerApp learns the weighted mean of the round's updates,
never one client's update.

Flower runs the protocol: its ``SecAggPlusWorkflow`` on the server (key agreement, Shamir shares of each
node's mask seeds, the masked vectors, unmasking with the dropouts' masks rebuilt from their neighbours'
shares) and its ``secaggplus_mod`` on the nodes (quantize, mask). fedlm adds only the glue:

- server: ``secure_executor.SecureFlowerExecutor`` hands each node fedlm's own ``train`` message in place of
  the legacy FitIns the workflow would build, and turns the unmasked aggregate back into the engine's reports.
  Every surviving client's report carries that same aggregate (as Flower's workflow does with its FitRes), so
  the engine's FedAvg-family strategies, which average linearly, aggregate to it unchanged. A node gone before
  its key shares went out is left out of the round, not unmasked (nobody holds a share of its key). When the
  protocol halts, each live client's record names the nodes that dropped, and at which stage;
- node: ``secagg_mod.secure_aggregation_mod`` puts SecAgg+ around the ClientApp's ``train``, and
  :func:`masked_reply` answers with the update *minus the parameters received* (a small vector, so SecAgg+'s
  clipping range rarely binds; one that would be clipped is refused, never silently cut).

Precision: SecAgg+ quantizes each weighted delta ``w_i * d_i`` (``w_i = n_i / max_weight``) to integers on a
grid of step ``2 * clipping_range / T``; stochastic rounding moves each value by less than one step, so an
aggregated value is off by at most ``k * 2 * clipping_range / (T * sum(w_i))`` for ``k`` reporting clients.
``T`` is chosen per round as the largest power of two (at most 2**30) with ``k * T < 2**32`` (Flower's
modulus), so the sum cannot wrap: with 2 equal clients and the default range 8, the bound is 1.5e-8.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    ConfigRecordValues,
    Context,
    Message,
    RecordDict,
    UserConfigValue,
)
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.constant import ErrorCode
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common.recorddict_compat import fitres_to_recorddict
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import SecAggPlusWorkflow, WorkflowState
from flwr.serverapp import Grid

from fedlm.errors import UserError
from fedlm.federation.codecs import Codec, Encoded
from fedlm.federation.executor import ClientFailure, ClientJob, ClientReport
from fedlm.federation.strategies import ClientUpdate
from fedlm.flower.messages import job_content
from fedlm.flower.nodes import match_replies
from fedlm.flower.secagg_mod import PROTOCOL_REFUSAL, SECURE_KEY

log = logging.getLogger("fedlm")

MAX_WEIGHT_KEY, CLIPPING_KEY = "secagg-max-weight", "secagg-clipping-range"  # job config, for the node's check
MODULUS = 2**32  # Flower's default (and largest) modulus for the masked sums
FREEZE_REFUSAL = ("secure aggregation sums one vector shape per round; FFDAPT's freeze_window gives clients "
                  "different ones: drop sharing.freeze_window or set secure-aggregation=false")
STAGES = ("setup", "share keys", "collect masked vectors", "unmask")
DROPPED = ("in setup, before sharing keys", "while sharing keys", "before sending its masked vector",
           "while unmasking")  # a node's dropout, per stage, as the halted round's other clients record it
NAMED_DROPOUTS = 3  # a halted round's records name this many dropped nodes, then count the rest


@dataclass(frozen=True)
class SecAggSettings:
    """SecAgg+'s knobs (run config ``secagg-*``). An int is a count, a float a fraction, as in Flower:
    ``num_shares`` of the sampled nodes hold shares of each node's secrets, ``threshold`` of those shares
    rebuild one; a round completes while every node keeps ``threshold`` live neighbours."""

    num_shares: int | float = 1.0
    threshold: int | float = 0.6
    clipping_range: float = 8.0

    @classmethod
    def from_settings(cls, read: Callable[[str, UserConfigValue], UserConfigValue]) -> SecAggSettings:
        """``read(key, default)`` looks a run config key up (``fedlm.flower.run_config.setting``)."""
        values = {"num_shares": read("secagg-num-shares", cls.num_shares),
                  "threshold": read("secagg-threshold", cls.threshold),
                  "clipping_range": float(read(CLIPPING_KEY, cls.clipping_range))}
        for key in ("num_shares", "threshold"):
            if not isinstance(values[key], int | float) or isinstance(values[key], bool) or values[key] <= 0:
                raise UserError(f"run config secagg-{key.replace('_', '-')}: expected a positive count or "
                                f"fraction, got {values[key]!r}")
        try:  # Flower's own checks (a threshold below the share count, ...), once at the start
            SecAggPlusWorkflow(values["num_shares"], values["threshold"], clipping_range=values["clipping_range"])
        except (TypeError, ValueError) as exc:
            raise UserError(f"run config secagg-*: {exc}") from None
        return cls(**values)


def quantization_range(clients: int) -> int:
    """The finest grid whose sum over ``clients`` quantized values (each at most T) stays below the modulus."""
    t = 2**30
    while clients * t >= MODULUS:
        t //= 2
    return t


def error_bound(clients: int, weights: Sequence[float], clipping_range: float) -> float:
    """Largest difference SecAgg+'s quantization can make to one aggregated value (module docstring)."""
    return clients * 2 * clipping_range / (quantization_range(clients) * sum(weights))


# ---- server ---------------------------------------------------------------------------------------------


class _Collector:
    """The legacy strategy the workflow consults: names the round's nodes, keeps the unmasked result."""

    def __init__(self, grid: Grid, nodes: Iterable[int]) -> None:
        self.proxies = [GridClientProxy(node, grid, run_id=0) for node in nodes]
        self.results: list[tuple[Any, FitRes]] | None = None

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: Any) -> list:
        del server_round, parameters, client_manager
        return [(proxy, FitIns(Parameters(tensors=[], tensor_type=""), {})) for proxy in self.proxies]

    def aggregate_fit(self, server_round: int, results: list, failures: list) -> tuple[None, dict]:
        del server_round, failures
        self.results = results
        return None, {}


class _FedlmSecAggPlus(SecAggPlusWorkflow):
    """Flower's workflow with fedlm's train message (the job) in place of the legacy FitIns it would send, and
    nodes that left before their key shares went out left out of the round (:meth:`_check_threshold`)."""

    def __init__(self, contents: Mapping[int, RecordDict], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.contents = contents
        self.threshold = 0  # the round's share threshold, once the setup stage has set it (for the records)
        self.shares_out = False  # the key shares were forwarded: from then on a dropout must be unmasked

    def setup_stage(self, grid: Grid, context: LegacyContext, state: WorkflowState) -> bool:
        ok = super().setup_stage(grid, context, state)
        state.nid_to_fitins = {node: self.contents[node] for node in state.nid_to_fitins}
        self.threshold = state.threshold
        return ok

    def collect_masked_vectors_stage(self, grid: Grid, context: LegacyContext, state: WorkflowState) -> bool:
        self.shares_out = True
        return super().collect_masked_vectors_stage(grid, context, state)

    def _check_threshold(self, state: WorkflowState) -> bool:
        """Flower counts every node sampled at setup among the dropouts to unmask, but one that left before its
        key shares went out (setup, share keys) masked nothing and nobody holds a share of its key: the
        survivors' ``secaggplus_mod`` refuses to unmask it, which halted every such round however many nodes
        stayed. As in the SecAgg+ paper, such a node is no longer part of the round (nor anyone's neighbour)."""
        if not self.shares_out:
            live = set(state.active_node_ids)
            if not live:  # every node gone: Flower's check, over no nodes at all, would pass
                return False
            state.sampled_node_ids = live
            state.nid_to_neighbours = {node: neighbours & live for node, neighbours in state.nid_to_neighbours.items()
                                       if node in live}
        return super()._check_threshold(state)


class _RecordingGrid:
    """The Grid as the workflow sees it, keeping each stage's reply (or None) per node, for the records."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.stages: list[dict[int, Message | None]] = []

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        sent = list(messages)
        replies = list(self.grid.send_and_receive(sent, timeout=timeout))
        matched = match_replies(sent, replies)
        self.stages.append({msg.metadata.dst_node_id: matched.get(i) for i, msg in enumerate(sent)})
        return replies

    def __getattr__(self, name: str) -> Any:
        return getattr(self.grid, name)


@dataclass(frozen=True)
class _Dropout:
    """A node's first failed SecAgg+ stage (an index into ``STAGES``) and the reason it gives."""

    stage: int
    reason: str
    consequence: bool = False  # its SecAgg+ refused the stage because another node had dropped earlier


def _halted_reason(routed: Sequence[tuple[ClientJob, int]], dropouts: Mapping[int, _Dropout], threshold: int) -> str:
    """What a live client of a halted round records: the nodes that dropped (with their clients) and when, so
    the record says whose absence stopped it (the dropped clients' own records say why)."""
    named = [f"node {node} (client {job.client_id}) dropped {DROPPED[dropouts[node].stage]}"
             for job, node in routed if node in dropouts and not dropouts[node].consequence]
    more = f" and {len(named) - NAMED_DROPOUTS} more" if len(named) > NAMED_DROPOUTS else ""
    why = f"too few nodes stayed to rebuild the masks (SecAgg+ threshold {threshold})"
    if not named:
        return f"secure aggregation halted: {why}; see the other clients' reasons"
    return f"secure aggregation halted: {', '.join(named[:NAMED_DROPOUTS])}{more}; {why}"


class SecureAggregation:
    """One round of SecAgg+ over ``grid`` for routed jobs; used by the ServerApp's secure executor."""

    def __init__(self, grid: Grid, settings: SecAggSettings, client_sizes: Mapping[int, int],
                 error_reason: Callable[[int, int, str], str]) -> None:
        self.grid = grid
        self.settings = settings
        self.client_sizes = dict(client_sizes)
        self.error_reason = error_reason  # (node, code, reason) -> the run's failure reason

    def max_weight(self, jobs: Sequence[ClientJob]) -> float:
        """SecAgg+ weighs client i by ``n_i / max_weight`` (at most 1, or the masked sum could wrap)."""
        return float(max((self.client_sizes.get(job.client_id, 1) for job in jobs), default=1))

    def run(self, routed: Sequence[tuple[ClientJob, int]], codec: Codec, experiment: str,
            extra: Mapping[str, ConfigRecordValues] | None,
            timeout_s: float | None) -> dict[int, ClientReport | ClientFailure]:
        jobs = [job for job, _ in routed]
        if len(routed) < 2:
            why = "secure aggregation needs at least 2 clients' nodes in a round (one would reveal its update)"
            return {job.client_id: ClientFailure(job.client_id, why) for job in jobs}
        max_weight = self.max_weight(jobs)
        extra = {**(extra or {}), SECURE_KEY: True, MAX_WEIGHT_KEY: max_weight,
                 CLIPPING_KEY: self.settings.clipping_range}
        contents = {node: job_content(job, experiment, codec.block_size, extra) for job, node in routed}
        grid = _RecordingGrid(self.grid)
        collector = _Collector(self.grid, contents)
        workflow = _FedlmSecAggPlus(
            contents, num_shares=self.settings.num_shares, reconstruction_threshold=self.settings.threshold,
            max_weight=max_weight, clipping_range=self.settings.clipping_range,
            quantization_range=quantization_range(len(routed)), modulus_range=MODULUS, timeout=timeout_s)
        state = RecordDict({MAIN_CONFIGS_RECORD: ConfigRecord({WorkflowKey.CURRENT_ROUND: jobs[0].round_idx}),
                            MAIN_PARAMS_RECORD: ArrayRecord()})
        context = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=state, run_config={}),
                                strategy=collector)  # type: ignore[arg-type]
        workflow(grid, context)  # type: ignore[arg-type]
        return self._results(routed, grid, collector, codec, workflow.threshold)

    def _results(self, routed: Sequence[tuple[ClientJob, int]], grid: _RecordingGrid, collector: _Collector,
                 codec: Codec, threshold: int) -> dict[int, ClientReport | ClientFailure]:
        by_node = {}
        if collector.results is not None:
            by_node = {int(proxy.node_id): fitres for proxy, fitres in collector.results}
        aggregate = self._aggregate(routed[0][0], collector, codec) if by_node else None
        dropouts = self._dropouts(routed, grid)
        halted = _halted_reason(routed, dropouts, threshold)
        results: dict[int, ClientReport | ClientFailure] = {}
        for job, node in routed:
            fitres = by_node.get(node)
            if fitres is None or aggregate is None:
                dropout = dropouts.get(node)  # a live client of a halted round records the round's reason
                reason = halted if dropout is None or (aggregate is None and dropout.consequence) else dropout.reason
                results[job.client_id] = ClientFailure(job.client_id, reason)
                continue
            metrics = {k: float(v) for k, v in fitres.metrics.items()}  # type: ignore[arg-type]
            upload = sum(_content_bytes(stage.get(node)) for stage in grid.stages)
            results[job.client_id] = ClientReport(ClientUpdate(job.client_id, int(fitres.num_examples), aggregate,
                                                               metrics), upload)
        return results

    @staticmethod
    def _aggregate(job: ClientJob, collector: _Collector, codec: Codec) -> dict[str, torch.Tensor]:
        """The new global parameters: what the clients received plus the unmasked weighted mean delta."""
        assert collector.results
        deltas = parameters_to_ndarrays(collector.results[0][1].parameters)
        received = codec.decode(job.params)
        if len(deltas) != len(received):
            raise RuntimeError(f"secure aggregate has {len(deltas)} tensors, the model {len(received)}")
        return {name: (value.double() + torch.from_numpy(np.asarray(delta, dtype=np.float64))
                       .reshape(value.shape)).to(value.dtype)
                for (name, value), delta in zip(received.items(), deltas, strict=True)}

    def _dropouts(self, routed: Sequence[tuple[ClientJob, int]], grid: _RecordingGrid) -> dict[int, _Dropout]:
        """Each node that failed a stage (no reply, or an error), at its first failure. A node's SecAgg+
        refusing a stage after another node had dropped is that dropout's consequence (a share it never got),
        not a dropout of its own."""
        found: dict[int, tuple[int, str, bool]] = {}  # node -> (stage, reason, its SecAgg+ refused the stage)
        for _, node in routed:
            for index, (name, stage) in enumerate(zip(STAGES, grid.stages, strict=False)):
                if node not in stage:
                    break
                reply = stage[node]
                if reply is None:
                    found[node] = (index, f"timeout: no reply in the secure aggregation's {name} stage", False)
                    break
                if reply.has_error():
                    code, why = reply.error.code, reply.error.reason
                    refused = code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION and why.startswith(PROTOCOL_REFUSAL)
                    found[node] = (index, self.error_reason(node, code, why), refused)
                    break
        first = min((index for index, _, refused in found.values() if not refused), default=len(STAGES))
        return {node: _Dropout(index, reason, refused and index > first)
                for node, (index, reason, refused) in found.items()}


# ---- node -----------------------------------------------------------------------------------------------


def masked_reply(upload: Encoded, job: ClientJob, codec: Codec, num_examples: int, metrics: Mapping[str, float],
                 config: ConfigRecord) -> RecordDict:
    """A secure-aggregation ``train`` reply before masking: the update minus what was received, as the
    server would decode it (the codec's rounding included, so the aggregate matches the simulator's), in the
    order the job sent the parameters. ``secaggplus_mod`` masks it and removes the plain values."""
    received, sent = codec.decode(job.params), codec.decode(upload)
    max_weight, clip = float(config[MAX_WEIGHT_KEY]), float(config[CLIPPING_KEY])
    if num_examples > max_weight:
        raise UserError(f"this node trained on {num_examples} examples, more than the server's SecAgg+ "
                        f"max weight {max_weight:g}: its data differs from the server's partition")
    weight = num_examples / max_weight
    deltas = []
    for name, value in received.items():
        delta = (sent[name].double() - value.double()).numpy()
        largest = float(np.abs(delta).max()) if delta.size else 0.0
        if largest * weight > clip:
            raise UserError(f"update of {name} moved by {largest:g}, beyond SecAgg+'s clipping range {clip:g} "
                            f"at weight {weight:g}: raise the run config {CLIPPING_KEY}")
        deltas.append(delta)
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(deltas), num_examples, dict(metrics))
    return fitres_to_recorddict(fitres, keep_input=False)


def _content_bytes(reply: Message | None) -> int:
    """What a node's SecAgg+ record carried (keys, shares, the masked vector), as Flower counts it."""
    if reply is None or not reply.has_content() or RECORD_KEY_CONFIGS not in reply.content.config_records:
        return 0
    return reply.content.config_records[RECORD_KEY_CONFIGS].count_bytes()
