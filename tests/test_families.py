"""Any Hugging Face family: cutting, parameter groups, critical_layer and selectors found on the loaded model.

Tiny random configs of ten encoder / decoder families (GQA and sliding-window attention included) and two
encoder-decoders; no family appears in a table of the code under test.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification
from transformers.masking_utils import create_causal_mask

from fedlm.config import SharingConfig
from fedlm.config.protocol_kinds import PROTOCOL_KINDS
from fedlm.errors import UserError
from fedlm.federation.sharing import build_policy, num_blocks, select
from fedlm.models.cut import Cut, SplitModel
from fedlm.models.introspect import block_stacks, cache_argument, find_layout, parameter_groups
from fedlm.models.presets import check_overrides, config_class, get_preset, preset_config_kwargs
from tests.split_helpers import assert_split_grads_equal_unsplit
from tests.tiny_models import (
    ENCODERS,
    FAMILY_CONFIG,
    GQA,
    LAYERS,
    SEQ2SEQ,
    VOCAB,
    hf_model,
    random_batch,
    random_loss,
)

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [(f, t) for f in FAMILY_CONFIG for t in ("lm", "classification")]


@pytest.mark.parametrize("cut", [Cut(0, 0), Cut(1, 1)], ids=["k0m0", "k1m1"])
@pytest.mark.parametrize(("family", "task"), CASES)
def test_split_step_equals_unsplit_step_in_every_family(family, task, cut):
    ids, mask = random_batch(left_padding=family not in ENCODERS and task == "lm")
    assert_split_grads_equal_unsplit(hf_model(family, task), cut, ids, mask, random_loss)


@pytest.mark.parametrize("family", GQA)
def test_gqa_configs_really_share_key_value_heads(family):
    model = hf_model(family, "lm")
    config = model.config
    assert config.num_key_value_heads < config.num_attention_heads
    attention = next(m for m in model.modules() if hasattr(m, "num_key_value_groups"))
    assert attention.num_key_value_groups == config.num_attention_heads // config.num_key_value_heads > 1


def test_sliding_window_layers_are_cut_with_their_own_masks():
    model = hf_model("gemma3_text", "lm")
    layout = SplitModel(model, Cut(1, 1)).layout
    assert layout.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert layout.rotary_per_type and layout.causal and layout.final_norm == ("norm",)


def _block_param_names(model: torch.nn.Module, stack_index: int, block: int) -> set[str]:
    stack = model.base_model.get_submodule(block_stacks(model)[stack_index].path)
    ids = {id(p) for p in stack[block].parameters()}
    return {n for n, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("family", [*FAMILY_CONFIG, *SEQ2SEQ])
def test_critical_layer_picks_the_embeddings_and_lower_blocks_by_identity(family):
    model = hf_model(family, "seq2seq" if family in SEQ2SEQ else "classification")
    names = [n for n, _ in model.named_parameters()]
    groups = parameter_groups(model)
    blocks = LAYERS + (2 if family in SEQ2SEQ else 0)
    assert num_blocks(names, groups) == blocks
    embedding = {n for n, p in model.named_parameters() if p is model.get_input_embeddings().weight}
    assert {groups[n] for n in embedding} == {"embeddings"}

    policy = build_policy(SharingConfig(critical_layer=1), PROTOCOL_KINDS["fedavg"], names, {0: 1}, groups)
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
    model = hf_model(family, "seq2seq")
    names = [n for n, _ in model.named_parameters()]
    groups = parameter_groups(model)
    decoder_first = set(select(f"block {LAYERS + 1}", names, "test", groups))
    assert decoder_first == _block_param_names(model, 1, 0)
    policy = build_policy(SharingConfig(critical_layer=LAYERS), PROTOCOL_KINDS["fedavg"], names, {0: 1}, groups)
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


def test_the_cache_argument_is_found_under_either_spelling():
    """transformers 5.24 renamed attention layers' and mask builders' ``past_key_values`` to ``cache``; prefix
    tuning and split parts pass the cache by whichever name the installed version takes."""
    def old(hidden, attention_mask=None, past_key_values=None): ...
    def new(hidden, attention_mask=None, cache=None): ...
    def neither(hidden, attention_mask=None): ...
    assert (cache_argument(old), cache_argument(new), cache_argument(neither)) == ("past_key_values", "cache", None)
    assert cache_argument(create_causal_mask) in ("cache", "past_key_values")
