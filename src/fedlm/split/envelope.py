"""The trunk's gRPC messages: one bidirectional stream per client session, no protoc codegen.

The service is ``fedlm.Trunk/Session`` (stream of request bytes -> stream of response bytes). Each message
is an *envelope*::

    uint32 little-endian   n = length of the envelope header
    n bytes                header: compact UTF-8 JSON {"kind", "step", "client_id"} (+ "error" on errors)
    rest                   a :mod:`fedlm.split.wire` payload (empty in an error answer)

Requests are ``forward`` or ``backward``; each is answered in order by the same kind or by ``error`` with
the reason, and the session stays open. The envelope costs ``4 + len(header JSON)`` bytes per message on
top of the wire payload (51 for a forward of step 0 by client ``alice``; it grows with the step's digits
and the client id); the transports' ``bytes_sent``/``bytes_received`` count wire payloads only, so gRPC's
equal :class:`~fedlm.split.transport.InProcessTransport`'s. (TLS and HTTP/2 framing are not counted either.)

Authentication: the client id and token travel as call metadata (``fedlm-client-id``, ``fedlm-token``)
and are checked before any message is read; TLS (optionally mutual) protects them in transit. The server side
is :mod:`fedlm.split.grpc_server`, the client side :mod:`fedlm.split.grpc_client`.
"""

from __future__ import annotations

import json
import struct

from fedlm.split import wire

SERVICE = "fedlm.Trunk"
SESSION_METHOD = f"/{SERVICE}/Session"
CLIENT_ID_KEY, TOKEN_KEY = "fedlm-client-id", "fedlm-token"
DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20
SERVICE_MESSAGE_BYTES = 4 * 2**20  # the least a server admits when it hosts other services beside the trunk
_PREFIX = struct.Struct("<I")
_MAX_HEADER = 4096


def pack_envelope(kind: str, step: int, client_id: str, payload: bytes = b"", error: str | None = None) -> bytes:
    header = {"kind": kind, "step": step, "client_id": client_id}
    if error is not None:
        header["error"] = error
    raw = json.dumps(header, separators=(",", ":")).encode()
    return _PREFIX.pack(len(raw)) + raw + payload


def unpack_envelope(message: bytes) -> tuple[dict, bytes]:
    """(header, wire payload); :class:`~fedlm.split.wire.WireError` if the envelope is malformed."""
    if len(message) < _PREFIX.size:
        raise wire.WireError(f"envelope of {len(message)} bytes is shorter than its length prefix")
    (n,) = _PREFIX.unpack_from(message)
    if n > _MAX_HEADER or _PREFIX.size + n > len(message):
        raise wire.WireError(f"envelope header length {n} does not fit a {len(message)}-byte message")
    try:
        header = json.loads(message[_PREFIX.size : _PREFIX.size + n].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise wire.WireError(f"envelope header is not JSON: {err}") from None
    if not (
        isinstance(header, dict)
        and isinstance(header.get("kind"), str)
        and isinstance(header.get("step"), int)
        and isinstance(header.get("client_id"), str)
    ):
        raise wire.WireError("envelope header needs kind (str), step (int) and client_id (str)")
    return header, message[_PREFIX.size + n :]


def size_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """gRPC channel / server options admitting messages up to ``max_message_bytes`` each way."""
    return [("grpc.max_send_message_length", max_message_bytes), ("grpc.max_receive_message_length", max_message_bytes)]
