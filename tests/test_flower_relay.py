"""The parameter relay beside Flower's messages: blobs keep every codec dtype, the service checks tokens and
digests over real TLS, and an executor on the relay reads the same updates its messages would have carried."""

from __future__ import annotations

import pytest
import torch
from flwr.app import Context, Message, RecordDict

from fedlm.config import validate
from fedlm.errors import UserError
from fedlm.federation.codecs import get_codec
from fedlm.federation.executor import ClientFailure, ClientReport
from fedlm.federation.strategies import ClientUpdate
from fedlm.flower.executor import FlowerExecutor
from fedlm.flower.messages import codec_from_content, is_relayed, job_content, job_from_content, report_content
from fedlm.flower.placement import relay_wanted
from fedlm.flower.relay import RelayClient, RelayError, RelayStore, digest_of, from_blob, serve_relay, to_blob
from fedlm.flower.secagg import SecAggSettings
from fedlm.split.certs import throwaway_certificates
from tests.conftest import tiny_config
from tests.test_flower import ScriptedGrid, _job, over_the_wire, task_identity  # noqa: F401 - fixture

TOKENS = {"0": "token-zero", "1": "token-one"}


@pytest.fixture(scope="module")
def relay():
    """A relay on a loopback TLS port; yields (store, a client factory)."""
    certs = throwaway_certificates("localhost")
    store = RelayStore(TOKENS, max_upload_bytes=10_000)
    server = serve_relay(store, "localhost:0", (certs["server_cert"], certs["server_key"]))

    def client(client_id: str = "0", token: str | None = None) -> RelayClient:
        return RelayClient(f"localhost:{server.port}", client_id, token or TOKENS[client_id], certs["ca"],
                           timeout_s=10.0)

    yield store, client
    server.stop(grace=0.5)


def test_a_blob_keeps_names_order_dtypes_and_values():
    tensors = {"w": torch.randn(3, 4).to(torch.bfloat16), "q": torch.randint(-128, 127, (5,), dtype=torch.int8),
               "h": torch.randn(2).half(), "f": torch.randn(2, 2)}
    meta = {"q": torch.tensor([0.25, 0.5])}
    back, back_meta = from_blob(to_blob(tensors, meta))
    assert list(back) == list(tensors) and list(back_meta) == ["q"]
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype and torch.equal(back[name], value), name
    assert torch.equal(back_meta["q"], meta["q"])
    with pytest.raises(ValueError, match="not fedlm's safetensors file"):
        from_blob(b"garbage from a client")


def test_the_relay_serves_offers_takes_uploads_and_refuses_strangers(relay):
    store, client = relay
    blob = to_blob({"w": torch.arange(800_000, dtype=torch.float32)}, {})  # 3.2 MB: four chunks
    digest = store.offer(blob)
    alice = client("0")
    assert alice.fetch(digest) == blob
    with pytest.raises(RelayError, match="UNAUTHENTICATED"):
        client("0", token="token-one").fetch(digest)
    with pytest.raises(RelayError, match="NOT_FOUND"):
        alice.fetch("0" * 64)

    update = to_blob({"w": torch.ones(10)}, {})
    sent = alice.upload(update)
    with pytest.raises(ValueError, match="client 1 named an upload"):
        store.take_upload(1, sent)  # uploads are kept per client: another client cannot claim this one
    assert store.take_upload(0, sent) == update
    with pytest.raises(ValueError, match="never received"):
        store.take_upload(0, sent)  # taken once
    first, second = alice.upload(to_blob({"w": torch.zeros(10)}, {})), alice.upload(update)
    with pytest.raises(ValueError, match="never received"):
        store.take_upload(0, first)  # one pending upload per client: the newer one replaced it
    assert store.take_upload(0, second) == update
    with pytest.raises(ValueError, match="never received"):
        store.take_upload(1, "")  # nothing pending: an empty digest names nothing either
    with pytest.raises(RelayError, match="RESOURCE_EXHAUSTED"):
        alice.upload(bytes(20_000))  # over the store's upload limit

    store.clear()
    with pytest.raises(RelayError, match="NOT_FOUND"):
        alice.fetch(digest)
    alice.close()


def relayed_echo(client, scale: float = 1.0, upload: bool = True):
    """A node that fetches its job from the relay and sends back what it got times ``scale`` over the relay
    (``upload=False``: it names a digest without uploading anything)."""

    def handle(msg: Message) -> Message:
        assert is_relayed(msg.content) and len(msg.content["arrays"]) == 0  # the message carries no parameters
        node = client(str(msg.content["config"]["client-id"]))
        job, _ = job_from_content(msg.content, node.fetch)
        codec = codec_from_content(msg.content)
        params = {n: t * scale for n, t in codec.decode(job.params).items()}
        report = ClientReport(ClientUpdate(job.client_id, 10, params, {"train_loss": 0.5}), 0)
        send = node.upload if upload else (lambda blob: "f" * 64)
        return Message(report_content(report, codec.encode(params), send), reply_to=msg)

    return handle


def test_an_executor_on_the_relay_reads_updates_as_its_messages_would(relay, task_identity):  # noqa: F811
    store, client = relay
    store.max_upload_bytes = 2**20
    grid = ScriptedGrid({100: relayed_echo(client, -3.0), 101: relayed_echo(client, upload=False)})
    codec = get_codec("int8", 4)
    executor = FlowerExecutor(grid, {0: 100, 1: 101}, codec, "name: x", timeout_s=5.0, relay=store)
    jobs = [_job(0, "int8", 4), _job(1, "int8", 4)]
    report, failure = executor.run(jobs)
    assert isinstance(report, ClientReport)
    assert torch.equal(report.update.params["w"], torch.full((2, 3), -3.0))
    encoded = codec.encode(report.update.params)
    assert report.upload_meta_bytes == encoded.meta_bytes  # the scales, counted as the codec counts them
    assert report.upload_bytes == len(to_blob(encoded.tensors, encoded.meta))  # the blob as it travelled
    assert isinstance(failure, ClientFailure) and failure.reason.startswith("malformed reply")
    assert "never received" in failure.reason
    with pytest.raises(RelayError, match="NOT_FOUND"):  # the round's parameters are gone once it is over
        client("0").fetch(digest_of(to_blob(jobs[0].params.tensors, jobs[0].params.meta)))


def test_a_relayed_job_needs_a_way_to_fetch(task_identity):  # noqa: F811
    job = _job(0)
    digest = RelayStore(TOKENS).offer(to_blob(job.params.tensors, job.params.meta))
    content = over_the_wire(Message(job_content(job, "name: x", relayed=digest), dst_node_id=7,
                                    message_type="train")).content
    with pytest.raises(ValueError, match="no way to fetch"):
        job_from_content(content)


@pytest.mark.parametrize(("settings", "split", "secure", "expected"), [
    ({}, False, False, False),  # no TLS files: the messages carry the parameters
    ({"trunk-cert": "s.pem"}, False, False, True),  # auto: on where the service can run
    ({"trunk-cert": "s.pem"}, False, True, False),  # auto: SecAgg+ must see the updates
    ({}, True, False, True),  # a split run always serves the trunk, so the relay too
    ({"relay": "false"}, True, False, False),
    ({"relay": "true"}, False, True, "relay=true sends each update"),
    ({"relay": "maybe"}, False, False, "use auto, true or false"),
])
def test_the_relay_is_on_where_it_can_run_and_off_under_secure_aggregation(settings, split, secure, expected,
                                                                          tmp_path, tiny_csv):
    raw = tiny_config(tmp_path, tiny_csv)
    if split:
        raw["split"] = {"transport": "grpc"}
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=settings)
    secagg = SecAggSettings.from_settings(lambda key, default: default) if secure else None
    if isinstance(expected, str):
        with pytest.raises(UserError, match=expected):
            relay_wanted(context, {}, validate(raw), secagg)
    else:
        assert relay_wanted(context, {}, validate(raw), secagg) is expected
