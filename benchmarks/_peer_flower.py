"""The Flower arm of ``bench_peers.py``: the job in Flower 1.42's simulation engine (Ray backend), in the Flower venv.

    python benchmarks/_peer_flower.py JOB_JSON --cpus 2

A ``ServerApp`` runs Flower's own ``FedAvg`` strategy (``flwr.serverapp.strategy``, all clients every round, no
federated evaluation, the global model scored centrally before round 1 and after the last round, as fedlm's job
does) and a ``ClientApp`` trains one client per message with fedlm's client step (``_peer_common``). Ray gets
``--cpus`` CPUs and each client 1, so at most that many ClientApp actors train at once, each with one torch
thread: Flower's parallelism within the same core budget as fedlm's workers. Each actor loads the job's rows and
the model once and reuses them (per-actor caches, as a tuned Flower app would), so what is timed is Flower's
message passing, scheduling and (de)serialisation around the same training, not a naive app's rebuilding.

Started through ``flwr.simulation.run_simulation`` (deprecated in favour of ``flwr run``, which drives the same
simulation runtime through a SuperLink and a packaged app; the in-process call adds no SuperLink hop, so it is
the cheaper of the two for Flower). The job file comes through the environment (``PEER_JOB``), which Ray passes
on to its actors.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import _peer_common as common
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

JOB_ENV = "PEER_JOB"

client_app = ClientApp()
server_app = ServerApp()
_ACTOR: dict[str, Any] = {}  # per Ray actor process: the job, its training rows, one model to load weights into
CLOCK = common.Clock()


def _actor_state() -> dict[str, Any]:
    """Load once per actor: later messages to the same actor reuse the rows and the model object."""
    if not _ACTOR:
        common.set_threads()
        job = common.Job.load(os.environ[JOB_ENV])
        rows, pad_id = common.load_rows(job, "train")
        _ACTOR.update(job=job, rows=rows, pad_id=pad_id, model=common.build_model(job))
    return _ACTOR


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    """One client's round: load the global weights, train as fedlm's client does, send weights and loss back."""
    state = _actor_state()
    job, model = state["job"], state["model"]
    client_id = int(context.node_config["partition-id"])
    round_idx = int(msg.content["config"]["server-round"])
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict(), strict=False)
    rows = common.client_rows(state["rows"], job, client_id)
    loss_sum, seen = common.train_client(model, rows, job, round_idx, client_id, state["pad_id"])
    metrics = MetricRecord({"train_loss": loss_sum / seen, "num-examples": seen})
    content = RecordDict({"arrays": ArrayRecord(common.trainable_state(model)), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """FedAvg over every client for the job's rounds; prints the result line when done."""
    common.set_threads()
    job = common.Job.load(os.environ[JOB_ENV])
    test_rows, pad_id = common.load_rows(job, "test")
    batches = common.eval_batches(test_rows, job, pad_id)
    model = common.build_model(job)
    scores: dict[int, dict[str, float]] = {}

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """Flower calls it before round 1 and after every round: score at 0 and at the end, time every round."""
        if server_round in (0, job.rounds):
            model.load_state_dict(arrays.to_torch_state_dict(), strict=False)
            scores[server_round] = common.evaluate(model, batches)
        (CLOCK.start_rounds if server_round == 0 else CLOCK.lap)()
        return MetricRecord(scores[server_round]) if server_round in scores else None

    n = job.num_clients
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=n, min_available_nodes=n)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(common.trainable_state(model)),
                            num_rounds=job.rounds, evaluate_fn=evaluate_fn)
    last = result.train_metrics_clientapp.get(job.rounds)
    common.report(CLOCK, start_accuracy=scores[0]["accuracy"], final_accuracy=scores[job.rounds]["accuracy"],
                  final_test_loss=scores[job.rounds]["loss"],
                  train_loss=float(last["train_loss"]) if last is not None else None)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job", help="job.json written by bench_peers.py")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs Ray may use (1 per ClientApp actor)")
    return parser.parse_args(argv)


def run(argv: list[str]) -> None:
    args = parse_args(argv)
    os.environ[JOB_ENV] = os.path.abspath(args.job)
    common.set_threads()
    import _peer_flower as app  # the apps by module name, so Ray's actors import them instead of unpickling copies
    from flwr.simulation import run_simulation

    job = common.Job.load(args.job)
    backend_config = {
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
        "init_args": {"num_cpus": args.cpus, "num_gpus": 0, "include_dashboard": False},
    }
    run_simulation(server_app=app.server_app, client_app=app.client_app, num_supernodes=job.num_clients,
                   backend_name="ray", backend_config=backend_config)


if __name__ == "__main__":
    run(sys.argv[1:])
