"""The trunk over gRPC: one bidirectional stream per client session, no protoc codegen.

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
and are checked before any message is read; TLS (optionally mutual) protects them in transit.
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import secrets
import struct
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
import yaml

from fedlm.errors import UserError
from fedlm.split import wire
from fedlm.split.certs import throwaway_certificates
from fedlm.split.transport import ClientSide, TransportError
from fedlm.split.trunk import (
    TO_CLIENT,
    MessageHook,
    RejectedMessage,
    TrunkBackend,
    handle_request,
)
from fedlm.split.turn_gate import TurnGate

__all__ = [
    "SESSION_METHOD",
    "GrpcTransport",
    "LoopbackGrpc",
    "TrunkServer",
    "authenticate",
    "load_tokens",
    "open_channel",
    "pack_envelope",
    "serve_trunk",
    "start_server",
    "unpack_envelope",
]

log = logging.getLogger("fedlm")

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


def authenticate(context: grpc.ServicerContext, tokens: Mapping[str, str], service: str) -> str | None:
    """The caller's client id if its metadata carries that client's token, else None (logged with the reason;
    the client only learns it was refused)."""
    metadata = dict(context.invocation_metadata())
    client_id, token = metadata.get(CLIENT_ID_KEY), metadata.get(TOKEN_KEY)
    expected = tokens.get(client_id) if isinstance(client_id, str) else None
    if expected is not None and isinstance(token, str) and hmac.compare_digest(expected.encode(), token.encode()):
        return client_id
    reason = f"unknown client id {str(client_id)[:64]!r}" if expected is None else f"bad token for client {client_id}"
    log.warning("%s: refused a call from %s: %s", service, context.peer(), reason)
    return None


# ------------------------------------------------------------------------------------------------ server


class _TrunkService:
    """One ``Session`` call per connected client: authenticate, then answer messages in order."""

    def __init__(
        self, backend: TrunkBackend, tokens: Mapping[str, str], stream_timeout_s: float, hook: MessageHook | None,
        gate: TurnGate | None = None,
    ) -> None:
        self._backend = backend
        self._tokens = dict(tokens)
        self._stream_timeout_s = stream_timeout_s
        self._hook = hook
        self._gate = gate

    def session(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        client_id = authenticate(context, self._tokens, "trunk")
        if client_id is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown client id or bad token")
        log.info("trunk: session of client %s opened from %s", client_id, context.peer())
        idle = self._idle_timer(context, client_id)
        admitted = False
        try:
            for request in requests:
                idle.cancel()
                if self._gate is not None:  # the first message waits for this client's turn; later ones need it
                    admitted = self._gate.holds(client_id) if admitted else self._gate.admit(client_id)
                    if not admitted:
                        yield pack_envelope("error", -1, client_id, error="not this client's turn: it is not in "
                                            "the round, its turn has passed, or the round has ended")
                        return
                yield self._answer(client_id, request)
                idle = self._idle_timer(context, client_id)
        finally:
            idle.cancel()
            self._backend.drop(client_id)
            if self._gate is not None:
                self._gate.end(client_id)
            log.info("trunk: session of client %s closed", client_id)

    def _idle_timer(self, context: grpc.ServicerContext, client_id: str) -> threading.Timer:
        def expire() -> None:
            log.warning("trunk: session of client %s idle for %ss, closed", client_id, self._stream_timeout_s)
            context.cancel()

        timer = threading.Timer(self._stream_timeout_s, expire)
        timer.daemon = True
        timer.start()
        return timer

    def _answer(self, client_id: str, request: bytes) -> bytes:
        kind, step = "message", -1
        try:
            header, payload = unpack_envelope(request)
            kind, step = header["kind"], header["step"]
            if header["client_id"] != client_id:
                raise RejectedMessage(f"envelope names client {header['client_id'][:64]!r} in {client_id}'s session")
            return pack_envelope(kind, step, client_id, handle_request(self._backend, client_id, kind, step, payload,
                                                                       self._hook))
        except (wire.WireError, RejectedMessage) as err:
            log.warning("trunk: rejected a %s of step %s from client %s: %s", kind, step, client_id, err)
            reason = str(err)
        except Exception:  # a bug, not the client's fault: keep serving, keep the trace
            log.exception("trunk: the %s of step %s from client %s failed", kind, step, client_id)
            reason = "internal error in the trunk server (see its log)"
        if self._hook is not None:
            self._hook(TO_CLIENT, client_id, "error", {})
        return pack_envelope("error", step, client_id, error=reason)


@dataclass(frozen=True)
class TrunkServer:
    """A started gRPC trunk server and the port it bound (useful with ``host:0``)."""

    server: grpc.Server
    port: int

    def stop(self, grace: float | None = None) -> None:
        """Stop serving; open sessions get ``grace`` seconds to finish."""
        self.server.stop(grace).wait()


def serve_trunk(
    backend: TrunkBackend,
    address: str,
    *,
    tokens: Mapping[str, str],
    tls: tuple[bytes, bytes] | None = None,
    client_ca_pem: bytes | None = None,
    max_message_bytes: int | None = None,
    stream_timeout_s: float = 600.0,
    max_sessions: int = 16,
    hook: MessageHook | None = None,
    extra_services: Sequence[grpc.GenericRpcHandler] = (),
    gate: TurnGate | None = None,
) -> TrunkServer:
    """Serve ``backend`` at ``address``; ``tls`` is (cert PEM, key PEM), ``client_ca_pem`` demands client
    certificates signed by that CA. A session idle for ``stream_timeout_s`` is closed and its pending
    forwards dropped; beyond ``max_sessions`` concurrent sessions, new ones get RESOURCE_EXHAUSTED.
    ``max_message_bytes`` defaults to the largest message the backend's limits admit (at most 64 MiB), so
    an oversized message is refused by gRPC before it is read into memory. ``extra_services`` are served
    on the same port (the Flower deployment's parameter relay). ``gate``, if given, admits only the open
    round's clients, one at a time in job order (:mod:`fedlm.split.turn_gate`); without it every
    authenticated session is served as it comes (the simulator's loopback, ``fedlm trunk serve``)."""
    if not tokens:
        raise ValueError("serve_trunk needs at least one client id -> token")
    if max_message_bytes is None:
        admitted = backend.limits.max_message_bytes(backend.hidden_size)
        max_message_bytes = min(admitted or DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_MAX_MESSAGE_BYTES)
    if extra_services:  # their messages (the relay's chunks) need not fit the boundary's limit
        max_message_bytes = max(max_message_bytes, SERVICE_MESSAGE_BYTES)
    service = _TrunkService(backend, tokens, stream_timeout_s, hook, gate)
    handler = grpc.stream_stream_rpc_method_handler(service.session)
    handlers = (grpc.method_handlers_generic_handler(SERVICE, {"Session": handler}), *extra_services)
    server, port = start_server(address, handlers, tls, client_ca_pem, max_sessions, max_message_bytes)
    log.info("trunk: serving at %s (port %d, %s)", address, port, _security(tls, client_ca_pem))
    return TrunkServer(server, port)


def start_server(address: str, handlers: Sequence[grpc.GenericRpcHandler], tls: tuple[bytes, bytes] | None,
                 client_ca_pem: bytes | None, max_calls: int, max_message_bytes: int) -> tuple[grpc.Server, int]:
    """A started gRPC server for ``handlers`` at ``address`` (TLS when ``tls`` is (cert PEM, key PEM), mutual
    with ``client_ca_pem``) and the port it bound; beyond ``max_calls`` concurrent calls, RESOURCE_EXHAUSTED."""
    if client_ca_pem is not None and tls is None:
        raise ValueError("client certificates (client_ca_pem) need TLS: pass tls=(cert_pem, key_pem)")
    server = grpc.server(ThreadPoolExecutor(max_workers=max_calls, thread_name_prefix="fedlm-grpc"),
                         options=_size_options(max_message_bytes), maximum_concurrent_rpcs=max_calls)
    server.add_generic_rpc_handlers(tuple(handlers))
    if tls is None:
        port = server.add_insecure_port(address)
    else:
        cert, key = tls
        credentials = grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=client_ca_pem, require_client_auth=client_ca_pem is not None
        )
        port = server.add_secure_port(address, credentials)
    server.start()
    return server, port


def _security(tls: tuple[bytes, bytes] | None, client_ca_pem: bytes | None) -> str:
    if tls is None:
        return "plaintext: tokens travel in clear"
    return "mutual TLS" if client_ca_pem is not None else "TLS"


def _size_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_message_bytes), ("grpc.max_receive_message_length", max_message_bytes)]


def load_tokens(path: str | Path) -> dict[str, str]:
    """A YAML or JSON mapping of client id -> token, as the server's ``tokens``; one-line UserError if bad."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"tokens file not found: {path}")
    try:
        tokens = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise UserError(f"tokens file {path} is not valid YAML/JSON: {getattr(err, 'problem', err)}") from None
    if not isinstance(tokens, dict) or not tokens:
        raise UserError(f"tokens file {path} must hold a non-empty mapping of client id -> token")
    bad = [str(cid) for cid, token in tokens.items() if not isinstance(token, str) or not token]
    if bad:
        raise UserError(f"tokens file {path}: clients {', '.join(bad)} need a non-empty string token")
    return {str(cid): token for cid, token in tokens.items()}


# ------------------------------------------------------------------------------------------------ client


def open_channel(address: str, root_cert_pem: bytes | None, client_cert: tuple[bytes, bytes] | None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> grpc.Channel:
    """A channel to ``address``: TLS verified against ``root_cert_pem`` (mutual with ``client_cert``, (cert PEM,
    key PEM)), or plaintext without it, for loopback or trusted networks only."""
    options = _size_options(max_message_bytes)
    if root_cert_pem is None:
        if client_cert is not None:
            raise ValueError("a client certificate needs TLS: pass root_cert_pem too")
        return grpc.insecure_channel(address, options=options)
    cert, key = client_cert if client_cert is not None else (None, None)
    credentials = grpc.ssl_channel_credentials(root_cert_pem, private_key=key, certificate_chain=cert)
    return grpc.secure_channel(address, credentials, options=options)


class GrpcTransport(ClientSide):
    """A client's session with a remote trunk: each ``forward``/``backward`` waits at most ``timeout_s``, the
    first at most ``first_timeout_s`` (default ``timeout_s``): in a round sent at once, the first answer comes
    only once the turns before this client's have ended (:mod:`fedlm.split.turn_gate`).

    ``wire_dtype`` (float16 / bfloat16) sends activations and gradients at 16 bits, halving the boundary's
    bytes; the trunk computes in its own precision and answers in the one it was asked in.

    ``root_cert_pem`` (the server's CA) turns TLS on, ``client_cert`` (cert PEM, key PEM) adds mutual TLS;
    without ``root_cert_pem`` the channel is plaintext, for loopback or trusted networks only. After a
    failure (refused session, lost connection, timeout) every later call raises the same TransportError.
    """

    def __init__(
        self,
        address: str,
        client_id: str,
        token: str,
        *,
        root_cert_pem: bytes | None = None,
        client_cert: tuple[bytes, bytes] | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        timeout_s: float = 60.0,
        first_timeout_s: float | None = None,
        hook: MessageHook | None = None,
        wire_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(client_id, hook, wire_dtype)
        self.address = address
        self._timeout_s = timeout_s
        self._next_timeout_s = timeout_s if first_timeout_s is None else max(timeout_s, first_timeout_s)
        self._channel = open_channel(address, root_cert_pem, client_cert, max_message_bytes)
        self._requests: queue.Queue[bytes | None] = queue.Queue()
        self._answers: queue.Queue[bytes | TransportError] = queue.Queue()
        self._failure: TransportError | None = None
        session = self._channel.stream_stream(SESSION_METHOD)
        metadata = ((CLIENT_ID_KEY, client_id), (TOKEN_KEY, token))
        self._stream = session(iter(self._requests.get, None), metadata=metadata)
        self._reader = threading.Thread(target=self._read, name=f"fedlm-trunk-{client_id}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for answer in self._stream:
                self._answers.put(answer)
            self._answers.put(TransportError(f"trunk server at {self.address} closed the session"))
        except grpc.RpcError as err:
            self._answers.put(TransportError(f"trunk server at {self.address}: {err.code().name}: {err.details()}"))

    def _exchange(self, kind: str, step: int, payload: bytes) -> bytes:
        if self._failure is not None:
            raise self._failure
        self._requests.put(pack_envelope(kind, step, self.client_id, payload))
        timeout_s, self._next_timeout_s = self._next_timeout_s, self._timeout_s
        try:
            answer = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            answer = TransportError(f"no answer from the trunk server at {self.address} within {timeout_s:g}s")
            self._stream.cancel()
        if isinstance(answer, TransportError):
            self._failure = answer
            raise answer
        try:
            header, body = unpack_envelope(answer)
        except wire.WireError as err:
            raise TransportError(f"trunk server sent a malformed answer: {err}") from None
        if header["kind"] == "error":
            raise TransportError(f"trunk refused the {kind} of step {step}: {header.get('error')}")
        if (header["kind"], header["step"]) != (kind, step):
            raise TransportError(f"trunk answered {header['kind']} step {header['step']} to {kind} step {step}")
        return body

    def _end(self) -> None:
        """End the session (the server drops this client's pending forwards) and the channel."""
        self._requests.put(None)
        self._reader.join(timeout=min(self._timeout_s, 5.0))
        self._channel.close()


class LoopbackGrpc:
    """A TLS trunk server on a loopback port with a token per client; each call opens a client session.

    Every boundary message crosses the real gRPC stack (serialisation, TLS, HTTP/2), in one process; the
    hook sees each message as the server receives and answers it."""

    def __init__(self, backend: TrunkBackend, client_ids: list[str], hook: MessageHook | None,
                 wire_dtype: torch.dtype = torch.float32) -> None:
        self._certs = throwaway_certificates("localhost")
        self._tokens = {cid: secrets.token_hex(16) for cid in client_ids}
        self._wire_dtype = wire_dtype
        self.server = serve_trunk(backend, "localhost:0", tokens=self._tokens,
                                  tls=(self._certs["server_cert"], self._certs["server_key"]),
                                  max_sessions=max(16, len(client_ids) + 4), hook=hook)

    def __call__(self, client_id: str) -> GrpcTransport:
        return GrpcTransport(f"localhost:{self.server.port}", client_id, self._tokens[client_id],
                             root_cert_pem=self._certs["ca"], timeout_s=600.0, wire_dtype=self._wire_dtype)

    def close(self) -> None:
        self.server.stop(grace=1.0)
