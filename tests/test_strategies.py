"""Aggregation against hand-computed values."""

import pytest
import torch

from fedlm.federation.local_training import LocalSettings
from fedlm.federation.params import weighted_mean
from fedlm.federation.strategies import ClientUpdate, FedAvg, FedOpt, FedProx, sample_clients


def _update(cid: int, n: int, value: list[float]) -> ClientUpdate:
    return ClientUpdate(cid, n, {"w": torch.tensor(value)})


def test_weighted_average_with_unequal_client_sizes():
    updates = [_update(0, 1, [0.0, 3.0]), _update(1, 3, [4.0, -1.0])]
    out = FedAvg().aggregate({"w": torch.zeros(2)}, updates)
    # (1*0 + 3*4)/4 = 3 ; (1*3 + 3*-1)/4 = 0
    assert torch.allclose(out["w"], torch.tensor([3.0, 0.0]))


def test_weighted_mean_rejects_zero_weight():
    with pytest.raises(ValueError):
        weighted_mean([({"w": torch.ones(1)}, 0.0)])


def test_fedprox_is_fedavg_plus_mu():
    updates = [_update(0, 2, [1.0]), _update(1, 6, [5.0])]
    assert FedProx(0.1).configure(LocalSettings(mu=0.0)) == LocalSettings(mu=0.1)
    assert torch.equal(FedProx(0.1).aggregate({"w": torch.zeros(1)}, updates)["w"],
                       FedAvg().aggregate({"w": torch.zeros(1)}, updates)["w"])


def test_fedadam_two_steps_match_hand_computation():
    opt = FedOpt("adam", lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3)
    x = {"w": torch.tensor([1.0, -2.0])}
    # round 1: average = [2, -2] -> delta = [1, 0]
    x1 = opt.aggregate(x, [_update(0, 1, [2.0, -2.0])])
    m1 = torch.tensor([0.1, 0.0])            # 0.9*0 + 0.1*delta
    v1 = torch.tensor([0.01, 0.0])           # 0.99*0 + 0.01*delta^2
    expect1 = torch.tensor([1.0, -2.0]) + 0.1 * m1 / (v1.sqrt() + 1e-3)
    assert torch.allclose(x1["w"], expect1, atol=1e-6)
    assert abs(float(x1["w"][0]) - (1.0 + 0.1 * 0.1 / 0.101)) < 1e-6
    # round 2: average = x1 + [-0.5, 0.5]
    delta2 = torch.tensor([-0.5, 0.5])
    x2 = opt.aggregate(x1, [_update(0, 1, (x1["w"] + delta2).tolist())])
    m2 = 0.9 * m1 + 0.1 * delta2
    v2 = 0.99 * v1 + 0.01 * delta2**2
    assert torch.allclose(x2["w"], expect1 + 0.1 * m2 / (v2.sqrt() + 1e-3), atol=1e-6)


def test_fedyogi_and_fedadagrad_second_moments():
    delta = torch.tensor([2.0])
    yogi = FedOpt("yogi", lr=1.0, beta1=0.0, beta2=0.5, tau=0.0)
    out = yogi.aggregate({"w": torch.zeros(1)}, [_update(0, 1, [2.0])])
    # v = 0 - 0.5*4*sign(0-4) = 2 ; x = 0 + 1*2/sqrt(2)
    assert torch.allclose(out["w"], torch.tensor([2.0 / 2.0**0.5]))
    ada = FedOpt("adagrad", lr=1.0, beta1=0.0, tau=0.0)
    out = ada.aggregate({"w": torch.zeros(1)}, [_update(0, 1, delta.tolist())])
    assert torch.allclose(out["w"], torch.tensor([1.0]))  # 2 / sqrt(4)


def test_server_sgd_momentum_is_heavy_ball_on_pseudo_gradient():
    opt = FedOpt("sgdm", lr=1.0, momentum=0.9)
    x0 = {"w": torch.tensor([0.0])}
    x1 = opt.aggregate(x0, [_update(0, 1, [1.0])])      # g = -1, buf = -1, x = 1
    assert torch.allclose(x1["w"], torch.tensor([1.0]))
    x2 = opt.aggregate(x1, [_update(0, 1, [1.5])])      # g = -0.5, buf = -0.9-0.5 = -1.4, x = 2.4
    assert torch.allclose(x2["w"], torch.tensor([2.4]))
    state = opt.state_dict()
    fresh = FedOpt("sgdm", lr=1.0, momentum=0.9)
    fresh.load_state_dict(state)
    assert torch.allclose(fresh.aggregate(x2, [_update(0, 1, [2.4])])["w"],
                          opt.aggregate(x2, [_update(0, 1, [2.4])])["w"])


def test_sampling_is_deterministic_and_without_replacement():
    ids = list(range(100))
    a = sample_clients(ids, 10, seed=3, round_idx=5)
    assert a == sample_clients(ids, 10, seed=3, round_idx=5)
    assert len(set(a)) == 10
    assert a != sample_clients(ids, 10, seed=3, round_idx=6)
    assert sample_clients(ids, 200, seed=0, round_idx=1) == ids
