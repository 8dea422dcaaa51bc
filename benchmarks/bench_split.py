"""What split learning costs a client: step time in process and over gRPC, bytes per step, thin-client memory.

(a) In-process split overhead. One masked-LM training step of a small BERT (hidden 256, 4 blocks, 4 heads,
    intermediate 1024, vocab 8,000, seq 128, batch 16, random weights) split at FedBERT's cut (0, 0) and
    FL-GLM's cut (1, 1), driven through :class:`~fedlm.split.transport.InProcessTransport` (bottom forward,
    transport forward = trunk forward, top forward + loss, backward, transport backward = trunk backward +
    trunk AdamW step, bottom backward, client AdamW step), over the monolithic step on the same model and
    batches (forward, loss, backward, one AdamW step over every parameter). The loss is fedlm's masked-LM
    loss: the MLM head applied to the ~15% selected rows only, on both sides. A third column, "direct hop",
    splits the graph the same way with no transport (``Activations.detached()`` for each hop), which
    separates the cost of cutting the autograd graph from the cost of the wire (encode, decode, checks).
    The table under it times the wire pieces of one step in isolation. Target: in-process / monolithic
    <= 1.10.
(b) gRPC over loopback with TLS (:func:`~fedlm.split.certs.throwaway_certificates`), same model and cuts:
    time per step over in process, and wire payload bytes per step in each direction from the transport's
    counters (gRPC envelope, HTTP/2 and TLS framing not counted; see :mod:`fedlm.split.envelope`).
(c) Thin-client memory. BERT-base shape (hidden 768, 12 blocks, 12 heads, intermediate 3072, vocab 30,522,
    MLM head, random weights, seq 128, batch 8): peak RSS growth of one training step of a split client
    that materialises only the bottom and top parameters (the model is built on the ``meta`` device; the
    trunk output is a random tensor requiring grad, the gradient sent back to the bottom a random tensor;
    client AdamW over the client parameters) versus a FedAvg client training the whole model (forward,
    backward, AdamW step). Each runs in its own fresh subprocess; growth is the process's peak RSS after
    the step (``VmHWM``, reset first where the kernel allows) minus its RSS after imports, before anything
    is built. Measured with the default AdamW (fedlm's clients use it) and with ``AdamW(fused=True)``, whose
    step allocates no parameter-sized temporaries. Target: split / FedAvg <= 0.35.

Timed steps take turns (monolithic, direct hop, in-process, gRPC, with the order rotated each repeat) after
a warm-up, so that load from other processes hits them alike; tables show medians.

    OMP_NUM_THREADS=1 python benchmarks/bench_split.py [--repeats 11] [--warmup 2] [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # not the INFO line on each server stop

from _child import run_json_child, status_kb
from transformers import BertConfig, BertForMaskedLM

from fedlm.models.cut import Activations, Cut, SplitModel
from fedlm.split import wire
from fedlm.split.certs import throwaway_certificates
from fedlm.split.grpc_client import GrpcTransport
from fedlm.split.grpc_server import serve_trunk
from fedlm.split.transport import InProcessTransport, Transport
from fedlm.split.trunk import TrunkBackend

SMALL = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 1024,
         "vocab_size": 8_000}
BASE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
        "vocab_size": 30_522}
CUTS = {"FedBERT (0, 0)": Cut(0, 0), "FL-GLM (1, 1)": Cut(1, 1)}
IGNORE, SELECT_PROB, LR = -100, 0.15, 1e-4
CLIENT, TOKEN = "client", "client-token"


def bert(shape: dict, seed: int = 0) -> BertForMaskedLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return BertForMaskedLM(BertConfig(**shape, max_position_embeddings=512)).train()


def make_batches(count: int, batch: int, seq: int, vocab: int, seed: int = 0) -> list[dict[str, Tensor]]:
    """Random ids, right padding (each row keeps 75-100% of ``seq``), ~15% of real tokens selected as targets."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(5, vocab, (batch, seq), generator=generator)
        lengths = torch.randint(seq * 3 // 4, seq + 1, (batch,), generator=generator)
        mask = (torch.arange(seq) < lengths[:, None]).long()
        selected = (torch.rand(batch, seq, generator=generator) < SELECT_PROB) & mask.bool()
        selected[:, 0] = True  # at least one target per row
        out.append({"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(~selected, IGNORE)})
    return out


def mlm_loss(head: Callable[[Tensor], Tensor], hidden: Tensor, batch: dict[str, Tensor]) -> Tensor:
    """fedlm's masked-LM loss: the head on the selected rows only."""
    selected = batch["labels"] != IGNORE
    return F.cross_entropy(head(hidden[selected]), batch["labels"][selected])


# ------------------------------------------------------------------------------------------------ steppers


class Monolithic:
    """The whole model in one graph, one AdamW over every parameter (a FedAvg client's local step)."""

    def __init__(self, model: BertForMaskedLM, fused: bool = False) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=fused)

    def step(self, batch: dict[str, Tensor]) -> float:
        hidden = self.model.bert(batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        loss = mlm_loss(self.model.cls, hidden, batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.item()


class DirectSplit:
    """The split step with each hop a plain ``detached()``: the graph is cut, nothing is serialised."""

    def __init__(self, model: BertForMaskedLM, cut: Cut) -> None:
        self.split = SplitModel(model, cut)
        self.client_optimizer = torch.optim.AdamW(self.split.client_parameters(), lr=LR)
        self.trunk_optimizer = torch.optim.AdamW(self.split.trunk_parameters(), lr=LR)

    def step(self, batch: dict[str, Tensor]) -> float:
        split = self.split
        sent = split.bottom(batch["input_ids"], batch["attention_mask"])
        received = sent.detached()
        out = split.trunk(received)
        top_in = out.detached()
        loss = mlm_loss(split.top.logits, split.top(top_in), batch)
        loss.backward()
        out.hidden.backward(top_in.hidden.grad)
        self.trunk_optimizer.step()
        self.trunk_optimizer.zero_grad()
        sent.hidden.backward(received.hidden.grad)
        self.client_optimizer.step()
        self.client_optimizer.zero_grad()
        return loss.item()


class TransportSplit:
    """The split step as a client drives it through a transport (the steps of ``fedlm.split.trunk``)."""

    def __init__(self, split: SplitModel, transport: Transport) -> None:
        self.split = split
        self.transport = transport
        self.optimizer = torch.optim.AdamW(split.client_parameters(), lr=LR)
        self.steps = 0

    def step(self, batch: dict[str, Tensor]) -> float:
        split, step = self.split, self.steps
        self.steps += 1
        sent = split.bottom(batch["input_ids"], batch["attention_mask"])
        top_in = self.transport.forward(step, sent)
        loss = mlm_loss(split.top.logits, split.top(top_in), batch)
        loss.backward()
        sent.hidden.backward(self.transport.backward(step, top_in.hidden.grad))
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.item()


def backend_for(model: BertForMaskedLM, cut: Cut) -> tuple[SplitModel, TrunkBackend]:
    split = SplitModel(model, cut)
    backend = TrunkBackend(split.trunk, model.config.hidden_size, lambda params: torch.optim.AdamW(params, lr=LR))
    return split, backend


# ------------------------------------------------------------------------------------------------ (a) + (b)


def median_ms(times: list[float]) -> float:
    return 1000 * statistics.median(times)


def time_cut(cut: Cut, batches: list[dict], certs: dict[str, bytes], repeats: int, warmup: int) -> dict:
    """Median seconds per step of each way of training, taking turns; bytes per step of the transports."""
    base = bert(SMALL)
    in_split, in_backend = backend_for(copy.deepcopy(base), cut)
    grpc_split, grpc_backend = backend_for(copy.deepcopy(base), cut)
    server = serve_trunk(grpc_backend, "localhost:0", tokens={CLIENT: TOKEN},
                         tls=(certs["server_cert"], certs["server_key"]))
    grpc_transport = GrpcTransport(f"localhost:{server.port}", CLIENT, TOKEN, root_cert_pem=certs["ca"])
    in_transport = InProcessTransport(in_backend, CLIENT)
    runners = {
        "monolithic": Monolithic(copy.deepcopy(base)),
        "direct hop": DirectSplit(copy.deepcopy(base), cut),
        "in-process": TransportSplit(in_split, in_transport),
        "gRPC + TLS": TransportSplit(grpc_split, grpc_transport),
    }
    names = list(runners)
    times: dict[str, list[float]] = {name: [] for name in names}
    try:
        for i in range(warmup):
            for name in names:
                runners[name].step(batches[i % len(batches)])
        counted = {t: (t.bytes_sent, t.bytes_received) for t in (in_transport, grpc_transport)}
        for rep in range(repeats):
            batch = batches[rep % len(batches)]
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                start = time.perf_counter()
                runners[name].step(batch)
                times[name].append(time.perf_counter() - start)
        sent = {t: (t.bytes_sent - s0) / repeats for t, (s0, _) in counted.items()}
        received = {t: (t.bytes_received - r0) / repeats for t, (_, r0) in counted.items()}
    finally:
        grpc_transport.close()
        in_transport.close()
        server.stop(grace=None)
    return {
        "ms": {name: median_ms(values) for name, values in times.items()},
        "up": sent[grpc_transport],
        "down": received[grpc_transport],
        "same_bytes": sent[grpc_transport] == sent[in_transport] and received[grpc_transport] == received[in_transport],
    }


def time_wire(batch: int, seq: int, width: int, repeats: int) -> dict[str, float]:
    """The per-step wire work of the in-process transport, timed alone (median ms): four messages encoded
    and decoded, and the server's checks (finite hidden and grad, 0/1 mask)."""
    hidden = torch.randn(batch, seq, width)
    mask = torch.ones(batch, seq, dtype=torch.long)
    messages = [{"hidden": hidden, "attention_mask": mask}, {"hidden": hidden}, {"grad": hidden}, {"grad": hidden}]
    payloads = [wire.encode(m) for m in messages]

    def encode() -> None:
        for message in messages:
            wire.encode(message)

    def decode() -> None:
        for payload in payloads:
            wire.decode(payload)

    def checks() -> None:
        for tensor in (hidden, hidden):
            bool(torch.isfinite(tensor).all())
        bool(((mask == 0) | (mask == 1)).all())

    def copies() -> None:  # what the trunk's answers cost before encoding: .cpu() of a CPU tensor is free
        for tensor in (hidden, hidden):
            tensor.detach().cpu()

    pieces = {"wire.encode (4 messages)": encode, "wire.decode (4 messages)": decode,
              "server checks (isfinite x2, mask)": checks, "answers' .cpu() (x2)": copies}
    out = {}
    for label, fn in pieces.items():
        fn()
        samples = []
        for _ in range(max(repeats, 5)):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        out[label] = median_ms(samples)
    return out


# ------------------------------------------------------------------------------------------------ (c)


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel or sandbox refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def materialise(modules: Iterable[nn.Module]) -> None:
    """Give the meta parameters and buffers of ``modules`` real (uninitialised) CPU storage, once per tensor,
    so tied weights stay one tensor; everything else stays on ``meta`` and costs nothing."""
    done: dict[int, tuple[Tensor, Tensor]] = {}  # id(meta tensor) -> (meta tensor kept alive, CPU tensor)
    for root in modules:
        for module in root.modules():
            for table, make in ((module._parameters, lambda t: nn.Parameter(torch.empty_like(t, device="cpu"),
                                                                           requires_grad=t.requires_grad)),
                                (module._buffers, lambda t: torch.empty_like(t, device="cpu"))):
                for name, tensor in list(table.items()):
                    if tensor is None or not tensor.is_meta:
                        continue
                    if id(tensor) not in done:
                        done[id(tensor)] = (tensor, make(tensor))
                    table[name] = done[id(tensor)][1]


def memory_child(kind: str, cut: Cut, batch: int, seq: int, fused: bool) -> dict:
    """One training step of one kind of client in this (fresh) process; peak RSS growth in MB."""
    reset = _reset_peak()
    baseline_kb = status_kb("VmRSS")
    data = make_batches(1, batch, seq, BASE["vocab_size"], seed=1)[0]
    if kind == "fedavg":
        model = bert(BASE)
        Monolithic(model, fused).step(data)
        params = sum(p.numel() for p in model.parameters())
    else:
        with torch.device("meta"):
            model = BertForMaskedLM(BertConfig(**BASE, max_position_embeddings=512)).train()
        split = SplitModel(model, cut)
        materialise([split.bottom, split.top])
        with torch.no_grad():
            for part in (split.bottom, split.top):
                for module in part.modules():
                    model._init_weights(module)
        client = split.client_parameters()
        assert not any(p.is_meta for p in client) and all(p.is_meta for p in split.trunk_parameters())
        params = sum(p.numel() for p in client)
        optimizer = torch.optim.AdamW(client, lr=LR, fused=fused)
        sent = split.bottom(data["input_ids"], data["attention_mask"])
        trunk_out = Activations(torch.randn(batch, seq, BASE["hidden_size"], requires_grad=True),
                                data["attention_mask"])  # stands in for the server's answer
        loss = mlm_loss(split.top.logits, split.top(trunk_out), data)
        loss.backward()
        assert trunk_out.hidden.grad is not None  # what the client would send back
        sent.hidden.backward(torch.randn_like(sent.hidden))  # stands in for the trunk's gradient
        optimizer.step()
        optimizer.zero_grad()
    peak_kb = status_kb("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mb": (peak_kb - baseline_kb) / 1024, "params": params, "baseline_mb": baseline_kb / 1024,
            "peak_reset": reset}


def measure_memory(kind: str, cut: Cut, batch: int, seq: int, threads: int, fused: bool) -> dict:
    command = [sys.executable, __file__, "--memory-child", kind, "--cut", f"{cut.bottom_blocks},{cut.top_blocks}",
               "--batch", str(batch), "--seq", str(seq), "--threads", str(threads), *(["--fused"] if fused else [])]
    return run_json_child(command, f"memory child {kind}", env={**os.environ, "OMP_NUM_THREADS": str(threads)})


# ------------------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="smoke run: seq 32, batch 4, 2 repeats, batch 2 in (c)")
    parser.add_argument("--memory-child", choices=("fedavg", "split"), help=argparse.SUPPRESS)
    parser.add_argument("--cut", default="0,0", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, default=128, help=argparse.SUPPRESS)
    parser.add_argument("--fused", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_child:
        bottom, top = (int(k) for k in args.cut.split(","))
        print(json.dumps(memory_child(args.memory_child, Cut(bottom, top), args.batch, args.seq, args.fused)))
        return

    seq, batch, mem_batch = (32, 4, 2) if args.quick else (128, 16, 8)
    repeats, warmup = (2, 1) if args.quick else (args.repeats, args.warmup)
    certs = throwaway_certificates("localhost")
    batches = make_batches(3, batch, seq, SMALL["vocab_size"])
    results = {label: time_cut(cut, batches, certs, repeats, warmup) for label, cut in CUTS.items()}
    wire_ms = time_wire(batch, seq, SMALL["hidden_size"], repeats)

    print(f"\nSmall BERT (hidden 256, 4 blocks, vocab 8,000), masked-LM step, batch {batch} x seq {seq}, "
          f"{args.threads} thread(s), median of {repeats} after {warmup} warm-up\n")
    print("(a) in-process split overhead (target in-process / monolithic <= 1.10)\n")
    print("| cut | monolithic ms | direct hop ms | in-process ms | direct / mono | in-process / mono |")
    print("|---|---|---|---|---|---|")
    for label, r in results.items():
        ms = r["ms"]
        print(f"| {label} | {ms['monolithic']:.0f} | {ms['direct hop']:.0f} | {ms['in-process']:.0f} | "
              f"{ms['direct hop'] / ms['monolithic']:.3f} | {ms['in-process'] / ms['monolithic']:.3f} |")
    mono = statistics.mean(r["ms"]["monolithic"] for r in results.values())
    print("\nwire work of one in-process step, timed alone\n")
    print("| piece | ms per step | % of a monolithic step |\n|---|---|---|")
    for label, ms in [*wire_ms.items(), ("total", sum(wire_ms.values()))]:
        print(f"| {label} | {ms:.2f} | {100 * ms / mono:.2f}% |")

    print("\n(b) gRPC over loopback with TLS\n")
    print("| cut | in-process ms | gRPC + TLS ms | gRPC / in-process | MB up per step | MB down per step |")
    print("|---|---|---|---|---|---|")
    for label, r in results.items():
        ms = r["ms"]
        print(f"| {label} | {ms['in-process']:.0f} | {ms['gRPC + TLS']:.0f} | "
              f"{ms['gRPC + TLS'] / ms['in-process']:.3f} | {r['up'] / 1e6:.3f} | {r['down'] / 1e6:.3f} |")
    if not all(r["same_bytes"] for r in results.values()):
        print("\nWARNING: gRPC and in-process counted different payload bytes")

    print(f"\n(c) thin-client memory, BERT-base shape, one training step, batch {mem_batch} x seq {seq}, "
          "each in a fresh process (target split / FedAvg <= 0.35)\n")
    clients = {"FedAvg client (whole model)": ("fedavg", Cut())}
    clients.update({f"split client, {label}": ("split", cut) for label, cut in CUTS.items()})
    rows = {(label, fused): measure_memory(kind, cut, mem_batch, seq, args.threads, fused)
            for fused in (False, True) for label, (kind, cut) in clients.items()}
    fedavg = {fused: rows[(next(iter(clients)), fused)]["mb"] for fused in (False, True)}
    print("| client | parameters held (M) | peak RSS growth MB, AdamW | / FedAvg | MB, AdamW(fused=True) | / FedAvg |")
    print("|---|---|---|---|---|---|")
    for label in clients:
        plain, fused = rows[(label, False)], rows[(label, True)]
        print(f"| {label} | {plain['params'] / 1e6:.1f} | {plain['mb']:.0f} | {plain['mb'] / fedavg[False]:.3f} | "
              f"{fused['mb']:.0f} | {fused['mb'] / fedavg[True]:.3f} |")
    if not all(r["peak_reset"] for r in rows.values()):
        print("\n(peak could not be reset after imports: growth is ru_maxrss minus RSS after imports)")


if __name__ == "__main__":
    main()
