"""The other processes of a run spread over several (``fedlm run --workers N``, or ``torchrun``).

The leading process (rank 0) runs ``run_single`` with the :class:`~fedlm.run.placement.Sharded` placement: it
reads the config, the run directory and its checkpoint, and writes everything the run writes. Every other
process serves here: it is handed each run's config, prepares the same data and model, is handed the starting
point, and drives the same round loop, training its share of each round's clients and scoring its share of
each evaluation. It never touches the run directory, so it may sit on another machine (with the data).
"""

from __future__ import annotations

from pathlib import Path

from fedlm.config import ExperimentConfig
from fedlm.federation.collective import Collective
from fedlm.federation.engine import EngineHooks, RoundEngine, RoundFailed
from fedlm.federation.local_training import LocalSettings
from fedlm.federation.observer import SILENT
from fedlm.federation.records import FailedRound, RoundRecord
from fedlm.federation.store import ClientStore
from fedlm.run.evaluate import Evaluator
from fedlm.run.placement import RunClients, Sharded
from fedlm.run.policy import run_policy
from fedlm.run.prepare import num_clients_of
from fedlm.run.single import prepare_run, round_plan, start_run


def serve_runs(collective: Collective, data_dir: Path) -> None:
    """Take part in every run the leading process starts, until it says there are no more."""
    while (config := collective.broadcast(None)) is not None:
        serve_run(config, data_dir, collective)


def serve_run(config: ExperimentConfig, data_dir: Path, collective: Collective) -> None:
    """One run's share: the leading process's round loop, step for step, without writing anything. A round that
    fails ends the run here as it does there (the leading process reports it)."""
    n_clients = num_clients_of(config)
    plan = round_plan(config, n_clients)
    prep = prepare_run(config, data_dir)
    policy = run_policy(prep)
    start = start_run(prep, plan, policy, None, collective, ClientStore)
    settings = LocalSettings.from_config(config.train)
    evaluator = Evaluator(prep, start.store, policy.personalized, collective=collective)
    executor = Sharded(collective).executor(RunClients(prep, policy, start.codec, start.store, settings, SILENT))
    hooks = EngineHooks(evaluate=evaluator, record=_unrecorded)  # evaluated here too: each scores a share
    engine = RoundEngine(strategy=start.strategy, executor=executor, codec=start.codec,
                         client_ids=list(range(n_clients)), settings=settings, plan=plan, hooks=hooks,
                         sharing=policy, collective=collective)
    try:
        engine.run(start.global_params, start_round=start.round)
    except RoundFailed:
        pass
    finally:
        executor.close()


def _unrecorded(record: RoundRecord | FailedRound) -> None:
    """The leading process records the round."""
    del record
