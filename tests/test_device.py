"""Devices and precision on the CPU: ``auto`` resolves as documented and is bitwise the CPU run here; fp32 runs
no autocast at all; bf16 and fp16 autocast training, evaluation and both sides of the split boundary; fp16's
loss scaler unscales before clipping and skips overflowing steps; a bad device is one config-error line."""

from __future__ import annotations

import math

import datasets
import pytest
import torch

from fedlm.config import SplitConfig, validate
from fedlm.errors import UserError
from fedlm.federation.local_training import LocalSettings, clip_and_step, train_locally
from fedlm.models.build import build_model, build_tokenizer
from fedlm.models.cut import Activations, Cut, SplitModel
from fedlm.models.device import check_precision, resolve_device
from fedlm.run.prepare import prepare
from fedlm.run.recorder import RunRecorder, read_metrics
from fedlm.run.single import run_single
from fedlm.split.modes import TrunkChoice
from fedlm.split.trunk import TrunkBackend
from fedlm.tasks import get_task
from tests.conftest import make_sentences, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

ACCELERATOR_HERE = torch.cuda.is_available() or torch.backends.mps.is_available()
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def final_global(run_dir) -> dict[str, torch.Tensor]:
    return RunRecorder(run_dir).load_checkpoint()["global"]


def largest_gap(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max(float((got[name] - expected[name]).abs().max()) for name in expected)


# ------------------------------------------------------------------------------------------------ devices


def test_auto_picks_cuda_then_mps_then_cpu(monkeypatch):
    for cuda, mps, expected in ((True, True, "cuda"), (False, True, "mps"), (False, False, "cpu")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda mps=mps: mps)
        assert resolve_device("auto") == torch.device(expected)


def test_a_device_this_machine_lacks_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    for name in ("cuda", "cuda:0", "mps"):
        with pytest.raises(UserError, match=rf"^train\.device = '{name}': torch sees no") as err:
            resolve_device(name)
        assert "\n" not in str(err.value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match=r"train\.device = 'cuda:1': this machine has 1 CUDA device"):
        resolve_device("cuda:1")
    assert resolve_device("cpu") == torch.device("cpu")


def test_bf16_on_a_gpu_without_bfloat16_units_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    for capability, refused in (((7, 0), True), ((8, 0), False), ((9, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        check_precision(torch.device("cuda"), "fp16")
        if refused:
            with pytest.raises(UserError, match=r"^train\.precision = 'bf16': Tesla V100-SXM2-16GB has no bfloat16"):
                check_precision(torch.device("cuda"), "bf16")
        else:
            check_precision(torch.device("cuda"), "bf16")
    check_precision(torch.device("cpu"), "bf16")


@pytest.mark.parametrize("device", ["gpu", "CPU", "cuda:", "cuda:x", "cuda:0:1", ""])
def test_a_bad_device_string_is_one_config_error_line(tmp_path, tiny_csv, device):
    raw = tiny_config(tmp_path, tiny_csv)
    raw["train"]["device"] = device
    with pytest.raises(UserError) as err:
        validate(raw)
    message = str(err.value)
    assert message.startswith(f"config error: train.device = {device!r}: should be auto, cpu, cuda, cuda:N")
    assert "\n" not in message


def test_device_names_the_config_accepts(tmp_path, tiny_csv):
    for device in ("auto", "cpu", "cuda", "cuda:0", "cuda:12", "mps"):
        raw = tiny_config(tmp_path, tiny_csv)
        raw["train"]["device"] = device
        assert validate(raw).train.device == device
    assert validate(tiny_config(tmp_path, tiny_csv)).train.precision == "fp32"  # the default: today's arithmetic


@pytest.mark.skipif(ACCELERATOR_HERE, reason="auto means the CPU only on a machine without CUDA or MPS")
def test_auto_is_bitwise_the_cpu_run_here(tmp_path, tiny_csv):
    raw = tiny_config(tmp_path, tiny_csv, rounds=1)
    prep = prepare(validate(raw), tiny_csv)
    assert next(prep.model.parameters()).device == torch.device("cpu") and prep.task.precision == "fp32"
    rows = {}
    for device in ("auto", "cpu"):
        raw["train"]["device"] = device
        run_single(validate(raw), tiny_csv, tmp_path / device)
        rows[device] = read_metrics(tmp_path / device)[-1]
    auto, cpu = final_global(tmp_path / "auto"), final_global(tmp_path / "cpu")
    assert auto.keys() == cpu.keys() and all(torch.equal(auto[name], cpu[name]) for name in cpu)
    assert rows["auto"]["test_loss"] == rows["cpu"]["test_loss"]


# -------------------------------------------------------------------------------- precision: local training


@pytest.fixture(scope="module")
def classifier():
    """A tiny BERT classifier, its bound task and 32 training rows."""
    sentences = make_sentences(48)
    tokenizer = build_tokenizer(None, "bert", [text for text, _ in sentences], 200)
    task = get_task("classification")
    data = datasets.Dataset.from_dict({"text": [t for t, _ in sentences],
                                       "label": [int(label == "pos") for _, label in sentences]})
    rows = task.preprocess(data, tokenizer, 32).to_list()
    model = build_model("bert", "tiny", "classification", tokenizer, num_labels=2, seed=0)
    return model, task, rows


class DtypeProbe:
    """Records, at every forward of one linear layer, its output dtype and whether autocast was on."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.dtypes: set[torch.dtype] = set()
        self.autocast: set[bool] = set()
        self._handle = module.register_forward_hook(self)

    def __call__(self, module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        self.dtypes.add(output.dtype)
        self.autocast.add(torch.is_autocast_enabled("cpu"))

    def remove(self) -> None:
        self._handle.remove()


def first_linear(model: torch.nn.Module) -> torch.nn.Linear:
    return next(m for m in model.modules() if isinstance(m, torch.nn.Linear))


def train_epochs(classifier, precision: str, epochs: int = 6) -> tuple[list[float], DtypeProbe, torch.nn.Module]:
    """Train a fresh copy of the classifier epoch by epoch; the train loss of each epoch, and what ran."""
    _, task, rows = classifier
    model = build_model("bert", "tiny", "classification", task.bound_tokenizer, num_labels=2, seed=0)
    probe = DtypeProbe(first_linear(model))
    settings = LocalSettings(lr=3e-3, batch_size=8, precision=precision, mu=0.0)
    losses = [train_locally(model, task, rows, settings, seed=epoch)["train_loss"] for epoch in range(epochs)]
    probe.remove()
    return losses, probe, model


@pytest.fixture(scope="module")
def fp32_losses(classifier) -> list[float]:
    losses, probe, _ = train_epochs(classifier, "fp32")
    assert probe.dtypes == {torch.float32} and probe.autocast == {False}  # fp32 runs no autocast at all
    return losses


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_training_autocasts_and_learns(classifier, fp32_losses, precision):
    losses, probe, model = train_epochs(classifier, precision)
    assert probe.dtypes == {HALF[precision]} and probe.autocast == {True}
    assert all(p.dtype == torch.float32 for p in model.parameters())  # autocast casts per op; weights stay fp32
    assert all(math.isfinite(loss) for loss in losses)
    assert losses != fp32_losses and abs(losses[0] - fp32_losses[0]) < 0.01, (losses, fp32_losses)
    assert losses[-1] < losses[0] - 0.2, losses  # all three learn the cue words by the sixth epoch


def test_the_loss_scaler_unscales_before_clipping_and_skips_overflow():
    weight = torch.nn.Parameter(torch.zeros(4))
    gradient = torch.tensor([3.0, 4.0, 0.0, 0.0])  # norm 5
    optimizer = torch.optim.SGD([weight], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaler.scale((weight * gradient).sum()).backward()  # weight.grad is 1024 x the gradient
    clip_and_step(optimizer, [weight], 2.5, scaler)
    torch.testing.assert_close(weight.detach(), -gradient / 2)  # unscaled, then clipped from norm 5 to 2.5
    optimizer.zero_grad()
    scaler.scale((weight * torch.tensor([math.inf, 0.0, 0.0, 0.0])).sum()).backward()
    clip_and_step(optimizer, [weight], 2.5, scaler)
    torch.testing.assert_close(weight.detach(), -gradient / 2)  # an overflowing step changes nothing
    assert scaler.get_scale() < 2.0**10  # and lowers the scale


# ------------------------------------------------------------------------------------- precision: evaluation


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_evaluation_autocasts_and_scores_close_to_fp32(classifier, precision):
    model, task, rows = classifier
    model.train()
    probe = DtypeProbe(first_linear(model))
    scores = {}
    for name in ("fp32", precision):
        evaluator = get_task(task.name, task.bound_tokenizer, precision=name)
        scores[name] = evaluator.evaluate(model, rows, 16, torch.Generator().manual_seed(0))
    probe.remove()
    assert probe.dtypes == {torch.float32, HALF[precision]} and model.training
    assert scores[precision].keys() == scores["fp32"].keys()
    assert all(math.isfinite(value) for value in scores[precision].values())
    assert scores[precision]["loss"] != scores["fp32"]["loss"]
    assert abs(scores[precision]["loss"] - scores["fp32"]["loss"]) < 0.02


# ------------------------------------------------------------------------------------------ a whole run


def test_a_bf16_fedprox_run_keeps_parameters_and_aggregation_fp32(tmp_path, tiny_csv):
    raw = tiny_config(tmp_path, tiny_csv, kind="fedprox", mu=0.1)
    raw["train"] |= {"precision": "bf16", "device": "cpu"}
    prep = prepare(validate(raw), tiny_csv)
    assert prep.task.precision == "bf16" and next(prep.model.parameters()).device == torch.device("cpu")
    run_single(validate(raw), tiny_csv, tmp_path / "run")
    records = read_metrics(tmp_path / "run")
    assert all(math.isfinite(r["train_loss"]) for r in records[1:]) and math.isfinite(records[-1]["test_loss"])
    assert all(t.dtype == torch.float32 for t in final_global(tmp_path / "run").values())


# ------------------------------------------------------------------------------------------ split learning


@pytest.mark.parametrize(("mode", "cut"), [("sequential", (1, 1)), ("client_batch", (0, 1))])
def test_a_bf16_split_run_equals_the_unsplit_bf16_run(tmp_path, tiny_csv, mode, cut):
    """Client parts and trunk each run their ops under the same autocast as the whole model, on the same
    float32 hidden states at the cut, so the split run reproduces the unsplit one: bitwise on this CPU. The
    tolerance is the fp32 split test's (kernel choices may differ elsewhere); a side of the boundary left in
    fp32 would miss it by three orders of magnitude (bf16 and fp32 runs differ by ~5e-2 here)."""
    raw = tiny_config(tmp_path, tiny_csv)
    raw["partition"] = {"kind": "iid", "num_clients": 1}
    raw["model"]["overrides"] = {"hidden_dropout_prob": 0.1, "num_hidden_layers": 3}
    raw["train"] |= {"max_grad_norm": None, "precision": "bf16"}  # the split clips each side separately
    run_single(validate(raw), tiny_csv, tmp_path / "fedavg")
    raw["split"] = {"trunk_mode": mode, "client_parts": "average", "bottom_blocks": cut[0], "top_blocks": cut[1]}
    run_single(validate(raw), tiny_csv, tmp_path / "split")
    expected, got = final_global(tmp_path / "fedavg"), final_global(tmp_path / "split")
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=2e-5, msg=name)
    assert read_metrics(tmp_path / "split")[-1]["test_loss"] == pytest.approx(
        read_metrics(tmp_path / "fedavg")[-1]["test_loss"], abs=1e-4)


def three_block_split(classifier) -> SplitModel:
    tokenizer = classifier[1].bound_tokenizer
    model = build_model("bert", "tiny", "classification", tokenizer, num_labels=2, seed=0,
                        overrides={"num_hidden_layers": 3})
    return SplitModel(model, Cut(1, 1))


def test_the_trunk_computes_under_autocast_and_answers_in_its_own_dtype(classifier):
    split = three_block_split(classifier)
    backend = TrunkBackend(split.trunk, split.model.config.hidden_size,
                           lambda params: torch.optim.SGD(params, lr=0.1), precision="bf16")
    probe = DtypeProbe(first_linear(split.trunk))
    hidden = torch.randn(2, 5, split.model.config.hidden_size)
    with torch.no_grad():  # as an in-process caller may be
        answer = backend.forward("0", 0, Activations(hidden).to_dict())["hidden"]
    grad = backend.backward("0", 0, torch.ones_like(answer))["grad"]
    probe.remove()
    assert probe.dtypes == {torch.bfloat16} and probe.autocast == {True}
    assert answer.dtype == grad.dtype == torch.float32 and answer.device == grad.device == torch.device("cpu")
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_fp16_is_refused_for_split_learning_in_one_line(classifier):
    split = three_block_split(classifier)
    with pytest.raises(UserError, match=r"train\.precision = 'fp16' is not for split learning.*use bf16") as err:
        TrunkChoice.of(SplitConfig()).backend(split, LocalSettings(precision="fp16"))
    assert "\n" not in str(err.value)
