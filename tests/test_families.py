"""Any Hugging Face family: cutting, parameter groups, critical_layer and selectors found on the loaded model.

Tiny random configs of ten encoder / decoder families (GQA and sliding-window attention included) and two
encoder-decoders, and of eleven more families split with FedAvg, LoRA and P-Tuning v2 (the README's family
table); no family appears in a table of the code under test.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSequenceClassification
from transformers.masking_utils import create_causal_mask

from fedlm.config import AdapterConfig, SharingConfig, SplitConfig
from fedlm.config.protocol_kinds import PROTOCOL_KINDS
from fedlm.errors import UserError
from fedlm.federation.sharing import build_policy, num_blocks, select
from fedlm.models.adapters import apply_adapter
from fedlm.models.cut import Cut, SplitModel
from fedlm.models.introspect import block_stacks, cache_argument, find_layout, parameter_groups
from fedlm.models.prefixes import attention_modules
from fedlm.models.presets import check_overrides, config_class, get_preset, preset_config_kwargs
from fedlm.split.parts import split_model
from fedlm.split.setup import SplitSetup
from tests.split_helpers import assert_split_grads_equal_unsplit
from tests.tiny_models import (
    ENCODERS,
    FAMILY_CONFIG,
    GQA,
    LAYERS,
    SEQ2SEQ,
    TINY,
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


# ------------------------------------------------------------------------------------------------ more families

# Families beyond tiny_models' ten, as tiny random configs (no hub): OPT with a projection in and out of its
# blocks, partial rotary (gpt_neox, phi), Falcon-40B's grouped and Falcon-7B's multi-query attention, query/key
# norms (qwen3, olmo2, stablelm), Gemma 2's sliding windows and soft-capping, ModernBERT's local/global encoder
# rotary, DeBERTa-v2's own mask and DeBERTa-v3's relative attention.
MORE_FAMILIES: dict[str, dict] = {
    "opt": {"ffn_dim": 48, "word_embed_proj_dim": 16},
    "gpt_neox": {"rotary_pct": 0.5},
    "falcon": {"new_decoder_architecture": True, "num_kv_heads": 2},  # Falcon-40B/180B: grouped key/value heads
    "phi": {"partial_rotary_factor": 0.5},
    "stablelm": {"num_key_value_heads": 2, "qk_layernorm": True, "use_parallel_residual": True},
    "qwen3": {"num_key_value_heads": 2, "head_dim": 8},
    "gemma2": {"num_key_value_heads": 2, "head_dim": 8, "sliding_window": 4},
    "olmo2": {"num_key_value_heads": 2},
    "modernbert": {"global_attn_every_n_layers": 2, "local_attention": 4, "cls_token_id": 1, "sep_token_id": 2},
    "deberta-v2": {},
    "xlm-roberta": {},
}
# DeBERTa-v3's layout: relative attention with shared (layer-normed) position embeddings every block reads
DEBERTA_V3 = {"relative_attention": True, "position_buckets": 8, "max_relative_positions": 16,
              "norm_rel_ebd": "layer_norm", "pos_att_type": ["p2c", "c2p"], "share_att_key": True}
VARIANTS: dict[str, tuple[str, dict]] = {
    **{f: (f, c) for f, c in {**FAMILY_CONFIG, **MORE_FAMILIES}.items()},
    "falcon-7b": ("falcon", {}),  # multi-query attention: one key/value head
    "deberta-v3": ("deberta-v2", DEBERTA_V3),
}
MORE_ENCODERS = (*ENCODERS, "modernbert", "deberta-v2", "deberta-v3", "xlm-roberta")
# What P-Tuning v2 refuses when the adapter is applied: attention with no key/value cache, and Falcon-7B's
# single cached key/value head (peft sizes the prefixes by the config's heads)
NO_PREFIXES = {**dict.fromkeys(("distilbert", "modernbert", "deberta-v2", "deberta-v3"), "take no past keys/values"),
               "falcon-7b": "caches 1 key/value head"}
# What split training refuses, by (variant, task): ModernBERT's classifier pools and transforms its first token
# in ways fedlm's split head does not (models/heads.py), which check_exact finds before training.
REFUSED_TASKS: dict[tuple[str, str], str] = {}  # (family, task) a split refuses; none today
KIND_TASKS = {"none": ("lm", "classification"), "lora": ("classification",), "p_tuning_v2": ("lm",)}


def _variant_model(variant: str, task: str) -> torch.nn.Module:
    family, config = VARIANTS[variant]
    return _tiny(family, config, task, encoder=variant in MORE_ENCODERS)


def _tiny(family: str, config: dict, task: str, encoder: bool) -> torch.nn.Module:
    """A tiny random ``family`` model (TINY + ``config``) for ``task`` (lm, classification), in eval mode."""
    auto = {"lm": AutoModelForMaskedLM if encoder else AutoModelForCausalLM,
            "classification": AutoModelForSequenceClassification}[task]
    torch.manual_seed(0)
    return auto.from_config(AutoConfig.for_model(family, **{**TINY, **config, "num_labels": 3})).eval()


def _adapt(model: torch.nn.Module, kind: str, task: str) -> torch.nn.Module:
    """``model`` under ``kind`` (none: FedAvg's full model), its adapter weights away from their (zero) start."""
    if kind == "none":
        return model
    spec = AdapterConfig(kind="lora", r=2, target_modules="all-linear") if kind == "lora" else AdapterConfig(
        kind="p_tuning_v2", prefix_length=3)
    model = apply_adapter(spec, model, task, seed=0).model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or ".prefix_kv." in name:
                p.normal_(0, 0.5)
    return model


def _batch(variant: str, task: str, padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = random_batch(left_padding=variant not in MORE_ENCODERS and task == "lm")
    if not padded:
        ids = torch.randint(3, VOCAB, ids.shape, generator=torch.Generator().manual_seed(3))
        mask = torch.ones_like(ids)
    return ids, mask


@pytest.mark.parametrize("kind", ["none", "lora", "p_tuning_v2"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_family_splits_exactly_or_is_refused_before_training(variant, kind):
    """FedAvg (the whole model: a language model and a classifier), LoRA (a classifier, its head trained too)
    and P-Tuning v2 (a language model), each with and without padding: a split step's loss and gradients equal
    the unsplit step's, and ``check_exact`` (which ``split_model`` runs before training) passes; what is
    refused is refused in one line saying why."""
    cut = Cut(0, 0) if variant == "deberta-v3" else Cut(1, 1)  # its blocks share their position embeddings
    tasks = KIND_TASKS[kind]
    if any((variant, task) in REFUSED_TASKS for task in tasks):
        tasks = (*tasks, "lm")  # what this family's LoRA does split
    for task in tasks:
        model = _variant_model(variant, task)
        if kind == "p_tuning_v2" and variant in NO_PREFIXES:
            with pytest.raises(UserError, match=NO_PREFIXES[variant]) as error:
                _adapt(model, kind, task)
            assert "\n" not in str(error.value) and "use adapter.kind lora" in str(error.value)
            continue
        model = _adapt(model, kind, task)
        if (variant, task) in REFUSED_TASKS:
            with pytest.raises(UserError, match=REFUSED_TASKS[variant, task]) as error:
                SplitModel(model, cut).check_exact()
            assert "\n" not in str(error.value) and "without a split section" in str(error.value)
            continue
        SplitModel(model, cut).check_exact()
        for padded in (True, False):
            ids, mask = _batch(variant, task, padded)
            assert_split_grads_equal_unsplit(model, cut, ids, mask, random_loss)
            model.zero_grad(set_to_none=True)


# What cannot split exactly is refused before training, in one line that says why and what to do instead.
CUT_REFUSALS = [
    ("falcon", {"alibi": True, "multi_query": False}, Cut(1, 1), "with ALiBi position biases.*alibi false"),
    ("bloom", {}, Cut(1, 1), "with ALiBi position biases"),
    ("deberta-v2", DEBERTA_V3, Cut(1, 1), r"every block reads encoder\.LayerNorm, encoder\.rel_embeddings.*"
                                          r"split\.bottom_blocks 0 and split\.top_blocks 0"),
    ("deberta-v2", {**DEBERTA_V3, "conv_kernel_size": 3}, Cut(0, 0), r"runs encoder\.conv between its blocks"),
]


@pytest.mark.parametrize(("family", "config", "cut", "reason"), CUT_REFUSALS,
                         ids=["falcon-alibi", "bloom", "deberta-v3-client-blocks", "deberta-v2-conv"])
def test_a_family_that_cannot_split_exactly_is_refused_in_one_line(family, config, cut, reason):
    model = _tiny(family, config, "lm", encoder=family == "deberta-v2")
    with pytest.raises(UserError, match=f"cannot split a {family} model.*{reason}") as error:
        SplitModel(model, cut)
    assert "\n" not in str(error.value)


def test_a_split_run_refuses_before_training_what_its_parts_would_not_compute_exactly(monkeypatch):
    """The safety net for any other family: ``split_model`` (which a run's setup calls before its first round)
    compares the split forward with the model's own. DeBERTa handed the generic mask (issue 37's bug) is
    refused there, not trained wrong; an exact family passes."""
    spec = SplitConfig(bottom_blocks=1, top_blocks=1)
    model = _variant_model("deberta-v2", "classification")
    split_model(model, spec)
    monkeypatch.setattr("fedlm.models.cut._builds_own_inputs", lambda container, takes: False)
    with pytest.raises(UserError, match="cannot split a deberta-v2 model") as error:
        split_model(model, spec)
    assert "\n" not in str(error.value) and "without a split section" in str(error.value)
    classifier = _variant_model("modernbert", "classification")
    SplitSetup.cut(classifier, spec)  # its own classifier head: exact
    monkeypatch.setattr("fedlm.models.heads._pooled_head_classifier",  # the head it was sent down before
                        lambda modules, hidden, input_ids, config: modules["classifier"](hidden))
    with pytest.raises(UserError, match="cannot split a modernbert model: its split task head"):
        SplitSetup.cut(classifier, spec)


def test_opt_cuts_its_decoder_by_what_its_forward_runs_before_and_after_the_blocks():
    """OPT registers its final norm and projection out before its layers; they go to the client's top, its
    position embeddings and projection in to the bottom, and the positions it numbers -1 for padding are not
    sent as negative positions (the trunk refuses those)."""
    split = SplitModel(_variant_model("opt", "lm"), Cut(1, 1))
    assert split.layout.embeddings == ("decoder.embed_tokens", "decoder.embed_positions", "decoder.project_in")
    assert split.layout.final_norm == ("decoder.final_layer_norm", "decoder.project_out")
    ids, mask = random_batch(left_padding=True)
    assert int(split.bottom(ids, mask).position_ids.min()) == 0
    groups = parameter_groups(split.model)
    assert groups["model.decoder.embed_positions.weight"] == "embeddings"
    assert groups["model.decoder.final_layer_norm.weight"] == groups["model.decoder.project_out.weight"] == "head"


@pytest.mark.parametrize("family", ["gpt_neox", "falcon"])
def test_attention_that_takes_its_cache_as_layer_past_gets_prefixes(family):
    """GPT-NeoX and Falcon attention take the cache as ``layer_past``: P-Tuning v2 finds a layer per block."""
    model = _variant_model(family, "lm")
    layers = attention_modules(model, "p_tuning_v2")
    assert len(layers) == LAYERS and all(cache_argument(layer.forward) == "layer_past" for layer in layers)
