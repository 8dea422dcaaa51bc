"""Robust aggregation rules against hand-computed cases: median, trimmed mean, Krum / Multi-Krum, norm bounding;
as FedOpt's inner rule; wired from the config; and refused where they cannot work."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fedlm.config import validate
from fedlm.errors import UserError
from fedlm.federation.executor import ClientReport
from fedlm.federation.params import RunningMean, squared_distance
from fedlm.federation.screening import UpdateScreen
from fedlm.federation.simulation import InProcessExecutor
from fedlm.federation.strategies import ClientUpdate, FedAvg, FedOpt, build_strategy
from fedlm.federation.strategies.krum import Krum
from fedlm.federation.strategies.median import CoordinateMedian
from fedlm.federation.strategies.norm_bound import MedianNormBounded, NormBounded, update_norm
from fedlm.federation.strategies.trimmed_mean import TrimmedMean
from fedlm.run.placement import Simulation
from fedlm.run.recorder import read_metrics
from fedlm.run.single import run_single
from tests.conftest import tiny_config

CURRENT = {"a": torch.tensor([0.0, 0.0]), "b": torch.tensor([1.0])}


def _updates(values: list[dict[str, list[float]]], examples: list[int] | None = None) -> list[ClientUpdate]:
    examples = examples or [1] * len(values)
    return [ClientUpdate(i, n, {k: torch.tensor(v) for k, v in params.items()})
            for i, (params, n) in enumerate(zip(values, examples, strict=True))]


def _aggregate(rule, updates: list[ClientUpdate]) -> dict[str, torch.Tensor]:
    aggregation = rule(CURRENT)
    for update in reversed(updates):  # arrival order must not matter
        aggregation.add(update)
    return aggregation.result()


def test_coordinate_median_and_trimmed_mean_match_hand_computed_values():
    odd = _updates([{"a": [1.0, -2.0]}, {"a": [5.0, 7.0], "b": [3.0]}, {"a": [100.0, 7.0], "b": [9.0]}])
    out = _aggregate(CoordinateMedian, odd)
    assert out["a"].tolist() == [5.0, 7.0]  # a tie at 7 is still the middle value
    assert out["b"].tolist() == [6.0]  # b from the two clients that sent it: the mean of the middle two
    even = _updates([{"a": [1.0, 0.0]}, {"a": [3.0, 0.0]}, {"a": [5.0, 0.0]}, {"a": [1e6, 0.0]}])
    assert _aggregate(CoordinateMedian, even)["a"].tolist() == [4.0, 0.0]
    assert _aggregate(CoordinateMedian, even)["b"].tolist() == [1.0]  # nobody sent b: it keeps its value

    values = [{"a": [v, -v]} for v in (1.0, 2.0, 3.0, 4.0, 1e6)]
    trimmed = _aggregate(lambda c: TrimmedMean(c, beta=0.2), _updates(values, [1, 1, 1, 1, 50]))
    assert trimmed["a"].tolist() == [3.0, -3.0]  # k = floor(0.2 * 5) = 1 cut at each end; unweighted
    audited = TrimmedMean(CURRENT, beta=0.2)
    for update in _updates(values):
        audited.add(update)
    assert audited.audit() == {"trimmed_share": {"0": 1.0, "1": 0.0, "2": 0.0, "3": 0.0, "4": 1.0}}
    plain = _aggregate(lambda c: TrimmedMean(c, beta=0.0), _updates(values[:4]))
    assert plain["a"].tolist() == [2.5, -2.5]


def test_krum_keeps_the_updates_nearest_their_neighbours():
    points = [[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [10.0, 10.0]]
    updates = _updates([{"a": p} for p in points], [1, 2, 3, 4, 5])
    krum = Krum(CURRENT, f=1, m=1)
    for update in updates:
        krum.add(update)
    # n - f - 2 = 2 nearest: client 0 {1, 1} = 2; 1 {1, 1} = 2; 2 {1, 1} = 2; 3 {1, 1} = 2; 4 {162, 181} = 343
    assert krum.scores() == [2.0, 2.0, 2.0, 2.0, 343.0]
    assert [u.client_id for u in krum.kept()] == [0]  # a tie goes to the lowest client id
    assert krum.audit() == {"dropped": [1, 2, 3, 4]}
    assert krum.result()["a"].tolist() == [0.0, 0.0]
    multi = Krum(CURRENT, f=1, m=3)
    for update in updates:
        multi.add(update)
    torch.testing.assert_close(multi.result()["a"], torch.tensor([2 / 6, 3 / 6]))  # 0, 1, 2 weighted 1:2:3
    too_few = Krum(CURRENT, f=1, m=1)
    for update in updates[:4]:
        too_few.add(update)
    with pytest.raises(ValueError, match="needs at least 5 updates"):
        too_few.result()


def test_norm_bounding_scales_each_change_to_the_bound():
    updates = _updates([{"a": [3.0, 4.0], "b": [1.0]}, {"a": [0.0, 0.5]}], [1, 1])
    fixed = _aggregate(lambda c: NormBounded(c, 1.0), updates)
    bounded = NormBounded(CURRENT, 1.0)
    for update in updates:
        bounded.add(update)
    assert bounded.audit() == {"bound": 1.0, "down_weighted": {"0": 0.2}}  # client 0's change cut to a fifth
    torch.testing.assert_close(fixed["a"], torch.tensor([(0.6 + 0.0) / 2, (0.8 + 0.5) / 2]))  # |(3, 4)| = 5 -> 1
    assert fixed["b"].tolist() == [1.0]
    within = _aggregate(lambda c: NormBounded(c, 10.0), updates)
    assert within["a"].tolist() == [1.5, 2.25]  # nothing clipped: FedAvg's mean
    changes = _updates([{"a": [3.0, 4.0]}, {"a": [0.0, 1.0]}, {"a": [0.0, 2.0]}])  # norms 5, 1, 2: median 2
    adaptive = _aggregate(MedianNormBounded, changes)
    torch.testing.assert_close(adaptive["a"], torch.tensor([(1.2 + 0 + 0) / 3, (1.6 + 1 + 2) / 3]))


def test_fedopt_steps_on_a_robust_rules_aggregate():
    updates = _updates([{"a": [1.0, 1.0]}, {"a": [3.0, 3.0]}, {"a": [1e6, 1e6]}])
    plain_step = FedOpt("sgdm", lr=1.0, momentum=0.0, rule=CoordinateMedian)  # x - lr * (-delta) = the median
    assert plain_step.aggregate(CURRENT, updates)["a"].tolist() == [3.0, 3.0]
    halved = FedOpt("sgdm", lr=0.5, momentum=0.0, rule=CoordinateMedian)
    assert halved.aggregate(CURRENT, updates)["a"].tolist() == [1.5, 1.5]
    assert halved.aggregate(CURRENT, updates)["b"].tolist() == [1.0]  # unsent: no step
    assert FedAvg().aggregate(CURRENT, updates[:2])["a"].tolist() == [2.0, 2.0]


def test_a_run_with_a_robust_rule_commits_that_rules_aggregate(tmp_path, tiny_csv, one_thread):
    raw = tiny_config(tmp_path, tiny_csv, rounds=1, aggregator="trimmed_mean", trim_beta=0.25)
    config = validate(raw)
    assert isinstance(build_strategy(config.protocol), FedAvg)
    seen: list[ClientUpdate] = []

    class Scaling(InProcessExecutor):  # client 3 scales its parameters 50x: within the growth screen
        def run(self, jobs):
            for result in super().run(jobs):
                if isinstance(result, ClientReport):
                    if result.update.client_id == 3:
                        result.update.params = {n: t * 50 for n, t in result.update.params.items()}
                    seen.append(dataclasses.replace(result.update, params={  # shares the model's storage
                        n: t.clone() for n, t in result.update.params.items()}))
                yield result

    run_dir = tmp_path / "run"
    run_single(config, tiny_csv, run_dir, placement=Simulation(Scaling))
    final = torch.load(run_dir / "checkpoint" / "state.pt", weights_only=False)["global"]
    expected = TrimmedMean({n: final[n] for n in seen[0].params}, beta=0.25)
    for update in seen:
        expected.add(update)
    for name, value in expected.result().items():
        torch.testing.assert_close(final[name], value, rtol=0, atol=0)
    record = read_metrics(run_dir)[1]
    shares = record["defence"]["trimmed_share"]
    assert max(shares, key=shares.get) == "3"  # the scaled client's values are the ones cut most
    norms = record["update_norms"]
    assert sorted(norms) == ["0", "1", "2", "3"] and max(norms, key=norms.get) == "3"
    assert max(float(t.abs().max()) for t in final.values() if t.is_floating_point()) < 50


def test_rules_that_cannot_work_are_refused_in_one_line(tmp_path, tiny_csv):
    krum = validate(tiny_config(tmp_path, tiny_csv, aggregator="krum", krum_f=1))
    with pytest.raises(UserError, match=r"krum with krum_f 1 and krum_m 1 needs at least 5 clients per round "
                                        r"\(n > 2f \+ 2, m <= n - f\); this run samples 4"):
        run_single(krum, tiny_csv, tmp_path / "krum")
    with pytest.raises(UserError, match="aggregator median combines several clients' updates, and kind "
                                         "centralized has none"):
        validate({**tiny_config(tmp_path, tiny_csv), "protocol": {"kind": "centralized", "aggregator": "median"}})
    with pytest.raises(UserError, match="trim_beta"):
        validate(tiny_config(tmp_path, tiny_csv, aggregator="trimmed_mean", trim_beta=0.5))
    private = {**tiny_config(tmp_path, tiny_csv, aggregator="median"),
               "privacy": {"kind": "client", "clip": 1.0, "noise_multiplier": 1.0}}
    with pytest.raises(UserError, match=r"protocol\.aggregator median would take another statistic"):
        validate(private)


def test_the_screens_change_norm_is_the_exact_distance_chunk_by_chunk():
    """``update_norms`` come from the screen (fp32 differences), norm bounding's norms from the same distance in
    float64: chunked, it equals torch's over a tensor that spans several chunks (and a partial last one), a small
    one, and a non-contiguous one."""
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(RunningMean.CHUNK * 2 + 77, generator=gen)
    current = {"big": big, "small": torch.randn(5, 3, generator=gen), "t": torch.randn(40, 30, generator=gen).t()}
    params = {n: t + 0.01 * torch.randn(t.shape, generator=gen) for n, t in current.items()}
    for name in current:
        exact = float(torch.dist(params[name].double(), current[name].double())) ** 2
        assert squared_distance(params[name], current[name]) == pytest.approx(exact, rel=1e-5)
        assert squared_distance(params[name], current[name], torch.float64) == pytest.approx(exact, rel=1e-12)
    growth = UpdateScreen.of(current, None).growth(params)
    expected = sum(float(torch.dist(params[n].double(), current[n].double())) ** 2 for n in current) ** 0.5
    assert growth is not None and growth.change == pytest.approx(expected, rel=1e-5)
    assert update_norm(current, params) == pytest.approx(expected, rel=1e-12)  # norm bounding's, in float64
