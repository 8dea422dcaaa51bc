"""Flower nodes that die or restart, against Flower's own SuperLink state.

The SuperLink here is Flower's in-memory LinkState with the ServerApp's InMemoryGrid over it (what
``flwr``'s simulation runs on); SuperNodes are threads that register in that state, send heartbeats, pull
their messages and store their replies, answering queries with fedlm's ClientApp. So which nodes are
online, and the error a SuperLink returns for a node that stopped sending heartbeats, are Flower's.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from uuid import uuid4

import pytest
import torch
from flwr.app import Context, Message, MessageType, RecordDict
from flwr.common.constant import NOOP_ACCOUNT_NAME, NOOP_FLWR_AID, SUPERLINK_NODE_ID
from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from fedlm.federation.codecs import get_codec
from fedlm.federation.executor import ClientFailure, ClientJob, ClientReport
from fedlm.federation.local_training import LocalSettings
from fedlm.flower.client import client_app
from fedlm.flower.executor import FlowerExecutor
from fedlm.flower.nodes import NodeDirectory, match_replies
from tests.test_flower import echo

HEARTBEAT_S = 0.4  # a node is offline 2 x this after its last heartbeat (Flower's HEARTBEAT_PATIENCE)
RUN_ID, TASK_ID = 4242, 77

Handler = Callable[[Message, Context], Message | None]


class SuperNode:
    """A node registered in the link state: heartbeats, pulls its messages, stores ``handler``'s replies."""

    def __init__(self, link: Link, partition: int, handler: Handler) -> None:
        self.link, self.partition, self.handler = link, partition, handler
        self.node_id = link.state.create_node(NOOP_FLWR_AID, NOOP_ACCOUNT_NAME, secrets.token_bytes(32),
                                              heartbeat_interval=HEARTBEAT_S)
        link.state.acknowledge_node_heartbeat(self.node_id, HEARTBEAT_S)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def kill(self) -> None:
        """Stop at once: no more heartbeats, no replies (kill -9)."""
        self.stopped.set()
        self.thread.join(5)

    def _serve(self) -> None:
        context = Context(run_id=RUN_ID, node_id=self.node_id, node_config={"partition-id": self.partition},
                          state=RecordDict(), run_config={})
        while not self.stopped.is_set():
            self.link.state.acknowledge_node_heartbeat(self.node_id, HEARTBEAT_S)
            for message in self.link.state.get_message_ins(node_id=self.node_id, limit=1):
                reply = self.handler(message, context)
                if reply is not None and not self.stopped.is_set():
                    reply.metadata.__dict__["_message_id"] = str(uuid4())
                    self.link.state.store_message_res(reply)
            time.sleep(0.02)


class Link:
    """Flower's in-memory SuperLink state for one run, and the Grid a ServerApp gets over it."""

    def __init__(self) -> None:
        factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
        self.state = factory.state()
        run = Run.create_empty(run_id=RUN_ID)
        run.primary_task_id, run.federation_id = TASK_ID, NOOP_FEDERATION_ID
        self.state.run_ids[RUN_ID] = RunRecord(run=run)
        self.state.task_store[TASK_ID] = Task(task_id=TASK_ID, run_id=RUN_ID)
        self.grid = InMemoryGrid(factory, pull_interval=0.02)
        self.grid.set_run(run)
        self.nodes: list[SuperNode] = []

    def start(self, partition: int, handler: Handler | None = None) -> SuperNode:
        node = SuperNode(self, partition, handler or fedlm_node)
        self.nodes.append(node)
        return node

    def close(self) -> None:
        for node in self.nodes:
            node.kill()


def fedlm_node(message: Message, context: Context) -> Message:
    """A node that says who it is with fedlm's ClientApp, and trains by echoing back the parameters x 2."""
    if message.metadata.message_type == MessageType.QUERY:
        return client_app(message, context)
    return echo(2.0)(message)


@pytest.fixture
def link(monkeypatch):
    for attr, value in (("_run_id", RUN_ID), ("_task_id", TASK_ID), ("_node_id", SUPERLINK_NODE_ID)):
        monkeypatch.setattr(TaskIdentity, attr, value)
    monkeypatch.setattr("flwr.supercore.telemetry.FLWR_TELEMETRY_ENABLED", "0")
    link = Link()
    yield link
    link.close()


def _jobs(*client_ids: int) -> list[ClientJob]:
    params = get_codec("fp32").encode({"w": torch.ones(2, 3)})
    return [ClientJob(cid, 1, params, LocalSettings(), seed=cid, timeout_s=None) for cid in client_ids]


def _executor(link: Link, num_clients: int) -> FlowerExecutor:
    nodes = NodeDirectory(link.grid, num_clients, query_timeout_s=10.0)
    nodes.discover(wait_s=10.0)
    return FlowerExecutor(link.grid, nodes, get_codec("fp32"), "name: x", timeout_s=60.0)


def test_a_killed_node_is_reported_unavailable_not_timed_out(link):
    link.start(0)
    dead = link.start(1)
    executor = _executor(link, 2)
    dead.kill()
    started = time.monotonic()
    report, failure = executor.run(_jobs(0, 1))
    took = time.monotonic() - started
    assert isinstance(report, ClientReport) and torch.equal(report.update.params["w"], torch.full((2, 3), 2.0))
    assert isinstance(failure, ClientFailure)
    assert failure.reason == f"node unavailable: node {dead.node_id} stopped sending heartbeats to the SuperLink"
    assert took < 10.0  # the SuperLink's answer, long before the 60 s reply timeout


def test_a_restarted_node_takes_part_again_under_its_new_node_id(link):
    link.start(0)
    first = link.start(1)
    executor = _executor(link, 2)
    assert executor.nodes.nodes == {0: link.nodes[0].node_id, 1: first.node_id}
    first.kill()
    assert isinstance(executor.run(_jobs(1))[0], ClientFailure)  # down: the round goes on without it
    restarted = link.start(1)  # same partition-id, new node id
    assert restarted.node_id != first.node_id
    [report] = executor.run(_jobs(1))
    assert isinstance(report, ClientReport) and report.update.client_id == 1
    assert executor.nodes.node_of(1) == restarted.node_id


def test_a_node_restarted_before_the_superlink_noticed_takes_over_its_partition(link):
    link.start(0)
    first = link.start(1)
    executor = _executor(link, 2)
    first.kill()
    restarted = link.start(1)  # the old node id is still listed online for up to 2 heartbeats
    assert first.node_id in set(link.grid.get_node_ids())
    [report] = executor.run(_jobs(1))
    assert isinstance(report, ClientReport)
    assert executor.nodes.node_of(1) == restarted.node_id


def test_a_node_that_joins_late_is_picked_up_and_strangers_are_left_alone(link):
    link.start(0)
    executor = _executor(link, 3)  # clients 1 and 2 have no node yet
    report, missing = executor.run(_jobs(0, 2))
    assert isinstance(report, ClientReport) and missing.reason == "no Flower node serves client 2"
    link.start(2)
    link.start(9)  # a partition outside this run
    assert [type(r).__name__ for r in executor.run(_jobs(0, 2))] == ["ClientReport", "ClientReport"]
    assert executor.nodes.nodes.keys() == {0, 2}


def test_two_nodes_claiming_one_partition_at_the_start_stop_the_run(link):
    link.start(0)
    link.start(0)
    with pytest.raises(Exception, match="both claim partition-id 0"):
        NodeDirectory(link.grid, 1).discover(wait_s=5.0)


def test_replies_are_matched_to_the_messages_they_answer_not_to_their_sender(link):
    """What the SuperLink answers for a dead node comes from the SuperLink, not from that node."""
    dead = link.start(0)
    alive = link.start(1)
    dead.kill()
    sent = [Message(RecordDict(), dst_node_id=node.node_id, message_type=MessageType.QUERY) for node in (dead, alive)]
    replies = link.grid.send_and_receive(sent, timeout=10.0)
    by_sender = {reply.metadata.src_node_id for reply in replies}
    assert dead.node_id not in by_sender  # the reason sender matching misnamed the cause
    matched = match_replies(sent, replies)
    assert matched[0].has_error() and matched[0].metadata.src_node_id == SUPERLINK_NODE_ID
    assert not matched[1].has_error() and matched[1].metadata.src_node_id == alive.node_id
