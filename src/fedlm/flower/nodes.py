"""Which Flower node serves each fedlm client, kept current while SuperNodes come and go.

The Grid lists node ids, not node configs, so a node is asked (a ``query`` message) which partition it is.
Node ids are not stable: a SuperNode restarted with the same ``partition-id`` registers under a new id.
:class:`NodeDirectory` therefore re-reads the Grid's node list before each round: nodes that went offline
are dropped, nodes it has not seen are asked, and a new node claiming a partition takes it over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from flwr.app import Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedlm.errors import UserError
from fedlm.flower.messages import PARTITION_KEY

log = logging.getLogger("fedlm")

DEFAULT_QUERY_TIMEOUT_S = 30.0  # how long a round's re-discovery waits for new nodes to say who they are


class NodeDirectory:
    """fedlm client id -> Flower node id, refreshed from the Grid (see the module docstring).

    ``fixed`` makes a directory that never asks the Grid (a mapping known in advance)."""

    def __init__(self, grid: Grid, num_clients: int, query_timeout_s: float = DEFAULT_QUERY_TIMEOUT_S) -> None:
        self.grid = grid
        self.num_clients = num_clients
        self.query_timeout_s = query_timeout_s
        self.nodes: dict[int, int] = {}  # client -> node
        self._answered: dict[int, int | None] = {}  # node -> the client it said it is (None: none of ours)
        self._refreshes = True

    @classmethod
    def fixed(cls, grid: Grid, nodes: dict[int, int]) -> NodeDirectory:
        directory = cls(grid, len(nodes))
        directory.nodes = dict(nodes)
        directory._refreshes = False
        return directory

    def node_of(self, client_id: int) -> int | None:
        return self.nodes.get(client_id)

    def discover(self, wait_s: float, poll_s: float = 0.5) -> dict[int, int]:
        """Wait up to ``wait_s`` for all clients' nodes (SuperNodes may connect after the run starts).

        Clients still missing then fail whenever sampled until a node for them appears; two nodes claiming
        one partition at the start is a deployment mistake and stops the run."""
        deadline = time.monotonic() + wait_s
        asked: set[int] = set()  # once each here; a node that could not say is asked again next round
        while len(self.nodes) < self.num_clients and time.monotonic() < deadline:
            new = [node for node in self.grid.get_node_ids() if node not in asked]
            asked.update(new)
            if not new:
                time.sleep(poll_s)
                continue
            self._ask(new, max(deadline - time.monotonic(), poll_s), at_start=True)
        missing = sorted(set(range(self.num_clients)) - set(self.nodes))
        if len(missing) == self.num_clients:
            raise UserError(f"no Flower node answered as a fedlm client within {wait_s:.0f}s; start SuperNodes "
                            f"with --node-config 'partition-id=<0..{self.num_clients - 1}>'")
        if missing:
            log.warning("no Flower node serves clients %s; they fail whenever sampled", missing)
        return dict(self.nodes)

    def refresh(self) -> None:
        """Before a round: forget nodes the Grid no longer lists, ask the ones it has not seen which client
        they are (a restarted SuperNode comes back under a new node id)."""
        if not self._refreshes:
            return
        online = set(self.grid.get_node_ids())
        for node in [node for node in self._answered if node not in online]:
            self.forget(node, "no longer listed by the SuperLink")
        new = sorted(online - set(self._answered))
        if new:
            self._ask(new, self.query_timeout_s, at_start=False)

    def forget(self, node: int, why: str) -> None:
        """``node`` is gone (offline, or reported unavailable): its client waits for a node to take it over."""
        self._answered.pop(node, None)
        for client_id in [cid for cid, n in self.nodes.items() if n == node]:
            del self.nodes[client_id]
            log.warning("node %d of client %d %s; the client rejoins when a node with partition-id %d connects",
                        node, client_id, why, client_id)

    def _ask(self, nodes: Iterable[int], timeout_s: float, *, at_start: bool) -> None:
        queries = [Message(RecordDict(), dst_node_id=node, message_type=MessageType.QUERY) for node in nodes]
        replies = match_replies(queries, self.grid.send_and_receive(queries, timeout=timeout_s))
        for index, reply in replies.items():
            self._register(queries[index].metadata.dst_node_id, reply, at_start)

    def _register(self, node: int, reply: Message, at_start: bool) -> None:
        if reply.has_error():  # from the node or, for a node that went away, the SuperLink: ask again later
            log.warning("node %d did not say which client it is: %s", node, reply.error.reason)
            return
        client_id = int(reply.content["node"][PARTITION_KEY])
        self._answered[node] = None
        if not 0 <= client_id < self.num_clients:
            log.warning("node %d is partition %d, outside 0..%d; not used", node, client_id, self.num_clients - 1)
            return
        previous = self.nodes.get(client_id)
        if previous is not None and previous != node:
            if at_start:
                raise UserError(f"nodes {previous} and {node} both claim partition-id {client_id}")
            log.warning("node %d now serves client %d (was node %d: restarted?)", node, client_id, previous)
            self._answered[previous] = None
        elif previous is None and not at_start:
            log.info("node %d serves client %d from now on", node, client_id)
        self._answered[node] = client_id
        self.nodes[client_id] = node


class PromptGrid:
    """The ServerApp's Grid, polling for replies every ``poll_s`` seconds.

    Flower's ``send_and_receive`` sleeps 3 s between polls, which adds up to 3 s to every exchange (four of
    them per secure-aggregation round); everything else is the wrapped Grid's."""

    def __init__(self, grid: Grid, poll_s: float = 0.2) -> None:
        self.grid = grid
        self.poll_s = poll_s

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None,
                         on_reply: Callable[[Message], None] | None = None) -> list[Message]:
        """Flower's ``send_and_receive``; ``on_reply`` sees each reply as it arrives."""
        pending = set(self.grid.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while pending:
            arrived = list(self.grid.pull_messages(pending))
            replies.extend(arrived)
            for reply in arrived if on_reply is not None else ():
                on_reply(reply)
            pending -= {reply.metadata.reply_to_message_id for reply in arrived}
            if not pending or (deadline is not None and time.monotonic() >= deadline):
                break
            time.sleep(self.poll_s)
        return replies

    def __getattr__(self, name: str) -> object:
        return getattr(self.grid, name)


def match_replies(sent: list[Message], replies: Iterable[Message]) -> dict[int, Message]:
    """Each reply keyed by the position in ``sent`` of the message it answers (its ``reply_to`` id).

    Matching by sender would miss the SuperLink's own error replies (a node that went away: sent by the
    SuperLink, not the node). A Grid that assigned no message ids falls back to the sender."""
    by_id = {msg.metadata.message_id: i for i, msg in enumerate(sent) if msg.metadata.message_id}
    by_node = {msg.metadata.dst_node_id: i for i, msg in enumerate(sent)}
    matched: dict[int, Message] = {}
    for reply in replies:
        index = by_id.get(reply.metadata.reply_to_message_id)
        if index is None and not by_id:
            index = by_node.get(reply.metadata.src_node_id)
        if index is not None:
            matched[index] = reply
    return matched


def discover_clients(grid: Grid, num_clients: int, wait_s: float, poll_s: float = 0.5) -> dict[int, int]:
    """The client -> node map once, at the start (see :meth:`NodeDirectory.discover`)."""
    return NodeDirectory(grid, num_clients).discover(wait_s, poll_s)
