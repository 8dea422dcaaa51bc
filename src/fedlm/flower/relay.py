"""Parameters beside Flower's messages: the ServerApp serves each job's parameters, and receives each client's
update, over its own gRPC + TLS service; the Flower messages carry only a digest of each.

Why: through a local deployment a FedAvg round of the quickstart (10 clients, 43 MB each way) cost Flower's
processes (SuperLink, SuperNodes, ClientApp processes) about 320 CPU seconds, more than the training they
carried: every message's arrays cross three processes and are stored and forwarded object by object. Here
the node's worker fetches the parameters straight from the ServerApp in one streamed call and uploads its
update the same way; Flower keeps what it is for (which node trains, when, and whether it answered).

The service is ``fedlm.Relay`` with ``Fetch`` (digest -> stream of chunks) and ``Upload`` (stream of chunks ->
digest), authenticated like the trunk (client id and token as call metadata, per-client tokens, TLS). A blob
is the codec's tensors and metadata in one safetensors file, named ``tensor/<name>`` and ``meta/<name>``, so
every dtype a codec produces (fp16, bf16, int8) travels as it is. Secure aggregation keeps the updates in
Flower's messages: SecAgg+ must see them to mask them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import threading
from collections.abc import Iterator, Mapping

import grpc
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from fedlm.federation.params import NamedTensors
from fedlm.split.envelope import CLIENT_ID_KEY, SERVICE_MESSAGE_BYTES, TOKEN_KEY
from fedlm.split.grpc_client import open_channel
from fedlm.split.grpc_server import TrunkServer, authenticate, start_server

log = logging.getLogger("fedlm")

SERVICE = "fedlm.Relay"
CHUNK_BYTES = 2**20
TENSOR, META, ORDER_KEY = "tensor/", "meta/", "order"
DIGEST_KEY = "relay-digest"  # a message's config entry: its parameters (or update) are on the relay


class RelayError(RuntimeError):
    """A blob that could not be fetched or uploaded (refused, lost, or not what its digest says)."""


def to_blob(tensors: NamedTensors, meta: NamedTensors) -> bytes:
    """An encoded update (tensors and their codec metadata) as one safetensors file; the names' order (which
    safetensors does not keep) goes in its metadata."""
    named = {TENSOR + n: t.detach().cpu().contiguous() for n, t in tensors.items()}
    named.update({META + n: t.detach().cpu().contiguous() for n, t in meta.items()})
    return save_safetensors(named, metadata={ORDER_KEY: json.dumps(list(named))})


def from_blob(blob: bytes) -> tuple[NamedTensors, NamedTensors]:
    """(tensors, meta) of ``to_blob``'s file, in the order they were written."""
    try:
        named = load_safetensors(blob)
        (header_bytes,) = struct.unpack_from("<Q", blob)
        order = json.loads(json.loads(blob[8:8 + header_bytes])["__metadata__"][ORDER_KEY])
    except (SafetensorError, struct.error, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"relay blob is not fedlm's safetensors file: {err}") from None
    if sorted(order) != sorted(named) or not all(n.startswith((TENSOR, META)) for n in order):
        raise ValueError("relay blob's names do not match its order, or lie outside tensor/ and meta/")
    tensors = {n.removeprefix(TENSOR): named[n] for n in order if n.startswith(TENSOR)}
    meta = {n.removeprefix(META): named[n] for n in order if n.startswith(META)}
    return tensors, meta


def chunks_of(blob: bytes) -> Iterator[bytes]:
    """``blob`` in gRPC messages of at most ``CHUNK_BYTES``."""
    view = memoryview(blob)
    for start in range(0, len(blob), CHUNK_BYTES):
        yield bytes(view[start:start + CHUNK_BYTES])


def digest_of(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


class RelayStore:
    """The server side: blobs offered for download by digest, and each client's latest upload until taken.

    A client has one pending upload (a newer one replaces it), so an exchange holds at most one update per
    client whatever a client sends; ``clear`` after each exchange drops offers and uploads."""

    def __init__(self, tokens: Mapping[str, str], max_upload_bytes: int = 2**34) -> None:
        self.tokens = dict(tokens)
        self.max_upload_bytes = max_upload_bytes
        self._offers: dict[str, bytes] = {}
        self._uploads: dict[str, tuple[str, bytes]] = {}  # client id -> (digest, blob)
        self._lock = threading.Lock()

    def offer(self, blob: bytes) -> str:
        digest = digest_of(blob)
        with self._lock:
            self._offers[digest] = blob
        return digest

    def take_upload(self, client_id: int, digest: str) -> bytes:
        with self._lock:
            pending = self._uploads.get(str(client_id))
            if pending is not None and pending[0] == digest:
                return self._uploads.pop(str(client_id))[1]
        raise ValueError(f"client {client_id} named an upload ({digest[:12]}) the relay never received")

    def clear(self) -> None:
        with self._lock:
            self._offers.clear()
            self._uploads.clear()

    def handler(self) -> grpc.GenericRpcHandler:
        """The ``fedlm.Relay`` service, to serve beside the trunk or alone (``serve_relay``)."""
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Fetch": grpc.unary_stream_rpc_method_handler(self._fetch),
            "Upload": grpc.stream_unary_rpc_method_handler(self._upload),
        })

    def _caller(self, context: grpc.ServicerContext) -> str:
        client_id = authenticate(context, self.tokens, "relay")
        if client_id is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown client id or bad token")
        return str(client_id)

    def _fetch(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        self._caller(context)
        with self._lock:
            blob = self._offers.get(request.decode(errors="replace"))
        if blob is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "no such parameters here (from an earlier round?)")
        yield from chunks_of(blob)

    def _upload(self, chunks: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        client_id = self._caller(context)
        parts, size = [], 0
        for chunk in chunks:
            size += len(chunk)
            if size > self.max_upload_bytes:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"upload over {self.max_upload_bytes} bytes")
            parts.append(chunk)
        blob = b"".join(parts)
        digest = digest_of(blob)
        with self._lock:
            self._uploads[client_id] = (digest, blob)
        return digest.encode()


class RelayClient:
    """A node's side: fetch a job's parameters, upload its update; each call waits at most ``timeout_s``."""

    def __init__(self, address: str, client_id: str, token: str, root_cert_pem: bytes,
                 client_cert: tuple[bytes, bytes] | None = None, timeout_s: float = 600.0) -> None:
        self.address = address
        self.metadata = ((CLIENT_ID_KEY, client_id), (TOKEN_KEY, token))
        self.timeout_s = timeout_s
        self._channel = open_channel(address, root_cert_pem, client_cert)

    def fetch(self, digest: str) -> bytes:
        call = self._channel.unary_stream(f"/{SERVICE}/Fetch")
        try:
            blob = b"".join(call(digest.encode(), metadata=self.metadata, timeout=self.timeout_s))
        except grpc.RpcError as err:
            raise RelayError(f"relay at {self.address}: fetch refused: {err.code().name}: {err.details()}") from None
        if digest_of(blob) != digest:
            raise RelayError(f"relay at {self.address} sent parameters that do not match their digest")
        return blob

    def upload(self, blob: bytes) -> str:
        call = self._channel.stream_unary(f"/{SERVICE}/Upload")
        try:
            digest = call(chunks_of(blob), metadata=self.metadata, timeout=self.timeout_s).decode()
        except grpc.RpcError as err:
            raise RelayError(f"relay at {self.address}: upload refused: {err.code().name}: {err.details()}") from None
        if digest != digest_of(blob):
            raise RelayError(f"relay at {self.address} stored an upload that does not match what was sent")
        return digest

    def close(self) -> None:
        self._channel.close()


def serve_relay(store: RelayStore, address: str, tls: tuple[bytes, bytes],
                client_ca_pem: bytes | None = None, max_calls: int = 32) -> TrunkServer:
    """``store``'s service alone at ``address`` over TLS (FedAvg-family runs; a split run's trunk hosts it)."""
    server, port = start_server(address, [store.handler()], tls, client_ca_pem, max_calls, SERVICE_MESSAGE_BYTES)
    log.info("relay: serving parameters at %s (port %d)", address, port)
    return TrunkServer(server, port)
