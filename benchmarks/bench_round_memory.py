"""Peak memory of one FedAvg round against the clients per round: the engine folds each report into a running sum,
so 100 clients per round should cost what 10 do.

MiniLM (22.7M parameters, all trained and sent), SST-2 sentences, one batch of 8 per client, one round, no
evaluation: each setting runs in a fresh process, which reports its peak RSS (VmHWM) after the round and before
it (model and data loaded). Beside FedAvg as fedlm runs it, the same round with an aggregation that holds every
update until the round's end (what fedlm did before updates were folded as they arrive) shows what streaming
saves. Target: peak at 100 clients / peak at 10 <= 1.2 for FedAvg.

    python benchmarks/bench_round_memory.py [--clients 10 100]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _child import run_json_child, status_kb

BATCH = 8


def child(clients: int, hold: bool) -> None:
    import torch

    from fedlm.config import validate
    from fedlm.data.sources import resolve_data_dir
    from fedlm.federation.codecs import get_codec
    from fedlm.federation.engine import RoundEngine, RoundPlan
    from fedlm.federation.local_training import LocalSettings
    from fedlm.federation.params import snapshot, trainable_names
    from fedlm.federation.simulation import InProcessExecutor
    from fedlm.federation.store import ClientStore
    from fedlm.federation.strategies import FedAvg
    from fedlm.run.prepare import prepare

    class Held(FedAvg):
        """FedAvg that keeps every update of the round until its end, then averages them."""

        def aggregation(self, current):
            updates, averaging = [], super().aggregation(current)

            class Holding:
                def add(self, update):
                    updates.append(update)

                def result(self):
                    for update in updates:
                        averaging.add(update)
                    return averaging.result()

            return Holding()

    torch.set_num_threads(2)
    config = validate({
        "name": "bench", "seed": 0,
        "data": {"source": "glue/sst2", "max_train_examples": clients * BATCH, "max_test_examples": 32},
        "partition": {"kind": "iid", "num_clients": 1},
        "model": {"family": "bert", "checkpoint": "minilm", "preset": None, "max_length": 64},
        "train": {"batch_size": BATCH, "lr": 1e-4, "local_steps": 1},
    })
    prep = prepare(config, resolve_data_dir(None))
    pooled = prep.client_train[0]
    client_rows = {cid: pooled[cid * BATCH:(cid + 1) * BATCH] for cid in range(clients)}
    codec = get_codec("fp32")
    executor = InProcessExecutor(prep.model, prep.task, client_rows, codec, ClientStore({}), [])
    engine = RoundEngine(Held() if hold else FedAvg(), executor, codec, list(client_rows),
                         LocalSettings.from_config(config.train), RoundPlan(rounds=1, clients_per_round=clients))
    start = snapshot(prep.model, trainable_names(prep.model))
    before = status_kb("VmHWM")
    engine.run_round(1, start)
    print(json.dumps({"clients": clients, "hold": hold, "before_mb": before / 1024,
                      "peak_mb": status_kb("VmHWM") / 1024}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs=2, default=[10, 100], metavar=("FEW", "MANY"))
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.hold)
        return
    few, many = args.clients
    peaks: dict[tuple[str, int], dict] = {}
    for label, hold in (("FedAvg, folded as reports arrive", False), ("the same, every update held", True)):
        for clients in (few, many):
            command = [sys.executable, __file__, "--child", str(clients)] + (["--hold"] if hold else [])
            peaks[label, clients] = run_json_child(command, f"{label} at {clients} clients")
            got = peaks[label, clients]
            print(f"{label:34s} {clients:4d} clients/round: peak RSS {got['peak_mb']:7.0f} MB "
                  f"(model and data loaded: {got['before_mb']:.0f} MB)", flush=True)
    for label, _ in (("FedAvg, folded as reports arrive", False), ("the same, every update held", True)):
        ratio = peaks[label, many]["peak_mb"] / peaks[label, few]["peak_mb"]
        print(f"{label}: peak at {many} / peak at {few} clients per round = {ratio:.2f}")


if __name__ == "__main__":
    main()
