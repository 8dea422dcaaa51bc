"""What travels between fedlm's ServerApp and ClientApp: ClientJobs and ClientReports as Flower records.

Both sides build and read messages only through this module, so the schema (summarised in
``deploy/flower/README.md``) is written down once. Tensors keep the dtype their codec encoded them in, so
the bytes on the wire are the codec's payload plus Flower's framing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import asdict, fields

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, ConfigRecordValues, MetricRecord, RecordDict

from fedlm.federation.codecs import Codec, Encoded, get_codec
from fedlm.federation.executor import ClientJob, ClientReport
from fedlm.federation.local_training import LocalSettings
from fedlm.federation.params import NamedTensors, nbytes
from fedlm.flower.relay import DIGEST_KEY, from_blob, to_blob

RAW_STYPE = "torch.raw"  # an Array holding a tensor's raw bytes (bf16, which numpy lacks)
PARTITION_KEY = "partition-id"  # which fedlm client a SuperNode is: its node config key and the query reply's
TRUNK_ADDRESS, TRUNK_CA = "trunk-address", "trunk-ca"  # the ServerApp's gRPC service (trunk, relay); its CA
TURN_WAIT = "turn-wait-s"  # how long a split client may wait for its turn when a round is sent at once


def to_array(tensor: torch.Tensor) -> Array:
    """One tensor as a Flower Array, keeping its dtype (numpy format, or raw bytes for bf16)."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        raw = tensor.reshape(-1).view(torch.int16).numpy().tobytes()
        return Array(dtype="bfloat16", shape=tuple(tensor.shape), stype=RAW_STYPE, data=raw)
    return Array(tensor.numpy())


def from_array(array: Array) -> torch.Tensor:
    """The tensor ``to_array`` wrapped, in its original dtype."""
    if array.stype == RAW_STYPE:
        flat = torch.frombuffer(bytearray(array.data), dtype=getattr(torch, array.dtype))
        return flat.reshape(array.shape)
    return torch.from_numpy(array.numpy())


def to_array_record(tensors: NamedTensors) -> ArrayRecord:
    return ArrayRecord({name: to_array(t) for name, t in tensors.items()})


def from_array_record(record: ArrayRecord) -> NamedTensors:
    return {name: from_array(array) for name, array in record.items()}


def config_sha(text: str) -> str:
    """A key for the experiment YAML a job carries: a node re-prepares only when it changes."""
    return hashlib.sha256(text.encode()).hexdigest()


def encoded_from_records(arrays: ArrayRecord, meta: ArrayRecord, codec: str) -> Encoded:
    """What a codec encoded, rebuilt from its two records, with its bytes counted as the codec counts them."""
    tensors, scales = from_array_record(arrays), from_array_record(meta)
    return Encoded(tensors, codec, nbytes(tensors), nbytes(scales), scales)


def job_content(job: ClientJob, experiment: str, block_size: int | None = None,
                extra: Mapping[str, ConfigRecordValues] | None = None, relayed: str | None = None) -> RecordDict:
    """A ClientJob as message content; None values are left out (absent = None).

    ``block_size`` is the codec's (``job.params`` does not say it), so the node can rebuild the codec;
    ``extra`` adds config entries (where the ServerApp's gRPC service is and the CA it is signed by);
    ``relayed``: the digest of the parameters on the relay (``fedlm.flower.relay``), which then stay out of
    the message.
    """
    values: dict[str, ConfigRecordValues | None] = {
        **(extra or {}), DIGEST_KEY: relayed,
        "round": job.round_idx, "client-id": job.client_id, "seed": job.seed, "codec": job.params.codec,
        "codec-block-size": block_size, "timeout-s": job.timeout_s, "experiment": experiment,
        "frozen": list(job.frozen) or None,
        **{f"settings.{name}": value for name, value in asdict(job.settings).items()},
    }
    config = ConfigRecord({k: v for k, v in values.items() if v is not None})
    if relayed is not None:
        return RecordDict({"arrays": ArrayRecord(), "meta": ArrayRecord(), "config": config})
    return RecordDict({"arrays": to_array_record(job.params.tensors), "meta": to_array_record(job.params.meta),
                       "config": config})


def is_relayed(content: RecordDict) -> bool:
    return DIGEST_KEY in content["config"]


def job_from_content(content: RecordDict, fetch: Callable[[str], bytes] | None = None) -> tuple[ClientJob, str]:
    """The ClientJob (params still encoded) and the experiment YAML a train message carries; ``fetch`` gets
    relayed parameters by their digest."""
    config = content["config"]
    settings = LocalSettings(**{f.name: config.get(f"settings.{f.name}") for f in fields(LocalSettings)})
    if is_relayed(content):
        if fetch is None:
            raise ValueError("the job's parameters are on the relay, and this node has no way to fetch them")
        params = encoded_from_blob(fetch(str(config[DIGEST_KEY])), str(config["codec"]))
    else:
        params = encoded_from_records(content["arrays"], content["meta"], str(config["codec"]))
    job = ClientJob(int(config["client-id"]), int(config["round"]), params, settings, int(config["seed"]),
                    config.get("timeout-s"), tuple(config.get("frozen", [])))
    return job, str(config["experiment"])


def codec_from_content(content: RecordDict) -> Codec:
    """The codec a train message was encoded with: the node decodes and encodes with the server's codec."""
    config = content["config"]
    return get_codec(str(config["codec"]), config.get("codec-block-size"))


def encoded_from_blob(blob: bytes, codec: str) -> Encoded:
    """What a codec encoded, rebuilt from a relay blob, with its bytes counted as the codec counts them."""
    tensors, scales = from_blob(blob)
    return Encoded(tensors, codec, nbytes(tensors), nbytes(scales), scales)


def report_content(report: ClientReport, upload: Encoded, send: Callable[[bytes], str] | None = None) -> RecordDict:
    """The reply to a train message; ``upload`` is the update as encoded (``report.update`` holds it decoded).
    ``send`` puts it on the relay and returns its digest, which the reply then carries instead of the arrays."""
    update = report.update
    metrics = MetricRecord({"num-examples": update.num_examples, **update.metrics})
    config = ConfigRecord({"client-id": update.client_id})
    if send is not None:
        config[DIGEST_KEY] = send(to_blob(upload.tensors, upload.meta))
        return RecordDict({"arrays": ArrayRecord(), "meta": ArrayRecord(), "metrics": metrics, "config": config})
    return RecordDict({"arrays": to_array_record(upload.tensors), "meta": to_array_record(upload.meta),
                       "metrics": metrics, "config": config})
