"""The typed round: protocol kinds, client settings, reports folded as they arrive, and the records they make."""

from __future__ import annotations

from typing import get_args

import pytest
import torch

from fedlm.config import ProtocolConfig
from fedlm.config.protocol_kinds import PROTOCOL_KINDS
from fedlm.federation.codecs import get_codec
from fedlm.federation.engine import EngineHooks, RoundEngine, RoundPlan, round_settings
from fedlm.federation.executor import ClientFailure, ClientReport, Executor
from fedlm.federation.local_training import LocalSettings
from fedlm.federation.params import RunningMean
from fedlm.federation.privacy import ClippedMean, PrivacySpec, SampleLevelDP
from fedlm.federation.records import Boundary, RoundRecord
from fedlm.federation.strategies import ClientUpdate, FedAvg, FedProx


def test_every_protocol_kind_has_its_traits_and_each_rule_reads_them():
    assert set(get_args(ProtocolConfig.model_fields["kind"].annotation)) == set(PROTOCOL_KINDS)
    table = {name: (k.pools_data, k.shares_nothing, k.averages_updates, k.counts_bytes, k.has_wire,
                    k.evaluates_clients) for name, k in PROTOCOL_KINDS.items()}
    assert table == {"centralized": (True, False, False, False, False, False),
                     "isolated": (False, True, False, False, True, True),
                     **{name: (False, False, True, True, True, True) for name in ("fedavg", "fedprox", "fedopt")}}


def test_a_rounds_client_settings_are_the_strategys_at_the_rounds_learning_rate():
    base = LocalSettings(lr=0.4, mu=0.0)
    plan = RoundPlan(rounds=4, clients_per_round=1, lr_schedule="linear")
    assert round_settings(base, FedProx(0.3), plan, 3) == LocalSettings(lr=0.2, mu=0.3)  # 0.4 * (4 - 3 + 1) / 4
    private = SampleLevelDP(FedAvg(), PrivacySpec("sample", noise_multiplier=1.3, max_grad_norm=0.7),
                            client_examples={0: 10}, batch_size=2)
    assert round_settings(base, private, plan, 1) == LocalSettings(lr=0.4, dp_noise_multiplier=1.3,
                                                                   dp_max_grad_norm=0.7)


class Lazy(Executor):
    """Hands over each client's report only when asked for the next one; client 1 fails."""

    def __init__(self, events: list) -> None:
        self.events = events
        self.settings: list[LocalSettings] = []

    def run(self, jobs):
        for job in jobs:
            self.events.append(("trained", job.client_id))
            self.settings.append(job.settings)
            if job.client_id == 1:
                yield ClientFailure(1, "exception: gone")
                continue
            params = {"w": torch.full((2,), float(job.client_id))}
            yield ClientReport(ClientUpdate(job.client_id, job.client_id + 1, params, {"train_loss": 2.0}), 8, 1)


class Watched(FedAvg):
    """FedAvg whose aggregation notes each update it is given."""

    def __init__(self, events: list) -> None:
        self.events = events

    def aggregation(self, current):
        inner, events = super().aggregation(current), self.events

        class Noted:
            def add(self, update):
                events.append(("folded", update.client_id))
                inner.add(update)

            def result(self):
                return inner.result()

        return Noted()


def test_reports_are_folded_into_the_aggregate_as_they_arrive_and_recorded_without_their_tensors():
    events: list = []
    records: list[RoundRecord] = []
    executor = Lazy(events)
    engine = RoundEngine(Watched(events), executor, get_codec("fp32"), [0, 1, 2], LocalSettings(lr=0.1),
                         RoundPlan(rounds=1, clients_per_round=3), EngineHooks(record=records.append))
    out = engine.run_round(1, {"w": torch.zeros(2)})
    assert events == [("trained", 0), ("folded", 0), ("trained", 1), ("trained", 2), ("folded", 2)]
    assert torch.equal(out["w"], torch.full((2,), (0 * 1 + 2 * 3) / 4))  # weighted by examples: 1 and 3
    assert executor.settings == [round_settings(LocalSettings(lr=0.1), FedAvg(), engine.plan, 1)] * 3
    (record,) = records
    assert (record.clients, record.train_examples, record.bytes_up, record.bytes_up_meta) == ([0, 2], 4, 16, 2)
    assert record.failed == [ClientFailure(1, "exception: gone")] and record.train_loss == pytest.approx(2.0)


def test_a_round_record_writes_the_metrics_line_earlier_runs_wrote():
    line = {"round": 3, "train_loss": 0.5, "clients": [0, 2], "failed": [{"client": 1, "reason": "timeout: x"}],
            "train_examples": 40, "bytes_down": 10, "bytes_up": 12, "bytes_down_meta": 1, "bytes_up_meta": 2,
            "bytes_up_boundary": 5, "bytes_down_boundary": 6, "bytes_by_client": {"0": {"up": 1, "down": 2}},
            "train_s": 1.5, "dp_kind": "client", "dp_epsilon": 2.0, "test_accuracy": 0.7, "wall_s": 2.0}
    record = RoundRecord(round=3, train_loss=0.5, clients=[0, 2], failed=[ClientFailure(1, "timeout: x")],
                         train_examples=40, bytes_down=10, bytes_up=12, bytes_down_meta=1, bytes_up_meta=2,
                         boundary=Boundary(5, 6, {"0": {"up": 1, "down": 2}}), train_s=1.5,
                         ledger={"dp_kind": "client", "dp_epsilon": 2.0}, scores={"test_accuracy": 0.7}, wall_s=2.0)
    assert list(record.to_dict().items()) == list(line.items())  # same keys, same order
    start = {"round": 0, "train_loss": None, "clients": [], "failed": [], "train_examples": 0, "bytes_down": 0,
             "bytes_up": 0, "bytes_down_meta": 0, "bytes_up_meta": 0, "test_accuracy": 0.5, "wall_s": 0.1}
    assert list(RoundRecord(round=0, scores={"test_accuracy": 0.5}, wall_s=0.1).to_dict().items()) == list(
        start.items())


def test_running_means_fold_partial_uploads_like_the_hand_computed_averages():
    running = RunningMean()
    running.add({"a": torch.tensor([1.0]), "b": torch.tensor([4.0])}, 1.0)
    running.add({"a": torch.tensor([3.0])}, 3.0)  # froze b this round
    running.add({"a": torch.tensor([9.0]), "b": torch.tensor([9.0])}, 0.0)  # no examples: adds nothing
    assert running.mean() == {"a": torch.tensor([2.5]), "b": torch.tensor([4.0])}  # (1 + 9) / 4; b from one client
    # tensors longer than one conversion chunk (one transposed) sum to the very bits a float64 sum gives
    values = [torch.randn(3, RunningMean.CHUNK + 5, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    chunked = RunningMean()
    for i, value in enumerate(values):
        chunked.add({"w": value, "t": value.t()}, float(i + 7))
    exact = sum(v.double() * (i + 7) for i, v in enumerate(values)) / sum(i + 7 for i in range(3))
    assert torch.equal(chunked.mean()["w"], exact.float()) and torch.equal(chunked.mean()["t"], exact.float().t())
    current = {"a": torch.tensor([0.0, 0.0]), "b": torch.tensor([1.0])}
    clipped = ClippedMean(current, clip=1.0)
    clipped.add({"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([1.0])})  # |delta| = 5: scaled to 1
    clipped.add({"a": torch.tensor([0.0, 0.5])})  # within the bound; b unsent counts as unchanged (1.0)
    mean = clipped.noised_mean(0.0, torch.Generator())
    torch.testing.assert_close(mean["a"], torch.tensor([(0.6 + 0.0) / 2, (0.8 + 0.5) / 2]))
    torch.testing.assert_close(mean["b"], torch.tensor([1.0]))
