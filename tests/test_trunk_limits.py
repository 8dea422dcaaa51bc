"""No valid client can stall the trunk: each message is bounded (sequence length, batch x sequence, bytes),
and messages are served round-robin across clients, so a small client waits for at most one message of a
client that floods the trunk. No client can lock others out of it either: sessions are capped per client,
and only accepted work keeps a session open."""

from __future__ import annotations

import copy
import logging
import threading
import time

import grpc
import pytest
import torch

from fedlm.config import SplitConfig
from fedlm.federation.local_training import LocalSettings
from fedlm.models.build import build_model, build_tokenizer
from fedlm.models.cut import Activations, Cut, SplitModel
from fedlm.split.certs import throwaway_certificates
from fedlm.split.envelope import CLIENT_ID_KEY, SESSION_METHOD, TOKEN_KEY, pack_envelope, unpack_envelope
from fedlm.split.fair import RoundRobin
from fedlm.split.grpc_client import GrpcTransport
from fedlm.split.grpc_server import serve_trunk
from fedlm.split.modes import TrunkChoice
from fedlm.split.transport import InProcessTransport, TransportError
from fedlm.split.trunk import RejectedMessage, TrunkBackend, TrunkLimits

HIDDEN = 32
TOKENS = {"alice": "alice-secret", "bob": "bob-secret"}
TEXTS = ["the farmer trained a shared model", "boats on the river", "the server keeps the trunk"] * 4

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    tokenizer = build_tokenizer(None, "bert", TEXTS, 200)
    overrides = {"hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
                 "max_position_embeddings": 64}
    return build_model("bert", "tiny", "mlm", tokenizer, overrides=overrides, seed=0).train()


@pytest.fixture(scope="module")
def certs() -> dict[str, bytes]:
    return throwaway_certificates("localhost")


def _backend(model, limits: TrunkLimits) -> TrunkBackend:
    split = SplitModel(copy.deepcopy(model), Cut(1, 1))
    return TrunkBackend(split.trunk, HIDDEN, lambda params: torch.optim.SGD(params, lr=0.5), limits=limits)


def _acts(batch: int, seq: int) -> Activations:
    return Activations(torch.randn(batch, seq, HIDDEN), torch.ones(batch, seq, dtype=torch.long))


def _weights(backend: TrunkBackend) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in backend.trunk.state_dict().items()}


def test_limits_come_from_the_model_positions_the_run_max_length_and_batch_size(model):
    split = SplitModel(copy.deepcopy(model), Cut(1, 1))
    settings = LocalSettings(batch_size=8)
    backend = TrunkChoice.of(SplitConfig(bottom_blocks=1, top_blocks=1)).backend(split, settings, max_length=32)
    assert backend.limits == TrunkLimits(max_seq_len=32, max_tokens=8 * 32, max_position=64)
    unbounded_run = TrunkChoice.of(SplitConfig(bottom_blocks=1, top_blocks=1)).backend(split, settings)
    assert unbounded_run.limits.max_seq_len == 64  # the model's positions still bound it


@pytest.mark.parametrize(("batch", "seq", "message"), [
    (1, 33, "sequences of 33 tokens exceed this trunk's limit of 32"),
    (5, 20, "5 x 20 = 100 tokens exceed this trunk's limit of 64 per message"),
])
def test_an_oversized_forward_is_refused_with_one_line_and_nothing_computed(model, batch, seq, message):
    backend = _backend(model, TrunkLimits(max_seq_len=32, max_tokens=64, max_position=64))
    before = _weights(backend)
    calls = []
    backend.trunk.register_forward_pre_hook(lambda module, args: calls.append(1))
    transport = InProcessTransport(backend, "alice")
    with pytest.raises(TransportError, match=message) as refused:
        transport.forward(0, _acts(batch, seq))
    assert "\n" not in str(refused.value) and not calls
    assert all(torch.equal(before[n], t) for n, t in _weights(backend).items())
    transport.forward(0, _acts(2, 32))  # within both limits: served
    assert calls == [1]


def test_positions_beyond_the_model_are_refused(model):
    backend = _backend(model, TrunkLimits(max_seq_len=32, max_tokens=64, max_position=64))
    acts = {"hidden": torch.randn(1, 4, HIDDEN), "position_ids": torch.tensor([[0, 1, 2, 64]])}
    with pytest.raises(RejectedMessage, match="position_ids reach 64; this model has 64 positions"):
        backend.forward("alice", 0, acts)


def test_over_grpc_a_too_large_message_gets_one_clear_error_and_the_session_goes_on(model, certs):
    limits = TrunkLimits(max_seq_len=32, max_tokens=64, max_position=64)
    backend = _backend(model, limits)
    server = serve_trunk(backend, "localhost:0", tokens=TOKENS, tls=(certs["server_cert"], certs["server_key"]))
    try:
        alice = GrpcTransport(f"localhost:{server.port}", "alice", TOKENS["alice"], root_cert_pem=certs["ca"],
                              timeout_s=20)
        with pytest.raises(TransportError, match=r"trunk refused the forward of step 0: 4 x 32 = 128 tokens exceed"):
            alice.forward(0, _acts(4, 32))
        alice.close()
        # a message beyond what the limits admit in bytes is refused by gRPC before it is read
        bob = GrpcTransport(f"localhost:{server.port}", "bob", TOKENS["bob"], root_cert_pem=certs["ca"], timeout_s=20)
        assert limits.max_message_bytes(HIDDEN) < 1000 * 32 * HIDDEN * 4
        with pytest.raises(TransportError, match="RESOURCE_EXHAUSTED"):
            bob.forward(0, _acts(1000, 32))
        bob.close()
        carol = GrpcTransport(f"localhost:{server.port}", "alice", TOKENS["alice"], root_cert_pem=certs["ca"],
                              timeout_s=20)
        assert carol.forward(1, _acts(2, 32)).hidden.shape == (2, 32, HIDDEN)  # the server still serves
        carol.close()
    finally:
        server.stop(grace=1.0)


# ---- fairness ---------------------------------------------------------------------------------------------


def _wait_until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def test_round_robin_serves_each_waiting_client_before_a_second_message_of_another():
    turns, served = RoundRobin(), []

    def request(client: str, tag: str) -> None:
        with turns.turn(client):
            served.append(tag)

    threads = []
    with turns.turn("holder"):
        for i, (client, tag) in enumerate([("a", "a0"), ("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b0")]):
            threads.append(threading.Thread(target=request, args=(client, tag)))
            threads[-1].start()
            _wait_until(lambda n=i + 1: sum(turns.waiting().values()) == n)
    for thread in threads:
        thread.join(10)
    assert served == ["a0", "b0", "a1", "a2", "a3"]  # b waits for one of a's messages, not four


def test_two_clients_over_grpc_the_small_one_waits_for_at_most_one_large_message(model, certs):
    """Alice sends the largest forwards the trunk admits, from four sessions at once; Bob's small forward,
    queued after all of them, is computed right after the first of Alice's."""
    backend = _backend(model, TrunkLimits(max_seq_len=64, max_tokens=16 * 64, max_position=64))
    computed: list[int] = []  # batch sizes in the order the trunk ran them: 16 is alice, 1 is bob
    backend.trunk.register_forward_pre_hook(lambda module, args: computed.append(args[0].hidden.shape[0]))
    server = serve_trunk(backend, "localhost:0", tokens=TOKENS, tls=(certs["server_cert"], certs["server_key"]),
                         max_sessions_per_client=4)
    address = f"localhost:{server.port}"
    sessions = [GrpcTransport(address, "alice", TOKENS["alice"], root_cert_pem=certs["ca"], timeout_s=60)
                for _ in range(4)]
    bob = GrpcTransport(address, "bob", TOKENS["bob"], root_cert_pem=certs["ca"], timeout_s=60)
    try:
        threads = [threading.Thread(target=sessions[i].forward, args=(i, _acts(16, 64))) for i in range(4)]
        threads.append(threading.Thread(target=bob.forward, args=(0, _acts(1, 8))))
        with backend._turns.turn("test"):  # hold the trunk until every message is queued
            for thread in threads[:4]:
                thread.start()
            _wait_until(lambda: backend._turns.waiting().get("alice") == 4)
            threads[4].start()
            _wait_until(lambda: backend._turns.waiting().get("bob") == 1)
        for thread in threads:
            thread.join(60)
        assert computed == [16, 1, 16, 16, 16]
    finally:
        for transport in [*sessions, bob]:
            transport.close()
        server.stop(grace=1.0)


def test_grpc_refuses_a_message_past_the_byte_cap_it_was_given(model, certs):
    backend = _backend(model, TrunkLimits())
    server = serve_trunk(backend, "localhost:0", tokens=TOKENS, tls=(certs["server_cert"], certs["server_key"]),
                         max_message_bytes=4096)
    try:
        alice = GrpcTransport(f"localhost:{server.port}", "alice", TOKENS["alice"], root_cert_pem=certs["ca"],
                              timeout_s=20)
        with pytest.raises(TransportError, match=grpc.StatusCode.RESOURCE_EXHAUSTED.name):
            alice.forward(0, _acts(4, 32))
        alice.close()
    finally:
        server.stop(grace=1.0)


# ---- sessions: no lockout -------------------------------------------------------------------------------------


def test_a_client_at_its_session_cap_cannot_open_another_but_other_clients_can(model, certs, caplog):
    caplog.set_level(logging.INFO, logger="fedlm")
    backend = _backend(model, TrunkLimits())
    server = serve_trunk(backend, "localhost:0", tokens=TOKENS, tls=(certs["server_cert"], certs["server_key"]),
                         max_sessions=16, max_sessions_per_client=2)
    address = f"localhost:{server.port}"

    def session(client_id: str) -> GrpcTransport:
        return GrpcTransport(address, client_id, TOKENS[client_id], root_cert_pem=certs["ca"], timeout_s=20)

    held = [session("alice"), session("alice")]
    try:
        for step, transport in enumerate(held):  # both sessions are open: each had a forward answered
            assert transport.forward(step, _acts(1, 4)).hidden.shape == (1, 4, HIDDEN)
        third = session("alice")
        with pytest.raises(TransportError, match="RESOURCE_EXHAUSTED: client alice already has 2 trunk sessions "
                                                 "open") as refused:
            third.forward(5, _acts(1, 4))
        assert "\n" not in str(refused.value)
        third.close()
        assert "refused a session of client alice" in caplog.text
        bob = session("bob")
        assert bob.forward(0, _acts(1, 4)).hidden.shape == (1, 4, HIDDEN)
        bob.close()
        held.pop().close()  # a closed session gives its slot back: alice can reconnect
        again = session("alice")
        assert again.forward(7, _acts(1, 4)).hidden.shape == (1, 4, HIDDEN)
        held.append(again)
    finally:
        for transport in held:
            transport.close()
        server.stop(grace=1.0)


def test_a_session_sending_only_refused_messages_is_closed_when_idle(model, certs, caplog):
    """Junk every 0.1 s does not keep a session open: it is closed ``stream_timeout_s`` after it opened, as if
    it had sent nothing."""
    caplog.set_level(logging.INFO, logger="fedlm")
    backend = _backend(model, TrunkLimits())
    server = serve_trunk(backend, "localhost:0", tokens=TOKENS, tls=(certs["server_cert"], certs["server_key"]),
                         stream_timeout_s=0.5)
    done = threading.Event()

    def junk():
        for step in range(60):  # 6 s at most, 12 timeouts
            if done.is_set():
                return
            yield pack_envelope("backward", step, "alice", b"junk")
            time.sleep(0.1)

    answers, started = [], time.monotonic()
    try:
        with grpc.secure_channel(f"localhost:{server.port}", grpc.ssl_channel_credentials(certs["ca"])) as channel:
            stream = channel.stream_stream(SESSION_METHOD)(junk(), metadata=((CLIENT_ID_KEY, "alice"),
                                                                             (TOKEN_KEY, TOKENS["alice"])), timeout=30)
            with pytest.raises(grpc.RpcError) as closed:
                for answer in stream:
                    answers.append(unpack_envelope(answer)[0])
            elapsed = time.monotonic() - started
    finally:
        done.set()
        server.stop(grace=None)
    assert closed.value.code() == grpc.StatusCode.CANCELLED
    assert answers and all(a["kind"] == "error" for a in answers)
    assert elapsed < 2.5, f"closed after {elapsed:.1f}s, not about 0.5s"
    assert "session of client alice idle for 0.5s, closed (no accepted message in that time)" in caplog.text
