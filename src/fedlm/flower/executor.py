"""The round engine's executor over Flower: each sampled client's job to its node, its reply back as a report.

The node's word is checked, not trusted: a reply must answer its own job, with the shapes it was sent, and
finite values. Used by the ServerApp (``fedlm.flower.app``) for the FedAvg family, and inside
``fedlm.flower.split_clients`` for split learning's client turns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from flwr.app import ConfigRecordValues, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from fedlm.federation.client_round import NonFiniteUpdate, client_failure, refuse_non_finite
from fedlm.federation.codecs import Codec, Encoded
from fedlm.federation.executor import ClientFailure, ClientJob, ClientReport, Executor, Result
from fedlm.federation.observer import SILENT, RoundObserver
from fedlm.federation.params import NamedTensors
from fedlm.federation.strategies import ClientUpdate
from fedlm.flower.messages import encoded_from_blob, encoded_from_records, is_relayed, job_content
from fedlm.flower.nodes import NodeDirectory, match_replies
from fedlm.flower.relay import DIGEST_KEY, RelayStore, to_blob
from fedlm.split.grpc_server import TrunkServer

DEFAULT_REPLY_TIMEOUT_S = 3600.0
DEFAULT_REPLY_GRACE_S = 120.0  # beyond client_timeout_s: a node's data preparation and the transfers
ERROR_NAMES = {value: name for name, value in vars(ErrorCode).items() if isinstance(value, int)}


class FlowerExecutor(Executor):
    """The round engine's executor over Flower: each job to its client's node in one ``send_and_receive``,
    results in job order.

    Job order (not arrival order) keeps the aggregation's summation order, hence the result, identical to
    the in-process simulator's.
    """

    def __init__(self, grid: Grid, nodes: NodeDirectory | dict[int, int], codec: Codec, experiment: str,
                 timeout_s: float | None = DEFAULT_REPLY_TIMEOUT_S, observer: RoundObserver = SILENT,
                 extra: Mapping[str, ConfigRecordValues] | None = None,
                 grace_s: float = DEFAULT_REPLY_GRACE_S, relay: RelayStore | None = None,
                 owned_server: TrunkServer | None = None) -> None:
        self.grid = grid
        self.nodes = nodes if isinstance(nodes, NodeDirectory) else NodeDirectory.fixed(grid, nodes)
        self.codec = codec
        self.experiment = experiment
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.observer = observer  # hears of each client as the round's results are in
        self.extra = extra
        self.relay = relay  # parameters and updates beside the messages (``fedlm.flower.relay``)
        self.owned_server = owned_server  # the relay's own server, stopped with the executor

    def run(self, jobs: list[ClientJob], on_reply: Callable[[int], None] | None = None) -> list[Result]:
        """Each job's result in job order; ``on_reply`` (with a ``PromptGrid``) hears each client id as its
        reply arrives, or at once for a client no node serves."""
        results, routed = self._route(jobs)
        for client_id in results if on_reply is not None else ():
            on_reply(client_id)
        results.update(self._exchange(routed, self.wait_s(jobs), on_reply))
        for job in jobs:
            self.observer.client_done(job.client_id)
        return [results[job.client_id] for job in jobs]

    def _route(self, jobs: list[ClientJob]) -> tuple[dict[int, Result], list[tuple[ClientJob, int]]]:
        """Each job paired with its client's node; a client without one fails at once."""
        self.nodes.refresh()  # a SuperNode restarted since the last round takes part again
        results: dict[int, Result] = {}
        routed: list[tuple[ClientJob, int]] = []
        for job in jobs:
            node = self.nodes.node_of(job.client_id)
            if node is None:
                results[job.client_id] = ClientFailure(job.client_id, f"no Flower node serves client {job.client_id}")
            else:
                routed.append((job, node))
        return results, routed

    def _exchange(self, routed: list[tuple[ClientJob, int]], wait: float | None,
                  on_reply: Callable[[int], None] | None = None) -> dict[int, Result]:
        """One train message per routed job, each client's update read back in the clear."""
        try:
            digests: dict[int, str | None] = {}  # jobs sharing one parameter set share its blob on the relay
            for job, _ in routed:
                if id(job.params) not in digests:
                    digests[id(job.params)] = self._offer(job.params)
            messages = [Message(job_content(job, self.experiment, self.codec.block_size, self.extra,
                                            digests[id(job.params)]),
                                dst_node_id=node, message_type=MessageType.TRAIN, ttl=wait, group_id=str(job.round_idx))
                        for job, node in routed]
            heard = {}
            if on_reply is not None:  # only PromptGrid takes it: the deployment's ServerApp always has one
                def arrived(reply: Message) -> None:
                    for index in match_replies(messages, [reply]):
                        on_reply(routed[index][0].client_id)

                heard = {"on_reply": arrived}
            replies = match_replies(messages, self.grid.send_and_receive(messages, timeout=wait, **heard)) \
                if messages else {}
            results: dict[int, Result] = {}
            for index, (job, node) in enumerate(routed):
                reply = replies.get(index)
                results[job.client_id] = (ClientFailure(job.client_id, self._no_reply(wait)) if reply is None
                                          else self._read_reply(job, node, reply))
            return results
        finally:
            if self.relay is not None:
                self.relay.clear()  # the round's parameters and updates, taken or not

    def _offer(self, params: Encoded) -> str | None:
        """The digest of ``params`` put on the relay (None: no relay, they travel in the message)."""
        return None if self.relay is None else self.relay.offer(to_blob(params.tensors, params.meta))

    def wait_s(self, jobs: list[ClientJob]) -> float | None:
        """How long the round waits for replies: the reply timeout, cut to the clients' own deadline
        (``client_timeout_s``) plus ``grace_s`` for preparation and transfer when every job has one. A node
        abandons a job at its deadline and answers with a timeout; one that cannot answer is cut off here."""
        limits = [job.timeout_s for job in jobs]
        if not jobs or not all(limits):
            return self.timeout_s
        own = max(limit for limit in limits if limit) + self.grace_s
        return own if self.timeout_s is None else min(self.timeout_s, own)

    def close(self) -> None:
        """Stop the relay's own server, if any (the nodes outlive the run)."""
        if self.owned_server is not None:
            self.owned_server.stop(grace=1.0)

    @staticmethod
    def _no_reply(wait: float | None) -> str:
        return f"timeout: no reply within {wait:.0f}s" if wait else "no reply"

    def _read_reply(self, job: ClientJob, node: int, reply: Message) -> Result:
        if reply.has_error():
            return ClientFailure(job.client_id, self._error_reason(node, reply.error.code, reply.error.reason))
        try:
            return self._report(job, reply.content)
        except NonFiniteUpdate as exc:
            return client_failure(job.client_id, exc)
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            return ClientFailure(job.client_id, f"malformed reply: {type(exc).__name__}: {exc}")

    def _error_reason(self, node: int, code: int, reason: str) -> str:
        """An error reply as the run records it. The client's own errors already read as fedlm's reasons
        (``timeout: ...``, ``exception: ...``); the SuperLink's are named by what happened to the node."""
        if code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION and reason:
            return reason
        if code == ErrorCode.NODE_UNAVAILABLE:
            self.nodes.forget(node, "is unavailable")
            return f"node unavailable: node {node} stopped sending heartbeats to the SuperLink"
        if code in (ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE):
            return f"message expired: the job or its reply outlived its time to live ({reason})"
        return f"Flower error {ERROR_NAMES.get(code, code)}: {reason}"

    def _report(self, job: ClientJob, content: RecordDict) -> ClientReport:
        """A reply as the engine's report; the node's word is checked, not trusted (shapes, finiteness)."""
        if int(content["config"]["client-id"]) != job.client_id:
            raise ValueError(f"reply is from client {content['config']['client-id']}, not {job.client_id}")
        received, sent_bytes, meta_bytes = self._received(job, content)
        skip = set(job.frozen)  # frozen this round: trained by nobody here, so not sent back
        _check_like(received.tensors, {n: t for n, t in job.params.tensors.items() if n not in skip}, "parameter")
        _check_like(received.meta, {n: t for n, t in job.params.meta.items() if n not in skip}, "metadata")
        params = self.codec.decode(received)
        refuse_non_finite(params)
        metrics = content["metrics"]
        extra = {k: float(v) for k, v in metrics.items() if k != "num-examples"}
        in_sent_order = {n: params[n] for n in job.params.tensors if n not in skip}
        update = ClientUpdate(job.client_id, int(metrics["num-examples"]), in_sent_order, extra)
        return ClientReport(update, sent_bytes, upload_meta_bytes=meta_bytes)

    def _received(self, job: ClientJob, content: RecordDict) -> tuple[Encoded, int, int]:
        """The update as the codec encoded it, and the bytes it took (all, and those of its metadata): the
        relay's blob (safetensors' header included), or the message's arrays (with Flower's framing)."""
        if is_relayed(content):
            if self.relay is None:
                raise ValueError("the reply points at a relay this run does not serve")
            blob = self.relay.take_upload(job.client_id, str(content["config"][DIGEST_KEY]))
            received = encoded_from_blob(blob, self.codec.name)
            return received, len(blob), received.meta_bytes
        arrays, meta = content["arrays"], content["meta"]
        meta_bytes = meta.count_bytes()
        return encoded_from_records(arrays, meta, self.codec.name), arrays.count_bytes() + meta_bytes, meta_bytes


def _check_like(received: NamedTensors, sent: NamedTensors, what: str) -> None:
    """An update is encoded like the parameters it answers: same names, shapes and dtypes."""
    if set(received) != set(sent):
        raise ValueError(f"{what} names differ from those sent ({len(received)} vs {len(sent)})")
    for name, value in received.items():
        if value.shape != sent[name].shape or value.dtype != sent[name].dtype:
            raise ValueError(f"{name}: got {value.dtype}{tuple(value.shape)}, "
                             f"expected {sent[name].dtype}{tuple(sent[name].shape)}")
