"""The pfl arm of ``bench_peers.py``: the job in Apple's pfl simulator (PyTorch backend), in the pfl venv.

    python benchmarks/_peer_pfl.py JOB_JSON                                  # one process
    torchrun --standalone --nproc-per-node 2 benchmarks/_peer_pfl.py JOB_JSON  # pfl's own multi-worker mode

pfl's ``FederatedAveraging`` over a ``FederatedDataset`` whose users are the job's clients (a
``MinimizeReuseUserSampler`` over all of them, a cohort of all of them, so every client trains once a round),
``SimulatedBackend``, ``PyTorchModel`` with a fresh AdamW per user (``local_optimizer_create``; weight decay 0 as
fedlm's, where torch's AdamW defaults to 0.01) and a central SGD at learning rate 1 (FedAvg's plain average).
Under ``torchrun`` pfl splits each cohort and the central evaluation between the processes itself and all-reduces
the sums over gloo: its counterpart of ``fedlm run --workers 2``.

Two choices keep the job equal to fedlm's, both stated where they are made: each user's dataset is built when pfl
samples the user (pfl's ``make_dataset_fn``), in the batch order fedlm's client draws that round, padded to the
user's longest row and cut back to each batch's longest row in ``loss`` (pfl's in-memory ``Dataset`` slices fixed
tensors, so this is how it gets fedlm's dynamic padding); and the per-user evaluation before and after local
training that pfl's algorithm does in every round with ``iteration % evaluation_frequency == 0`` (round 1 always)
is switched off, since neither fedlm's job nor Flower's evaluates clients.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any

import _peer_common as common
import numpy as np
import torch
import torch.nn.functional as F
from pfl.aggregate.simulate import SimulatedBackend
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.base import TrainingProcessCallback
from pfl.callback.central_evaluation import CentralEvaluationCallback
from pfl.data.dataset import Dataset
from pfl.data.federated_dataset import FederatedDataset
from pfl.data.sampling import get_user_sampler
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
from pfl.internal.ops.selector import get_default_framework_module as get_ops
from pfl.metrics import Metrics, Weighted
from pfl.model.pytorch import PyTorchModel

CURRENT_ROUND = [1]  # the round pfl is in (1-based, fedlm's numbering), kept by RoundClock


class PflBert(torch.nn.Module):
    """The job's BERT with the ``loss`` / ``metrics`` methods pfl's PyTorch backend calls; tallies train loss."""

    def __init__(self, bert: torch.nn.Module) -> None:
        super().__init__()
        self.bert = bert
        self.train_tally = torch.zeros(2, dtype=torch.float64)  # summed loss, examples: this process, this round

    @staticmethod
    def _trimmed(input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor,
                 labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """The batch cut to its longest row, as fedlm pads per batch."""
        width = int(attention_mask.sum(dim=1).max())
        return {"input_ids": input_ids[:, :width], "attention_mask": attention_mask[:, :width],
                "token_type_ids": token_type_ids[:, :width], "labels": labels}

    def loss(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor,
             labels: torch.Tensor) -> torch.Tensor:
        self.train()
        loss = common.classification_loss(self.bert, self._trimmed(input_ids, attention_mask, token_type_ids, labels))
        self.train_tally += torch.tensor([float(loss.detach()) * len(labels), len(labels)], dtype=torch.float64)
        return loss

    @torch.no_grad()
    def metrics(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor,
                labels: torch.Tensor) -> dict[str, Weighted]:
        self.eval()
        batch = self._trimmed(input_ids, attention_mask, token_type_ids, labels)
        logits = self.bert(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
        self.train()
        n = len(labels)
        return {"loss": Weighted(float(F.cross_entropy(logits, labels)) * n, n),
                "accuracy": Weighted(float((logits.argmax(-1) == labels).sum()), n)}


def padded(rows: list[common.Row], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Rows padded to their longest, as the tensor tuple pfl's ``Dataset`` slices into batches."""
    batch = common.collate(rows, pad_id)
    return batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], batch["labels"]


def user_dataset_fn(job: common.Job, train_rows: list[common.Row], pad_id: int) -> Any:
    """pfl's ``make_dataset_fn``: the user's rows in the order fedlm's client trains them this round (one
    epoch's permutation from the same seeded generator), and dropout seeded as fedlm seeds it."""

    def make(user_id: int) -> Dataset:
        rows = common.client_rows(train_rows, job, user_id)
        seed = common.local_seed(job.seed, CURRENT_ROUND[0], user_id)
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
        torch.manual_seed(seed)
        return Dataset(raw_data=padded([rows[i] for i in order], pad_id), user_id=str(user_id))

    return make


class NoUserEvaluation(FederatedAveraging):
    """pfl's FedAvg without its per-user evaluation rounds (see the module docstring)."""

    def get_next_central_contexts(self, *args: Any, **kwargs: Any) -> Any:
        contexts, model, metrics = super().get_next_central_contexts(*args, **kwargs)
        if contexts is not None:
            contexts = tuple(dataclasses.replace(c, do_evaluation=False) for c in contexts)
        return contexts, model, metrics


class FinalEvaluation(CentralEvaluationCallback):
    """pfl's central evaluation (distributed over the workers), before round 1 and after the last round only,
    which is when fedlm's job evaluates; keeps the scores for the result line."""

    def __init__(self, dataset: Dataset, eval_params: NNEvalHyperParams, rounds: int) -> None:
        super().__init__(dataset, model_eval_params=eval_params, frequency=rounds)
        self.rounds = rounds
        self.scores: dict[int, dict[str, float]] = {}

    def _keep(self, round_idx: int, metrics: Metrics) -> Metrics:
        """Keep the scores here; nothing goes back into pfl's metrics, where a one-round run would hold the
        round-0 and the final scores under the same names (pfl refuses that)."""
        self.scores[round_idx] = {str(name).split("| ")[-1]: value.overall_value for name, value in metrics
                                  if str(name).split("| ")[-1] in ("loss", "accuracy")}
        return Metrics()

    def on_train_begin(self, *, model: Any) -> Metrics:
        return self._keep(0, self._eval(model)[1])

    def after_central_iteration(self, aggregate_metrics: Metrics, model: Any, *,
                                central_iteration: int) -> tuple[bool, Metrics]:
        if central_iteration != self.rounds - 1:
            return False, Metrics()
        return False, self._keep(self.rounds, self._eval(model)[1])


class RoundClock(TrainingProcessCallback):
    """Times the rounds (from after FinalEvaluation's round-0 score to the end of each round, the final score
    included, as it runs after FinalEvaluation), keeps ``CURRENT_ROUND`` for the users' batch order, and keeps the
    last round's train loss over all workers."""

    def __init__(self, clock: common.Clock, model: PflBert) -> None:
        self.clock, self.model = clock, model
        self.train_loss: float | None = None

    def on_train_begin(self, *, model: Any) -> Metrics:
        CURRENT_ROUND[0] = 1
        self.clock.start_rounds()
        return Metrics()

    def after_central_iteration(self, aggregate_metrics: Metrics, model: Any, *,
                                central_iteration: int) -> tuple[bool, Metrics]:
        tally = self.model.train_tally.clone()
        if get_ops().distributed.world_size > 1:
            torch.distributed.all_reduce(tally)
        self.train_loss = float(tally[0] / tally[1])
        self.model.train_tally.zero_()
        CURRENT_ROUND[0] = central_iteration + 2  # pfl counts iterations from 0, fedlm rounds from 1
        self.clock.lap()
        return False, Metrics()


def run(argv: list[str]) -> None:
    common.set_threads()
    job = common.Job.load(argv[0])
    clock = common.Clock()
    np.random.seed(job.seed)  # pfl draws its samplers' seeds from numpy's global state: the same on every worker
    train_rows, pad_id = common.load_rows(job, "train")
    test_rows, _ = common.load_rows(job, "test")
    bert = common.build_model(job)
    module = PflBert(bert)
    model = PyTorchModel(module, local_optimizer_create=functools.partial(torch.optim.AdamW, weight_decay=0.0),
                         central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0))
    users = list(range(job.num_clients))
    training = FederatedDataset(user_dataset_fn(job, train_rows, pad_id), get_user_sampler("minimize_reuse", users))
    backend = SimulatedBackend(training_data=training, val_data=None)
    ordered = sorted(test_rows, key=lambda row: -len(row[0]))  # fedlm's evaluation order, longest first
    eval_params = NNEvalHyperParams(local_batch_size=job.eval_batch_size)
    evaluation = FinalEvaluation(Dataset(raw_data=padded(ordered, pad_id)), eval_params, job.rounds)
    timer = RoundClock(clock, module)
    train_params = NNTrainHyperParams(local_learning_rate=job.lr, local_num_epochs=job.local_epochs,
                                      local_batch_size=job.batch_size, local_max_grad_norm=job.max_grad_norm)
    params = NNAlgorithmParams(central_num_iterations=job.rounds, evaluation_frequency=job.rounds + 1,
                               train_cohort_size=job.num_clients, val_cohort_size=0)
    NoUserEvaluation().run(algorithm_params=params, backend=backend, model=model, model_train_params=train_params,
                           model_eval_params=eval_params, callbacks=[evaluation, timer])
    if get_ops().distributed.global_rank == 0:
        final = evaluation.scores[job.rounds]
        common.report(clock, start_accuracy=evaluation.scores[0]["accuracy"], final_accuracy=final["accuracy"],
                      final_test_loss=final["loss"], train_loss=timer.train_loss,
                      workers=get_ops().distributed.world_size)


if __name__ == "__main__":
    run(sys.argv[1:])
