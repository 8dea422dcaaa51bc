"""The split-learning boundary: wire format, trunk backend, in-process and gRPC (TLS) transports, `trunk serve`."""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import struct
import time
import types

import grpc
import pytest
import torch
import torch.nn.functional as F
import yaml

from fedlm.cli import _parser, main
from fedlm.config import SplitConfig
from fedlm.federation.local_training import LocalSettings
from fedlm.models.build import build_model, build_tokenizer
from fedlm.models.cut import Activations, Cut, SplitModel
from fedlm.split import wire
from fedlm.split.certs import throwaway_certificates
from fedlm.split.envelope import SESSION_METHOD, pack_envelope, unpack_envelope
from fedlm.split.grpc_client import GrpcTransport
from fedlm.split.grpc_server import serve_trunk
from fedlm.split.modes import TrunkChoice
from fedlm.split.transport import InProcessTransport, TransportError
from fedlm.split.trunk import (
    TO_CLIENT,
    TO_SERVER,
    RejectedMessage,
    TrunkBackend,
)
from fedlm.tasks import get_task
from tests.conftest import tiny_config
from tests.split_helpers import MessageLog

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORDS = ["the", "a", "farmer", "client", "server", "model", "trained", "shared", "weights", "boats", "river"]
TEXTS = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(3 + i % 7)) + "." for i in range(40)]
HIDDEN = 32
LR = 0.5
TOKENS = {"alice": "alice-secret", "bob": "bob-secret"}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(None, "bert", TEXTS, 200)


@pytest.fixture(scope="module")
def model(tokenizer):
    overrides = {"hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2}
    return build_model("bert", "tiny", "mlm", tokenizer, overrides=overrides, seed=0).train()


@pytest.fixture(scope="module")
def batch(tokenizer):
    task = get_task("mlm", tokenizer)
    rows = [{"input_ids": tokenizer(text)["input_ids"]} for text in TEXTS[:4]]
    out = task.collate(rows, torch.Generator().manual_seed(3))
    assert (out["attention_mask"] == 0).any()
    return out


# ------------------------------------------------------------------------------------------------ certificates


@pytest.fixture(scope="module")
def certs() -> dict[str, bytes]:
    """A throwaway CA, a server certificate for localhost and a client certificate, all signed by the CA."""
    return throwaway_certificates("localhost")


# ------------------------------------------------------------------------------------------------ helpers


def _loss(split: SplitModel, hidden: torch.Tensor, batch: dict) -> torch.Tensor:
    logits = split.top.logits(hidden)
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def _hop(acts: Activations) -> Activations:
    return Activations.from_dict({name: t.detach().clone() for name, t in acts.to_dict().items()}).detached()


def _direct_step(split: SplitModel, batch: dict) -> torch.Tensor:
    """The step done by hand in one process, as in test_split.py."""
    client_opt = torch.optim.SGD(split.client_parameters(), lr=LR)
    server_opt = torch.optim.SGD(split.trunk_parameters(), lr=LR)
    sent = split.bottom(batch["input_ids"], batch["attention_mask"])
    received = _hop(sent)
    out = split.trunk(received)
    top_in = _hop(out)
    loss = _loss(split, split.top(top_in), batch)
    loss.backward()
    out.hidden.backward(top_in.hidden.grad.clone())
    sent.hidden.backward(received.hidden.grad.clone())
    client_opt.step()
    server_opt.step()
    return loss.detach()


def _transport_step(split: SplitModel, transport, batch: dict, step: int = 0) -> torch.Tensor:
    """The same step with the trunk behind a transport; the client steps only its own parameters."""
    client_opt = torch.optim.SGD(split.client_parameters(), lr=LR)
    sent = split.bottom(batch["input_ids"], batch["attention_mask"])
    top_in = transport.forward(step, sent)
    loss = _loss(split, split.top(top_in), batch)
    loss.backward()
    sent.hidden.backward(transport.backward(step, top_in.hidden.grad))
    client_opt.step()
    return loss.detach()


def _server(model) -> tuple[SplitModel, TrunkBackend]:
    """The server's own copy of the model; only its trunk is used."""
    split = SplitModel(copy.deepcopy(model), Cut(1, 1))
    return split, TrunkBackend(split.trunk, HIDDEN, lambda params: torch.optim.SGD(params, lr=LR))


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in module.state_dict().items()}


def _assert_same(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)


def _tls_server(backend, certs, **kwargs):
    return serve_trunk(
        backend, "localhost:0", tokens=TOKENS, tls=(certs["server_cert"], certs["server_key"]), **kwargs
    )


def _client(server, client_id: str, certs, token: str | None = None, **kwargs) -> GrpcTransport:
    return GrpcTransport(
        f"localhost:{server.port}", client_id, token or TOKENS[client_id], root_cert_pem=certs["ca"], timeout_s=20,
        **kwargs,
    )


# ------------------------------------------------------------------------------------------------------- wire


def _raw(header: list, data: bytes = b"") -> bytes:
    """A hand-made payload: length prefix, JSON header, data."""
    return _raw_text(json.dumps(header), data)


def _raw_text(header: str, data: bytes = b"") -> bytes:
    text = header.encode()
    return struct.pack("<I", len(text)) + text + data


def test_wire_round_trips_every_dtype_with_exact_sizes():
    tensors = {
        "f32": torch.randn(2, 3, 4),
        "f16": torch.randn(5).half(),
        "bf16": torch.randn(3, 2).bfloat16(),
        "i64": torch.arange(6).reshape(2, 3),
        "flag": torch.tensor([[True, False, True]]),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
    }
    payload = wire.encode(tensors)
    data = sum(t.numel() * t.element_size() for t in tensors.values())
    assert len(payload) == data + wire.header_length(payload)
    decoded = wire.decode(payload)
    assert list(decoded) == list(tensors)
    for name, tensor in tensors.items():
        assert decoded[name].dtype == tensor.dtype and torch.equal(decoded[name], tensor), name


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\x01", "shorter than its 4-byte length prefix"),
        (b"\xff\xff\x00\x00[]", "runs past the end"),
        (b"\x03\x00\x00\x00{]x", "header is not JSON"),
        (b"\x02\x00\x00\x00{}", "must be a list"),
        (wire.encode({"x": torch.ones(2)}) + b"\x00", "payload has 9 data bytes, its header describes 8"),
        (wire.encode({"x": torch.ones(2)})[:-1], "payload has 7 data bytes"),
        (_raw([["x", "int32", [1]]], b"\x00" * 4), "dtype 'int32'"),
        (_raw([["x", "float32", [-1]]]), "sizes >= 0"),
        (_raw([["x", "float32", [1.5]]], b"\x00" * 4), "sizes >= 0"),
        # no data, but each size is checked on its own: torch could not build these
        (_raw([["x", "float32", [0, 10**20, 64]]]), "has shape [0, 100000000000000000000, 64]"),
        (_raw([["x", "float32", [0, 1e20, 64]]]), "has shape [0, 1e.20, 64]"),
        (_raw([["x", "float32", [0, 2**31, 1]]]), "has shape [0, 2147483648, 1]"),
        (_raw([["x", "float32", [0, 2**16, 2**16]]]), "multiplying to at most 2147483647"),
        (_raw([["x", "float32", [True]]], b"\x00" * 4), "has shape [True]"),
        (_raw_text('[["x","float32",[' + "9" * 5000 + "]]]"), "integer of 5000 digits"),  # past int()'s limit
        (_raw([["x", "int64", [0]], ["x", "int64", [0]]]), "appears twice"),
        (_raw([["x"]]), "is not [name, dtype, shape]"),
        (_raw([["b", "bool", [1]]], b"\x07"), "bytes other than 0 and 1"),
    ],
)
def test_wire_refuses_garbage_with_its_reason(payload, reason):
    with pytest.raises(wire.WireError, match=reason.replace("[", r"\[")):
        wire.decode(payload)


def test_wire_still_carries_an_empty_tensor():
    assert wire.decode(_raw([["x", "float32", [0, 5, 64]]]))["x"].shape == (0, 5, 64)


def test_wire_refuses_other_dtypes():
    with pytest.raises(wire.WireError, match=r"dtype torch\.int32"):
        wire.encode({"ids": torch.ones(2, dtype=torch.int32)})


# ------------------------------------------------------------------------------------------------ full step


def test_step_through_both_transports_equals_the_direct_step(model, batch, certs):
    reference = SplitModel(copy.deepcopy(model), Cut(1, 1))
    torch.manual_seed(11)  # dropout is on: each run draws the same random numbers in the same order
    ref_loss = _direct_step(reference, batch)
    ref_client = {name: p.detach().clone() for name, p in zip(
        reference.client_parameter_names(), reference.client_parameters(), strict=True)}
    ref_trunk = _snapshot(reference.trunk)
    sent = reference.bottom(batch["input_ids"], batch["attention_mask"]).to_dict()
    forward_bytes = sum(t.numel() * t.element_size() for t in sent.values())
    forward_bytes += wire.header_length(wire.encode(sent))

    counts = {}
    for name in ("in-process", "grpc"):
        client = SplitModel(copy.deepcopy(model), Cut(1, 1))
        server_split, backend = _server(model)
        client_log, server_log = MessageLog(), MessageLog()
        server = _tls_server(backend, certs, hook=server_log) if name == "grpc" else None
        try:
            if server is None:
                transport = InProcessTransport(backend, "alice", hook=client_log)
            else:
                transport = _client(server, "alice", certs, hook=client_log)
                # the client side holds no trunk (nor any) parameters
                assert not any(isinstance(v, torch.nn.Module | torch.Tensor | TrunkBackend)
                               for v in vars(transport).values())
            torch.manual_seed(11)
            sent_before = transport.bytes_sent
            loss = _transport_step(client, transport, batch)
            transport.close()
        finally:
            if server is not None:
                server.stop(grace=None)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
        got_client = dict(zip(client.client_parameter_names(), client.client_parameters(), strict=True))
        _assert_same({k: v.detach() for k, v in got_client.items()}, ref_client)
        _assert_same(_snapshot(server_split.trunk), ref_trunk)
        # what crossed, seen from the client (and from the gRPC server): no ids, no labels
        for log in (client_log, server_log) if server is not None else (client_log,):
            assert [(m.direction, m.kind) for m in log.messages] == [
                (TO_SERVER, "forward"), (TO_CLIENT, "forward"), (TO_SERVER, "backward"), (TO_CLIENT, "backward")
            ]
            assert log.names(TO_SERVER) == {"hidden", "attention_mask", "grad"}
            assert log.names(TO_CLIENT) == {"hidden", "grad"}
        forward = client_log.messages[0].tensors
        assert forward == {"hidden": ("float32", (4, batch["input_ids"].shape[1], HIDDEN)),
                           "attention_mask": ("int64", tuple(batch["attention_mask"].shape))}
        assert sent_before == 0
        counts[name] = (transport.bytes_sent, transport.bytes_received)
    # gRPC's envelope (documented in fedlm.split.envelope) is not counted: payload bytes match exactly
    assert counts["grpc"] == counts["in-process"]
    hidden = torch.zeros(*batch["input_ids"].shape, HIDDEN)
    grad_bytes = hidden.numel() * 4 + wire.header_length(wire.encode({"grad": hidden}))
    hidden_bytes = hidden.numel() * 4 + wire.header_length(wire.encode({"hidden": hidden}))
    assert counts["grpc"] == (forward_bytes + grad_bytes, hidden_bytes + grad_bytes)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_boundary_halves_the_activation_bytes_and_keeps_the_step(model, batch, certs, dtype):
    """Activations and gradients cross in 16 bits both ways; the trunk still computes in float32; the step
    matches the float32 step up to 16-bit rounding; the bytes saved are exactly 2 per value crossed."""
    name = str(dtype).removeprefix("torch.")
    results = {}
    for transport_name in ("in-process", "grpc"):
        for wire_dtype in (torch.float32, dtype):
            client = SplitModel(copy.deepcopy(model), Cut(1, 1))
            server_split, backend = _server(model)
            log = MessageLog()
            server = _tls_server(backend, certs) if transport_name == "grpc" else None
            try:
                transport = (InProcessTransport(backend, "alice", hook=log, wire_dtype=wire_dtype) if server is None
                             else _client(server, "alice", certs, hook=log, wire_dtype=wire_dtype))
                torch.manual_seed(11)
                loss = _transport_step(client, transport, batch)
                transport.close()
            finally:
                if server is not None:
                    server.stop(grace=None)
            values = sum(math.prod(shape) for m in log.messages for n, (_, shape) in m.tensors.items()
                         if n in ("hidden", "grad"))
            floats = {dtype_name for m in log.messages for n, (dtype_name, _) in m.tensors.items()
                      if n in ("hidden", "grad")}
            params = {**_snapshot(server_split.trunk), **dict(zip(
                client.client_parameter_names(), [p.detach().clone() for p in client.client_parameters()],
                strict=True))}
            results[transport_name, wire_dtype] = (loss, params, transport, values, floats)
        loss32, params32, full, values, floats32 = results[transport_name, torch.float32]
        loss16, params16, half, values16, floats16 = results[transport_name, dtype]
        assert floats32 == {"float32"} and floats16 == {name} and values == values16
        assert all(p.dtype == torch.float32 for p in server_split.trunk.parameters())
        torch.testing.assert_close(loss16, loss32, rtol=0, atol=2e-2)
        for key in params32:
            torch.testing.assert_close(params16[key], params32[key], rtol=0, atol=2e-2, msg=key)
        headers = 4 * len(name) - 4 * len("float32")  # the dtype's name in each of the 4 headers
        saved = (full.bytes_sent + full.bytes_received) - (half.bytes_sent + half.bytes_received)
        assert saved == 2 * values - headers
        assert half.bytes_sent + half.bytes_received < 0.6 * (full.bytes_sent + full.bytes_received)


def test_a_message_mixing_float_dtypes_is_refused(model, batch):
    from fedlm.split.trunk import handle_request

    _, backend = _server(model)
    hidden = torch.zeros(*batch["input_ids"].shape, HIDDEN)
    payload = wire.encode({"hidden": hidden.half(), "attention_mask": batch["attention_mask"],
                           "position_ids": torch.zeros(1, hidden.shape[1]).float()})
    with pytest.raises(RejectedMessage, match="mixes floating-point dtypes"):
        handle_request(backend, "alice", "forward", 0, payload)


def test_forward_bytes_sent_is_the_serialised_size(model, batch):
    client = SplitModel(copy.deepcopy(model), Cut(1, 1))
    _, backend = _server(model)
    transport = InProcessTransport(backend, "alice")
    sent = client.bottom(batch["input_ids"], batch["attention_mask"])
    transport.forward(0, sent)
    payload = wire.encode(sent.to_dict())
    data = sum(t.numel() * t.element_size() for t in sent.to_dict().values())
    assert transport.bytes_sent == len(payload) == data + wire.header_length(payload)
    answer = wire.encode({"hidden": torch.zeros(*batch["input_ids"].shape, HIDDEN)})
    assert transport.bytes_received == len(answer) == batch["input_ids"].numel() * HIDDEN * 4 + wire.header_length(
        answer)


# ------------------------------------------------------------------------------------------------ rejections


def test_rejected_messages_are_logged_and_change_nothing(model, batch, certs, caplog):
    caplog.set_level(logging.INFO, logger="fedlm")
    client = SplitModel(copy.deepcopy(model), Cut(1, 1))
    server_split, backend = _server(model)
    before = _snapshot(server_split.trunk)
    server = _tls_server(backend, certs)
    try:
        acts = client.bottom(batch["input_ids"], batch["attention_mask"])

        for client_id, token, logged in (("alice", "wrong", "bad token for client alice"),
                                         ("mallory", "x", "unknown client id 'mallory'")):
            intruder = _client(server, client_id, certs, token=token)
            with pytest.raises(TransportError, match="UNAUTHENTICATED: unknown client id or bad token"):
                intruder.forward(0, acts)
            intruder.close()
            assert logged in caplog.text

        bob = _client(server, "bob", certs)
        wrong_width = Activations(torch.randn(2, 5, HIDDEN + 1))
        with pytest.raises(TransportError, match=r"hidden has shape \(2, 5, 33\); expected \(batch, seq, 32\)"):
            bob.forward(0, wrong_width)
        assert "rejected a forward of step 0 from client bob: hidden has shape (2, 5, 33)" in caplog.text
        with pytest.raises(TransportError, match=r"unexpected tensors \['input_ids'\]"):
            bob._call("forward", 1, {**acts.to_dict(), "input_ids": batch["input_ids"]}, expect="hidden")
        with pytest.raises(TransportError, match="no forward of client bob step 7 awaits backward"):
            bob.backward(7, torch.zeros(4, 3, HIDDEN))
        bob.close()

        # garbage on the raw stream: an error answer with the reason, and the session goes on
        with grpc.secure_channel(f"localhost:{server.port}", grpc.ssl_channel_credentials(certs["ca"])) as channel:
            session = channel.stream_stream(SESSION_METHOD)
            requests = [b"\x00garbage", pack_envelope("forward", 3, "alice", b"\x05\x00\x00\x00junk!"),
                        pack_envelope("forward", 4, "bob", wire.encode(acts.to_dict()))]
            answers = [unpack_envelope(a)[0] for a in session(iter(requests), metadata=(
                ("fedlm-client-id", "alice"), ("fedlm-token", TOKENS["alice"])), timeout=20)]
        assert [a["kind"] for a in answers] == ["error", "error", "error"]
        assert "envelope header length" in answers[0]["error"]
        assert "header is not JSON" in answers[1]["error"]
        assert "envelope names client 'bob' in alice's session" in answers[2]["error"]
        assert "rejected a message of step -1 from client alice: envelope header length" in caplog.text
        assert "rejected a forward of step 3 from client alice: header is not JSON" in caplog.text

        _assert_same(_snapshot(server_split.trunk), before)  # nothing above touched the trunk
        alice = _client(server, "alice", certs)
        loss = _transport_step(client, alice, batch, step=5)
        alice.close()
    finally:
        server.stop(grace=None)
    assert torch.isfinite(loss)
    assert any(not torch.equal(t, before[name]) for name, t in _snapshot(server_split.trunk).items())


def test_a_header_with_a_zero_size_and_huge_others_is_refused_not_an_internal_error(model, certs, caplog):
    """[0, 10**20, width] describes no data, so the byte count matches; the shape itself must be refused."""
    _, backend = _server(model)
    server = _tls_server(backend, certs)
    try:
        with grpc.secure_channel(f"localhost:{server.port}", grpc.ssl_channel_credentials(certs["ca"])) as channel:
            session = channel.stream_stream(SESSION_METHOD)
            requests = [pack_envelope("forward", 0, "alice", _raw([["hidden", "float32", [0, 10**20, HIDDEN]]])),
                        pack_envelope("forward", 1, "alice", _raw([["hidden", "float32", [0, 2**40, HIDDEN]]]))]
            answers = [unpack_envelope(a)[0] for a in session(iter(requests), metadata=(
                ("fedlm-client-id", "alice"), ("fedlm-token", TOKENS["alice"])), timeout=20)]
    finally:
        server.stop(grace=None)
    assert [a["kind"] for a in answers] == ["error", "error"]
    assert f"'hidden' has shape [0, {10**20}, {HIDDEN}]; expected" in answers[0]["error"]
    assert f"'hidden' has shape [0, {2**40}, {HIDDEN}]; expected" in answers[1]["error"]
    assert "internal error" not in caplog.text + answers[0]["error"] + answers[1]["error"]


@pytest.mark.parametrize(
    ("tensors", "reason"),
    [
        ({"attention_mask": torch.ones(2, 5, dtype=torch.int64)}, "a forward needs 'hidden'"),
        ({"hidden": torch.randn(2, 5)}, r"hidden has shape \(2, 5\)"),
        ({"hidden": torch.randn(2, 5, HIDDEN).half()}, "hidden is torch.float16; this trunk computes in torch.float32"),
        ({"hidden": torch.full((2, 5, HIDDEN), float("nan"))}, "NaN or infinite"),
        ({"hidden": torch.randn(2, 5, HIDDEN), "attention_mask": torch.full((2, 5), 2)}, "values other than 0 and 1"),
        ({"hidden": torch.randn(2, 5, HIDDEN), "attention_mask": torch.ones(2, 4, dtype=torch.int64)},
         r"expected int64 or bool \(2, 5\)"),
        ({"hidden": torch.randn(2, 5, HIDDEN), "position_ids": torch.zeros(3, 5, dtype=torch.int64)},
         r"expected int64 \(1 or 2, 5\)"),
        ({"hidden": torch.randn(2, 5, HIDDEN), "labels": torch.zeros(2, 5, dtype=torch.int64)},
         r"unexpected tensors \['labels'\]"),
    ],
)
def test_backend_refuses_bad_activations(model, tensors, reason):
    server_split, backend = _server(model)
    before = _snapshot(server_split.trunk)
    with pytest.raises(RejectedMessage, match=reason):
        backend.forward("alice", 0, tensors)
    _assert_same(_snapshot(server_split.trunk), before)


def test_backend_refuses_bad_gradients_and_keeps_the_step(model):
    server_split, backend = _server(model)
    backend.forward("alice", 0, {"hidden": torch.randn(2, 5, HIDDEN)})
    backend.forward("bob", 0, {"hidden": torch.randn(1, 3, HIDDEN)})
    before = _snapshot(server_split.trunk)
    with pytest.raises(RejectedMessage, match=r"grad has shape \(1, 5, 32\), the trunk output of step 0 has"):
        backend.backward("alice", 0, torch.zeros(1, 5, HIDDEN))
    with pytest.raises(RejectedMessage, match="no forward of client alice step 1"):
        backend.backward("alice", 1, torch.zeros(2, 5, HIDDEN))
    _assert_same(_snapshot(server_split.trunk), before)
    grad = backend.backward("alice", 0, torch.ones(2, 5, HIDDEN))["grad"]  # still pending after the refusals
    assert grad.shape == (2, 5, HIDDEN)
    with pytest.raises(RejectedMessage, match="dropped because the trunk stepped since"):
        backend.backward("bob", 0, torch.ones(1, 3, HIDDEN))  # bob's graph saw the weights before alice's step


def test_an_idle_session_is_closed_and_its_pending_forward_dropped(model, batch, certs, caplog):
    caplog.set_level(logging.INFO, logger="fedlm")
    client = SplitModel(copy.deepcopy(model), Cut(1, 1))
    _, backend = _server(model)
    server = _tls_server(backend, certs, stream_timeout_s=0.3)
    try:
        alice = _client(server, "alice", certs)
        top_in = alice.forward(0, client.bottom(batch["input_ids"], batch["attention_mask"]))
        time.sleep(0.8)
        with pytest.raises(TransportError, match="CANCELLED"):
            alice.backward(0, torch.ones_like(top_in.hidden))
        alice.close()
    finally:
        server.stop(grace=None)
    assert "session of client alice idle for 0.3s, closed" in caplog.text
    with pytest.raises(RejectedMessage, match="no forward of client alice step 0"):
        backend.backward("alice", 0, torch.ones_like(top_in.hidden))


def test_a_message_over_the_server_limit_is_refused(model, certs):
    _, backend = _server(model)
    server = _tls_server(backend, certs, max_message_bytes=4096)
    try:
        alice = _client(server, "alice", certs)
        with pytest.raises(TransportError, match="RESOURCE_EXHAUSTED"):
            alice.forward(0, Activations(torch.randn(2, 20, HIDDEN)))  # 5 KiB of hidden states
        alice.close()
    finally:
        server.stop(grace=None)


# -------------------------------------------------------------------------------------------------------- TLS


def test_mutual_tls_needs_a_client_certificate_and_tls_needs_a_tls_client(model, batch, certs):
    client = SplitModel(copy.deepcopy(model), Cut(1, 1))
    _, backend = _server(model)
    server = _tls_server(backend, certs, client_ca_pem=certs["ca"])
    try:
        with_cert = _client(server, "alice", certs, client_cert=(certs["client_cert"], certs["client_key"]))
        assert torch.isfinite(_transport_step(client, with_cert, batch))
        with_cert.close()
        acts = client.bottom(batch["input_ids"], batch["attention_mask"])
        without_cert = _client(server, "alice", certs)
        with pytest.raises(TransportError, match="UNAVAILABLE"):
            without_cert.forward(1, acts)
        without_cert.close()
        plaintext = GrpcTransport(f"localhost:{server.port}", "alice", TOKENS["alice"], timeout_s=20)
        with pytest.raises(TransportError, match="UNAVAILABLE"):
            plaintext.forward(2, acts)
        plaintext.close()
    finally:
        server.stop(grace=None)


# -------------------------------------------------------------------------------------------------------- CLI


def test_trunk_serve_parses_its_options(tmp_path):
    args = _parser().parse_args([
        "trunk", "serve", "--config", "c.yaml", "--address", "0.0.0.0:50051", "--tokens-file", "t.yaml",
        "--tls-cert", "s.pem", "--tls-key", "s.key", "--client-ca", "ca.pem", "--max-message-mb", "16",
        "--stream-timeout-s", "30",
    ])
    assert (args.command, args.trunk_command, args.address, args.max_message_mb) == (
        "trunk", "serve", "0.0.0.0:50051", 16.0)
    with pytest.raises(SystemExit):  # the cut comes from the config's split section
        _parser().parse_args(["trunk", "serve", "--config", "c.yaml", "--tokens-file", "t.yaml", "--top-blocks", "1"])


def test_trunk_serve_caps_sessions_in_all_and_per_client_as_told(tmp_path, tiny_csv, monkeypatch, capsys):
    config, tokens = _serve_config(tmp_path, tiny_csv, {"bottom_blocks": 1, "top_blocks": 1})
    served = {}

    def serve(backend, address, **kwargs):
        served.update(kwargs)
        return types.SimpleNamespace(port=50051, server=types.SimpleNamespace(wait_for_termination=lambda: None),
                                     stop=lambda grace: None)

    monkeypatch.setattr("fedlm.split.grpc_server.serve_trunk", serve)
    assert main(["trunk", "serve", "--config", config, "--tokens-file", tokens, "--insecure"]) == 0
    assert (served["max_sessions"], served["max_sessions_per_client"]) == (16, 2)  # the defaults
    assert main(["trunk", "serve", "--config", config, "--tokens-file", tokens, "--insecure", "--max-sessions", "40",
                 "--max-sessions-per-client", "3"]) == 0
    assert (served["max_sessions"], served["max_sessions_per_client"]) == (40, 3)
    assert "at most 40 sessions, 3 per client" in capsys.readouterr().out


@pytest.mark.parametrize("flags", [["--max-sessions", "0"], ["--max-sessions-per-client", "0"],
                                   ["--max-sessions", "4", "--max-sessions-per-client", "5"]])
def test_trunk_serve_refuses_a_bad_session_cap_with_one_line(tmp_path, tiny_csv, capsys, flags):
    config, tokens = _serve_config(tmp_path, tiny_csv, {"bottom_blocks": 1, "top_blocks": 1})
    assert main(["trunk", "serve", "--config", config, "--tokens-file", tokens, "--insecure", *flags]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "--max-sessions-per-client" in err and flags[-1] in err


def test_trunk_serve_without_a_tokens_file_exits_2_with_one_line(tmp_path, capsys):
    code = main(["trunk", "serve", "--config", str(tmp_path / "c.yaml"), "--tokens-file", str(tmp_path / "no.yaml")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().count("\n") == 0 and "tokens file not found" in err


def test_the_trunk_factory_takes_cut_clipping_and_precision_from_the_config(model, batch):
    spec = SplitConfig(bottom_blocks=1, top_blocks=1, activation_dtype="bfloat16")
    max_norm = 1e-3
    split = SplitModel(copy.deepcopy(model), Cut(spec.bottom_blocks, spec.top_blocks))
    backend = TrunkChoice.of(spec).backend(split, LocalSettings(optimizer="sgd", lr=LR, max_grad_norm=max_norm))
    assert len(backend.trunk.blocks) == 1
    client = SplitModel(copy.deepcopy(model), Cut(1, 1))
    with pytest.raises(TransportError, match=r"this trunk takes activations and gradients in torch\.bfloat16"):
        InProcessTransport(backend, "alice").forward(0, client.bottom(batch["input_ids"], batch["attention_mask"]))
    before = _snapshot(split.trunk)
    transport = InProcessTransport(backend, "alice", wire_dtype=torch.bfloat16)
    assert torch.isfinite(_transport_step(client, transport, batch))
    moved = math.sqrt(sum(float((t - before[name]).pow(2).sum()) for name, t in _snapshot(split.trunk).items()))
    assert 0 < moved <= LR * max_norm * 1.01  # one SGD step on a gradient clipped to max_norm


def _serve_config(tmp_path, tiny_csv, split: dict | None) -> tuple[str, str]:
    raw = tiny_config(tmp_path, tiny_csv)
    raw["model"]["overrides"] = {"hidden_dropout_prob": 0.1, "num_hidden_layers": 3}
    raw["train"]["max_grad_norm"] = 0.25
    if split is not None:
        raw["split"] = split
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    (tmp_path / "t.yaml").write_text("alice: alice-secret\n")
    return str(tmp_path / "c.yaml"), str(tmp_path / "t.yaml")


def test_trunk_serve_builds_its_trunk_from_the_split_section(tmp_path, tiny_csv, monkeypatch, capsys):
    config, tokens = _serve_config(tmp_path, tiny_csv, {"bottom_blocks": 1, "top_blocks": 1,
                                                        "activation_dtype": "bfloat16"})
    served = {}

    def serve(backend, address, **kwargs):
        served.update(backend=backend, address=address)
        return types.SimpleNamespace(port=50051, server=types.SimpleNamespace(wait_for_termination=lambda: None),
                                     stop=lambda grace: served.update(stopped=True))

    monkeypatch.setattr("fedlm.split.grpc_server.serve_trunk", serve)
    assert main(["trunk", "serve", "--config", config, "--tokens-file", tokens, "--insecure"]) == 0
    backend = served["backend"]
    assert len(backend.trunk.blocks) == 1 and backend.max_grad_norm == 0.25
    assert backend.wire_dtype == torch.bfloat16 and served["stopped"]
    assert "gradient norm clipped at 0.25" in capsys.readouterr().out


@pytest.mark.parametrize(("split", "reason"), [
    (None, "has no split section"),
    ({"trunk_mode": "client_batch"}, "trunk_mode client_batch needs the round engine"),
])
def test_trunk_serve_needs_a_split_section_it_can_serve_alone(tmp_path, tiny_csv, capsys, split, reason):
    config, tokens = _serve_config(tmp_path, tiny_csv, split)
    assert main(["trunk", "serve", "--config", config, "--tokens-file", tokens, "--insecure"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and reason in err
