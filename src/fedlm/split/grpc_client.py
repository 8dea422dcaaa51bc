"""A client's session with a trunk served over gRPC (:mod:`fedlm.split.grpc_server`), and the simulator's
loopback server that makes every boundary message cross the real gRPC stack."""

from __future__ import annotations

import queue
import secrets
import threading

import grpc
import torch

from fedlm.split import wire
from fedlm.split.certs import throwaway_certificates
from fedlm.split.envelope import (
    CLIENT_ID_KEY,
    DEFAULT_MAX_MESSAGE_BYTES,
    SESSION_METHOD,
    TOKEN_KEY,
    pack_envelope,
    size_options,
    unpack_envelope,
)
from fedlm.split.grpc_server import serve_trunk
from fedlm.split.transport import ClientSide, TransportError
from fedlm.split.trunk import MessageHook, TrunkBackend


def open_channel(address: str, root_cert_pem: bytes | None, client_cert: tuple[bytes, bytes] | None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> grpc.Channel:
    """A channel to ``address``: TLS verified against ``root_cert_pem`` (mutual with ``client_cert``, (cert PEM,
    key PEM)), or plaintext without it, for loopback or trusted networks only."""
    options = size_options(max_message_bytes)
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
