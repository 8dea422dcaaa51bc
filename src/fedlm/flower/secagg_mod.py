"""The node side of secure aggregation: Flower's ``secaggplus_mod`` around the ClientApp's ``train``.

Light on purpose (Flower only): it runs in the short-lived ClientApp process a SuperNode starts for every
message, which hands training to the node's worker (``fedlm.flower.nodeapp``). What the masked vector holds
is built by ``fedlm.flower.secagg.masked_reply``.
"""

from __future__ import annotations

from flwr.app import Context, Error, Message, MessageType
from flwr.client.mod import secaggplus_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.constant import ErrorCode
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

from fedlm.flower.run_config import truthy

SECURE_KEY = "secure-aggregation"  # run config: on/off; job config: the node answers with a masked reply
REQUIRE_KEY = "require-secure-aggregation"  # node config: this node never sends a plain update
PROTOCOL_REFUSAL = "secure aggregation: "  # how a node's SecAgg+ refusing a stage (its own checks) begins


class _ClientFailed(Exception):
    """The node's training answered with an error: the reply to send instead of a masked vector."""

    def __init__(self, reply: Message) -> None:
        super().__init__(reply.error.reason)
        self.reply = reply


def secure_aggregation_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Route a ``train`` message through Flower's ``secaggplus_mod`` when the server runs SecAgg+; a node
    with node config ``require-secure-aggregation`` refuses any other ``train`` message."""
    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, context)
    if RECORD_KEY_CONFIGS not in msg.content.config_records:
        if truthy(context.node_config.get(REQUIRE_KEY)):
            return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                 "refused: this node sends its update only through secure aggregation "
                                 f"(node config {REQUIRE_KEY}); run with run config {SECURE_KEY}=true"),
                           reply_to=msg)
        return call_next(msg, context)

    def train(inner: Message, ctxt: Context) -> Message:
        reply = call_next(inner, ctxt)
        if reply.has_error():
            raise _ClientFailed(reply)
        return reply

    try:
        return secaggplus_mod(msg, context, train)
    except _ClientFailed as failed:
        return failed.reply
    except (KeyError, TypeError, ValueError) as exc:  # the protocol's own checks (stage order, neighbours)
        # named by type: a KeyError alone reads as a bare node id (the node whose key share is missing)
        return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"{PROTOCOL_REFUSAL}{type(exc).__name__}: {exc}"),
                       reply_to=msg)
