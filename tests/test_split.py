"""Split models against the unsplit model: one training step, parameter ownership, HF round trips."""

from __future__ import annotations

import copy
import dataclasses
import os

import datasets
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSequenceClassification

from fedlm.errors import UserError
from fedlm.models.build import FAMILIES, build_tokenizer
from fedlm.models.cut import Activations, Cut, SplitModel
from fedlm.models.heads import mlm_head
from fedlm.tasks import get_task
from fedlm.tasks.base import IGNORE_INDEX, Batch
from tests.split_helpers import wire
from tests.tiny_models import tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ENCODERS = ("bert", "roberta", "distilbert")
DECODERS = ("gpt2", "llama")
CUTS = (Cut(0, 0), Cut(1, 1))  # FedBERT, FL-GLM
LAYERS = 3  # the smallest depth that leaves FL-GLM's cut a server block
AUTO = {"mlm": AutoModelForMaskedLM, "clm": AutoModelForCausalLM, "classification": AutoModelForSequenceClassification}
WORDS = ["the", "a", "farmer", "client", "server", "model", "trained", "shared", "weights", "boats", "river"]
WORDS += ["near", "every", "our", "gradient"]
TEXTS = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(3 + i % 7)) + "." for i in range(40)]


def _lm(family: str) -> str:
    return "mlm" if family in ENCODERS else "clm"


CASES = [(family, task) for family in FAMILIES for task in (_lm(family), "classification")]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    return {family: build_tokenizer(None, family, TEXTS, 120) for family in FAMILIES}


def _model(family: str, task: str, tokenizers: dict, layers: int = LAYERS, seed: int = 0):
    return tiny_model(family, task, tokenizers[family], layers, seed, num_labels=3)


def _batch(family: str, task_name: str, tokenizers: dict, padding: str = "right") -> tuple:
    """A padded batch from the task's own collate (pairs, so BERT also sends token_type_ids).

    Right padding cannot reach a real token through a causal mask, so decoders also get left padding.
    """
    tok = tokenizers[family]
    task = get_task(task_name, tok)
    if task_name == "classification":
        data = datasets.Dataset.from_dict({"text": TEXTS[:6], "text_pair": TEXTS[6:12], "label": [0, 1, 2, 0, 1, 2]})
        rows = task.preprocess(data, tok, 64).to_list()
    else:
        rows = [{"input_ids": tok(text)["input_ids"]} for text in TEXTS[:6]]
    batch = task.collate(rows, torch.Generator().manual_seed(3))
    assert (batch["attention_mask"] == 0).any(), "the batch must have padding"
    if task_name == "mlm":
        assert (batch["labels"] != IGNORE_INDEX).any()
    if padding == "left":
        pads = (batch["attention_mask"] == 0).sum(1).tolist()
        batch = {
            key: torch.stack([row.roll(n) for row, n in zip(value, pads, strict=True)]) if value.dim() == 2 else value
            for key, value in batch.items()
        }
        assert (batch["attention_mask"][:, 0] == 0).any()
    return task, batch


def _split_loss(split: SplitModel, task_name: str, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The task's loss from the top's last hidden state, as the task layer computes it from the whole model."""
    labels = batch["labels"]
    if task_name == "mlm":  # MaskedLMTask: head at masked rows only, sum / count
        selected = labels != IGNORE_INDEX
        logits = mlm_head(split.model)(hidden[selected])
        return F.cross_entropy(logits.float(), labels[selected], reduction="sum") / int(selected.sum())
    logits = split.top.logits(hidden, batch["input_ids"])
    if task_name == "clm":  # CausalLMTask: next token, padding skipped
        targets = labels[:, 1:]
        predicted = targets != IGNORE_INDEX
        return F.cross_entropy(logits[:, :-1][predicted].float(), targets[predicted], reduction="sum") / int(
            predicted.sum()
        )
    return F.cross_entropy(logits.float(), labels)


def _split_step(split: SplitModel, task_name: str, batch: Batch, lr: float) -> tuple[torch.Tensor, Activations]:
    client_opt = torch.optim.SGD(split.client_parameters(), lr=lr)
    server_opt = torch.optim.SGD(split.trunk_parameters(), lr=lr)
    # forward: client bottom -> server trunk -> client top
    sent = split.bottom(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
    received = wire(sent)
    out = split.trunk(received)
    top_in = wire(out)
    loss = _split_loss(split, task_name, split.top(top_in), batch)
    # backward: client top -> server trunk -> client bottom; only gradient tensors cross back
    loss.backward()
    out.hidden.backward(top_in.hidden.grad.clone())
    sent.hidden.backward(received.hidden.grad.clone())
    client_opt.step()
    server_opt.step()
    return loss.detach(), sent


# ----------------------------------------------------------------------------------------- step equality


@pytest.mark.parametrize("cut", CUTS, ids=lambda cut: f"k{cut.bottom_blocks}m{cut.top_blocks}")
@pytest.mark.parametrize(
    ("family", "task_name", "padding"),
    [(*case, "right") for case in CASES] + [(*case, "left") for case in CASES if case[0] in DECODERS],
)
def test_split_step_equals_unsplit_step(tokenizers, family, task_name, padding, cut):
    task, batch = _batch(family, task_name, tokenizers, padding)
    reference = _model(family, task_name, tokenizers).train()  # dropout on: the RNG must be drawn in the same order
    model = copy.deepcopy(reference)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    lr = 1.0  # parameter differences then show gradient differences at full size

    torch.manual_seed(11)
    ref_loss, _ = task.loss(reference, batch)  # fedlm's own task path on the whole model
    ref_loss.backward()
    torch.optim.SGD(reference.parameters(), lr=lr).step()

    split = SplitModel(model, cut)
    torch.manual_seed(11)
    loss, sent = _split_step(split, task_name, batch, lr)

    torch.testing.assert_close(loss, ref_loss.detach(), rtol=0, atol=1e-5)
    expected, got = reference.state_dict(), model.state_dict()
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-5, msg=name)
    moved = [name for name, p in model.named_parameters() if not torch.equal(p, initial[name])]
    assert moved, "the step must move parameters"
    # what crossed the boundary: hidden states and masks, never ids or labels
    crossed = set(sent.to_dict())
    assert crossed == (
        {"hidden", "attention_mask", "position_ids"} if family in DECODERS else {"hidden", "attention_mask"}
    )
    assert sent.hidden.is_floating_point() and torch.equal(sent.attention_mask, batch["attention_mask"])


# -------------------------------------------------------------------------------------------- ownership


@pytest.mark.parametrize("cut", CUTS, ids=lambda cut: f"k{cut.bottom_blocks}m{cut.top_blocks}")
@pytest.mark.parametrize(("family", "task_name"), CASES)
def test_parameter_ownership_is_disjoint_and_complete(tokenizers, family, task_name, cut):
    model = _model(family, task_name, tokenizers)
    split = SplitModel(model, cut)
    client, trunk = split.client_parameter_names(), split.trunk_parameter_names()
    assert not set(client) & set(trunk)
    assert sorted(client + trunk) == sorted(name for name, _ in model.named_parameters())
    client_ids, trunk_ids = {id(p) for p in split.client_parameters()}, {id(p) for p in split.trunk_parameters()}
    assert not client_ids & trunk_ids and len(client_ids) == len(split.client_parameters())
    assert client_ids | trunk_ids == {id(p) for p in model.parameters()}
    # parts hold the model's own modules: the same parameter objects, not copies
    assert {id(p) for p in split.bottom.parameters()} | {id(p) for p in split.top.parameters()} == client_ids
    assert {id(p) for p in split.trunk.parameters()} == trunk_ids
    # the server holds exactly the middle blocks
    blocks = model.base_model.get_submodule(
        {"distilbert": "transformer.layer", "gpt2": "h", "llama": "layers"}.get(family, "encoder.layer")
    )
    middle = blocks[cut.bottom_blocks : LAYERS - cut.top_blocks]
    assert trunk_ids == {id(p) for p in middle.parameters()}
    # input embeddings and every head weight (tied to them or not) are on the client
    assert id(model.get_input_embeddings().weight) in client_ids
    output = model.get_output_embeddings()
    if output is not None:
        assert id(output.weight) in client_ids
        if task_name == "mlm":  # the MLM decoder is the word embedding matrix: one tensor, on the client
            assert output.weight is model.get_input_embeddings().weight


# ------------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("cut", [Cut(1, 1), Cut(2, 0), Cut(0, 2), Cut(-1, 0)])
def test_bad_cut_is_a_one_line_user_error(tokenizers, cut):
    model = _model("bert", "mlm", tokenizers, layers=2)
    with pytest.raises(UserError, match="server trunk needs at least one block") as error:
        SplitModel(model, cut)
    assert "\n" not in str(error.value)


# -------------------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize(("family", "task_name"), [(f, _lm(f)) for f in FAMILIES] + [("gpt2", "classification")])
def test_trained_split_model_saves_and_loads_whole(tmp_path, tokenizers, family, task_name):
    _, batch = _batch(family, task_name, tokenizers)
    model = _model(family, task_name, tokenizers).train()
    split = SplitModel(model, Cut(1, 1))
    _split_step(split, task_name, batch, lr=0.5)
    model.eval()
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    with torch.no_grad():
        ours = split.logits(inputs["input_ids"], inputs["attention_mask"], inputs.get("token_type_ids"))
    model.save_pretrained(tmp_path)
    loaded = AUTO[task_name].from_pretrained(tmp_path).eval()
    with torch.no_grad():
        theirs = loaded(**inputs).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("family", "task_name"), CASES)
def test_split_forward_matches_model_with_eager_attention(tokenizers, family, task_name):
    _, batch = _batch(family, task_name, tokenizers)
    model = _model(family, task_name, tokenizers).eval()
    model.set_attn_implementation("eager")  # masks are rebuilt per attention kernel on each side
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    with torch.no_grad():
        expected = model(**inputs).logits
        got = SplitModel(model, Cut(1, 1)).logits(
            inputs["input_ids"], inputs["attention_mask"], inputs.get("token_type_ids")
        )
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_a_left_padded_opt_batch_crosses_to_the_trunk_and_back_as_the_unsplit_model_computes():
    """OPT numbers padding -1 for its own position embeddings (run by the client's bottom); what it sends the
    trunk passes the trunk's message checks (no negative positions), and the trunk's answer is the unsplit one."""
    from transformers import AutoConfig

    from fedlm.split.trunk import TrunkBackend, TrunkLimits

    config = AutoConfig.for_model("opt", hidden_size=32, num_hidden_layers=3, num_attention_heads=4, ffn_dim=48,
                                  vocab_size=61, pad_token_id=0, max_position_embeddings=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 7, 8, 9]])
    mask = (ids != 0).long()
    split = SplitModel(model, Cut(1, 1))
    backend = TrunkBackend(split.trunk, 32, lambda params: torch.optim.SGD(params, lr=0.1),
                           limits=TrunkLimits.for_model(config, None, 2))
    sent = split.bottom(ids, mask)
    answer = backend.forward("client", 0, {name: t.detach() for name, t in sent.to_dict().items()})
    with torch.no_grad():
        logits = split.top.logits(split.top(dataclasses.replace(sent, hidden=answer["hidden"])), ids)
        expected = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits[mask.bool()], expected[mask.bool()], rtol=0, atol=1e-5)
