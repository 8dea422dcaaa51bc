"""The trunk served over gRPC (:mod:`fedlm.split.envelope` describes the messages): authenticated sessions,
answered in order, with an idle timeout, caps on sessions in all and per client and, for rounds sent at once,
the turn gate.

No client can hold the server's sessions for long: one client opens at most ``max_sessions_per_client`` at
once, and only accepted work keeps a session alive, so a session that sends nothing or only refused messages
is closed ``stream_timeout_s`` after its last accepted one (or its opening)."""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import yaml

from fedlm.errors import UserError
from fedlm.split import wire
from fedlm.split.envelope import (
    CLIENT_ID_KEY,
    DEFAULT_MAX_MESSAGE_BYTES,
    SERVICE,
    SERVICE_MESSAGE_BYTES,
    TOKEN_KEY,
    pack_envelope,
    size_options,
    unpack_envelope,
)
from fedlm.split.trunk import TO_CLIENT, MessageHook, RejectedMessage, TrunkBackend, handle_request
from fedlm.split.turn_gate import TurnGate

log = logging.getLogger("fedlm")


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


class _IdleClock:
    """Cancels a session ``timeout_s`` after it opened or last had a message accepted. A refused message does
    not count as activity (junk every few seconds must not hold a session, and its slot, for good); the clock
    is paused while a message is worked on, since waiting for the trunk or the turn is not idleness."""

    def __init__(self, context: grpc.ServicerContext, client_id: str, timeout_s: float) -> None:
        self._context, self._client_id, self._timeout_s = context, client_id, timeout_s
        self._deadline = time.monotonic() + timeout_s
        self._timer: threading.Timer | None = None
        self.resume(accepted=False)

    def pause(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def resume(self, accepted: bool) -> None:
        """Run again, from a full ``timeout_s`` if the last message was accepted, else from what was left."""
        self.pause()
        if accepted:
            self._deadline = time.monotonic() + self._timeout_s
        self._timer = threading.Timer(max(self._deadline - time.monotonic(), 0.0), self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        log.warning("trunk: session of client %s idle for %ss, closed (no accepted message in that time)",
                    self._client_id, self._timeout_s)
        self._context.cancel()


class _TrunkService:
    """One ``Session`` call per connected client: authenticate, take one of the client's session slots, then
    answer messages in order."""

    def __init__(
        self, backend: TrunkBackend, tokens: Mapping[str, str], stream_timeout_s: float, hook: MessageHook | None,
        gate: TurnGate | None = None, max_sessions_per_client: int = 2,
    ) -> None:
        self._backend = backend
        self._tokens = dict(tokens)
        self._stream_timeout_s = stream_timeout_s
        self._hook = hook
        self._gate = gate
        self._per_client = max_sessions_per_client
        self._open: Counter[str] = Counter()  # sessions open per client, under _lock (one thread per session)
        self._lock = threading.Lock()

    def session(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        client_id = authenticate(context, self._tokens, "trunk")
        if client_id is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown client id or bad token")
        if not self._claim(client_id):
            log.warning("trunk: refused a session of client %s from %s: it already has %d open (the per-client cap)",
                        client_id, context.peer(), self._per_client)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"client {client_id} already has {self._per_client} "
                          "trunk sessions open, the most one client may have; close one first")
        try:
            log.info("trunk: session of client %s opened from %s", client_id, context.peer())
            idle = _IdleClock(context, client_id, self._stream_timeout_s)
            admitted = False
            try:
                for request in requests:
                    idle.pause()
                    if self._gate is not None:  # the first message waits for this client's turn; later ones need it
                        admitted = self._gate.holds(client_id) if admitted else self._gate.admit(client_id)
                        if not admitted:
                            yield pack_envelope("error", -1, client_id, error="not this client's turn: it is not "
                                                "in the round, its turn has passed, or the round has ended")
                            return
                    answer, accepted = self._answer(client_id, request)
                    idle.resume(accepted)
                    yield answer
            finally:
                idle.pause()
                self._backend.drop(client_id)
                if self._gate is not None:
                    self._gate.end(client_id)
                log.info("trunk: session of client %s closed", client_id)
        finally:
            self._release(client_id)

    def _claim(self, client_id: str) -> bool:
        """Take one of the client's session slots; False when it holds them all."""
        with self._lock:
            if self._open[client_id] >= self._per_client:
                return False
            self._open[client_id] += 1
            return True

    def _release(self, client_id: str) -> None:
        with self._lock:
            self._open[client_id] -= 1
            if not self._open[client_id]:
                del self._open[client_id]

    def _answer(self, client_id: str, request: bytes) -> tuple[bytes, bool]:
        """The answer to one message, and whether it was accepted (an error answer is not)."""
        kind, step = "message", -1
        try:
            header, payload = unpack_envelope(request)
            kind, step = header["kind"], header["step"]
            if header["client_id"] != client_id:
                raise RejectedMessage(f"envelope names client {header['client_id'][:64]!r} in {client_id}'s session")
            answer = handle_request(self._backend, client_id, kind, step, payload, self._hook)
            return pack_envelope(kind, step, client_id, answer), True
        except (wire.WireError, RejectedMessage) as err:
            log.warning("trunk: rejected a %s of step %s from client %s: %s", kind, step, client_id, err)
            reason = str(err)
        except Exception:  # a bug, not the client's fault: keep serving, keep the trace
            log.exception("trunk: the %s of step %s from client %s failed", kind, step, client_id)
            reason = "internal error in the trunk server (see its log)"
        if self._hook is not None:
            self._hook(TO_CLIENT, client_id, "error", {})
        return pack_envelope("error", step, client_id, error=reason), False


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
    max_sessions_per_client: int = 2,
    hook: MessageHook | None = None,
    extra_services: Sequence[grpc.GenericRpcHandler] = (),
    gate: TurnGate | None = None,
) -> TrunkServer:
    """Serve ``backend`` at ``address``; ``tls`` is (cert PEM, key PEM), ``client_ca_pem`` demands client
    certificates signed by that CA. A session idle for ``stream_timeout_s`` is closed and its pending
    forwards dropped (only accepted messages count as activity); beyond ``max_sessions`` concurrent sessions
    in all, or ``max_sessions_per_client`` of one client, new ones get RESOURCE_EXHAUSTED.
    ``max_message_bytes`` defaults to the largest message the backend's limits admit (at most 64 MiB), so
    an oversized message is refused by gRPC before it is read into memory. ``extra_services`` are served
    on the same port (the Flower deployment's parameter relay). ``gate``, if given, admits only the open
    round's clients, one at a time in job order (:mod:`fedlm.split.turn_gate`); without it every
    authenticated session is served as it comes (the simulator's loopback, ``fedlm trunk serve``)."""
    if not tokens:
        raise ValueError("serve_trunk needs at least one client id -> token")
    if max_sessions < 1 or max_sessions_per_client < 1:
        raise ValueError(f"max_sessions ({max_sessions}) and max_sessions_per_client ({max_sessions_per_client}) "
                         "must be >= 1")
    if max_message_bytes is None:
        admitted = backend.limits.max_message_bytes(backend.hidden_size)
        max_message_bytes = min(admitted or DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_MAX_MESSAGE_BYTES)
    if extra_services:  # their messages (the relay's chunks) need not fit the boundary's limit
        max_message_bytes = max(max_message_bytes, SERVICE_MESSAGE_BYTES)
    service = _TrunkService(backend, tokens, stream_timeout_s, hook, gate, max_sessions_per_client)
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
                         options=size_options(max_message_bytes), maximum_concurrent_rpcs=max_calls)
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
