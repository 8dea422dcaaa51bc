"""Any Hugging Face family: cutting, parameter groups, critical_layer and selectors found on the loaded model.

Tiny random configs of ten encoder / decoder families (GQA and sliding-window attention included) and two
encoder-decoders; no family appears in a table of the code under test.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
)

from fedlm.config import SharingConfig
from fedlm.errors import UserError
from fedlm.federation.sharing import build_policy, num_blocks, select
from fedlm.models.cut import Activations, Cut, SplitModel
from fedlm.models.introspect import block_stacks, find_layout, parameter_groups
from fedlm.models.presets import check_overrides, config_class, get_preset, preset_config_kwargs

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, LAYERS = 61, 3
TINY = dict(
    hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=48, vocab_size=VOCAB,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=64,
)
# What each family needs beyond TINY: GQA (fewer key/value heads than query heads) in every decoder that
# supports it, and a sliding window shorter than the batch so that windowed masks differ from full ones.
FAMILY_CONFIG: dict[str, dict] = {
    "bert": {},
    "roberta": {},
    "distilbert": {"hidden_dim": 48},
    "electra": {"embedding_size": 16},
    "gpt2": {"n_inner": 48},
    "llama": {"num_key_value_heads": 2},
    "mistral": {"num_key_value_heads": 1, "sliding_window": 4},
    "qwen2": {"num_key_value_heads": 2, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
    "gemma3_text": {
        "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    },
    "phi3": {"num_key_value_heads": 2},
}
ENCODERS = ("bert", "roberta", "distilbert", "electra")
GQA = ("llama", "mistral", "qwen2", "gemma3_text", "phi3")
SEQ2SEQ = {"t5": {"num_decoder_layers": 2, "d_kv": 8}, "bart": {"decoder_layers": 2}}


def _config(family: str, **extra):
    return AutoConfig.for_model(family, **{**TINY, **FAMILY_CONFIG.get(family, {}), **SEQ2SEQ.get(family, {}), **extra})


def _model(family: str, task: str) -> torch.nn.Module:
    auto = {"lm": AutoModelForMaskedLM if family in ENCODERS else AutoModelForCausalLM,
            "classification": AutoModelForSequenceClassification, "seq2seq": AutoModelForSeq2SeqLM}[task]
    torch.manual_seed(0)
    return auto.from_config(_config(family, num_labels=3)).eval()  # eval: no dropout, so both paths agree


def _batch(left_padding: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 3:] = 0
    if left_padding:
        mask = mask.flip(1)
    return ids.masked_fill(mask == 0, 0), mask


def _loss(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    targets = torch.randint(0, logits.shape[-1], logits.shape[:-1], generator=torch.Generator().manual_seed(2))
    if logits.dim() == 2:  # sequence classification
        return F.cross_entropy(logits.float(), targets)
    keep = mask.bool()
    return F.cross_entropy(logits[keep].float(), targets[keep])


def _wire(acts: Activations) -> Activations:
    return Activations.from_dict({name: t.detach().clone() for name, t in acts.to_dict().items()}).detached()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


CASES = [(f, t) for f in FAMILY_CONFIG for t in ("lm", "classification")]


@pytest.mark.parametrize("cut", [Cut(0, 0), Cut(1, 1)], ids=["k0m0", "k1m1"])
@pytest.mark.parametrize(("family", "task"), CASES)
def test_split_step_equals_unsplit_step_in_every_family(family, task, cut):
    model = _model(family, task)
    ids, mask = _batch(left_padding=family not in ENCODERS and task == "lm")
    whole = _loss(model(input_ids=ids, attention_mask=mask).logits, mask)
    whole.backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)

    split = SplitModel(model, cut)
    sent = split.bottom(ids, mask)
    received = _wire(sent)
    out = split.trunk(received)
    top_in = _wire(out)
    loss = _loss(split.top.logits(split.top(top_in), ids), mask)
    loss.backward()
    out.hidden.backward(top_in.hidden.grad)
    sent.hidden.backward(received.hidden.grad)

    assert torch.allclose(loss, whole, atol=1e-5, rtol=0)
    got = _grads(model)
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        assert torch.allclose(got[name], grad, atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("family", GQA)
def test_gqa_configs_really_share_key_value_heads(family):
    model = _model(family, "lm")
    config = model.config
    assert config.num_key_value_heads < config.num_attention_heads
    attention = next(m for m in model.modules() if hasattr(m, "num_key_value_groups"))
    assert attention.num_key_value_groups == config.num_attention_heads // config.num_key_value_heads > 1


def test_sliding_window_layers_are_cut_with_their_own_masks():
    model = _model("gemma3_text", "lm")
    layout = SplitModel(model, Cut(1, 1)).layout
    assert layout.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert layout.rotary_per_type and layout.causal and layout.final_norm == ("norm",)


def _block_param_names(model: torch.nn.Module, stack_index: int, block: int) -> set[str]:
    stack = model.base_model.get_submodule(block_stacks(model)[stack_index].path)
    ids = {id(p) for p in stack[block].parameters()}
    return {n for n, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("family", [*FAMILY_CONFIG, *SEQ2SEQ])
def test_critical_layer_picks_the_embeddings_and_lower_blocks_by_identity(family):
    model = _model(family, "seq2seq" if family in SEQ2SEQ else "classification")
    names = [n for n, _ in model.named_parameters()]
    groups = parameter_groups(model)
    blocks = LAYERS + (2 if family in SEQ2SEQ else 0)
    assert num_blocks(names, groups) == blocks
    embedding = {n for n, p in model.named_parameters() if p is model.get_input_embeddings().weight}
    assert {groups[n] for n in embedding} == {"embeddings"}

    policy = build_policy(SharingConfig(critical_layer=1), "fedavg", names, {0: 1}, groups)
    block0 = _block_param_names(model, 0, 0)
    assert block0 and block0 <= set(policy.global_names)
    assert embedding <= set(policy.global_names)
    assert set(policy.global_names) - block0 == {n for n in names if groups[n] == "embeddings"}
    assert _block_param_names(model, 0, 1) <= set(policy.local_names)
    assert {groups[n] for n in policy.local_names} >= {1, 2}
    assert {n for n in names if groups[n] == "head"} <= set(policy.local_names)

    picked = set(select("block 2", names, "test", groups))
    assert picked == _block_param_names(model, 0, 1)


@pytest.mark.parametrize("family", list(SEQ2SEQ))
def test_encoder_decoder_blocks_count_encoder_first_and_refuse_a_cut_in_one_line(family):
    model = _model(family, "seq2seq")
    names = [n for n, _ in model.named_parameters()]
    groups = parameter_groups(model)
    decoder_first = set(select(f"block {LAYERS + 1}", names, "test", groups))
    assert decoder_first == _block_param_names(model, 1, 0)
    policy = build_policy(SharingConfig(critical_layer=LAYERS), "fedavg", names, {0: 1}, groups)
    encoder = set().union(*(_block_param_names(model, 0, b) for b in range(LAYERS)))
    assert encoder <= set(policy.global_names) and decoder_first <= set(policy.local_names)
    with pytest.raises(UserError, match=f"cannot cut a {family} model") as error:
        SplitModel(model, Cut(0, 0))
    assert "\n" not in str(error.value) and "encoder-decoder" in str(error.value)


def test_a_model_without_attention_blocks_cannot_be_cut_and_says_so():
    config = AutoConfig.for_model("mamba", hidden_size=16, num_hidden_layers=2, vocab_size=VOCAB, state_size=4)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UserError, match=r"cannot cut a mamba model: no nn\.ModuleList of transformer blocks"):
        find_layout(model)


@pytest.mark.parametrize("family", [*FAMILY_CONFIG, *SEQ2SEQ])
def test_tiny_preset_sizes_every_family_in_its_own_field_names(family):
    preset = get_preset("tiny")
    config = config_class(family)(**preset_config_kwargs(family, preset, pad_token_id=0), vocab_size=VOCAB,
                                  pad_token_id=0)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (
        preset.hidden, preset.layers, preset.heads)
    model = AutoModelForSequenceClassification.from_config(config)
    assert sum(s.size for s in block_stacks(model)) == preset.layers * (2 if family in SEQ2SEQ else 1)


def test_unknown_family_and_typo_overrides_are_one_line_errors():
    with pytest.raises(UserError, match="unknown model family 'lama'"):
        get_preset("tiny") and config_class("lama")
    with pytest.raises(UserError, match="unknown mistral config field"):
        check_overrides("mistral", {"num_kv_heads": 1})
