"""The experiment config: one YAML file, validated into typed sections, with dotted key=value overrides.

Every mistake is reported as one line naming the key, the value and what is allowed (a ``UserError``), so
a typo in a 40-line YAML never surfaces as a traceback half an hour into a run. ``sections`` and
``partition`` hold the typed sections, ``experiment`` the whole config with reading, validating and dumping,
``grid`` the expansion of grids, baselines and downstream runs; ``protocol_kinds`` says what each
``protocol.kind`` means (pools data, shares nothing, counts bytes, ...) and ``dp_support`` which families and
tasks DP-SGD trains. Validation lives here and nowhere else.
"""

from fedlm.config.experiment import (
    ExperimentConfig,
    dump_config,
    load_config,
    parse_override,
    parse_partition,
    read_yaml,
    set_dotted,
    validate,
)
from fedlm.config.grid import GridRun, downstream_config, expand_grid, expand_runs, is_named_axis, section_label
from fedlm.config.partition import (
    ClusteredPartitionConfig,
    FdaptLengthConfig,
    FdaptQuantityConfig,
    FdaptVocabConfig,
    IidPartitionConfig,
    LabelDirichletConfig,
    LabelMixConfig,
    NaturalPartitionConfig,
    PartitionConfig,
    QuantityDirichletConfig,
    ScoreRangesConfig,
)
from fedlm.config.sections import (
    AdapterConfig,
    AttackConfig,
    DataConfig,
    EvalConfig,
    FreezeWindowConfig,
    GenerationConfig,
    ModelConfig,
    PrivacyConfig,
    ProtocolConfig,
    QuantizationConfig,
    SharingConfig,
    SplitConfig,
    TrainConfig,
)

__all__ = [
    "AdapterConfig",
    "AttackConfig",
    "ClusteredPartitionConfig",
    "DataConfig",
    "EvalConfig",
    "ExperimentConfig",
    "FdaptLengthConfig",
    "FdaptQuantityConfig",
    "FdaptVocabConfig",
    "FreezeWindowConfig",
    "GenerationConfig",
    "GridRun",
    "IidPartitionConfig",
    "LabelDirichletConfig",
    "LabelMixConfig",
    "ModelConfig",
    "NaturalPartitionConfig",
    "PartitionConfig",
    "PrivacyConfig",
    "ProtocolConfig",
    "QuantityDirichletConfig",
    "QuantizationConfig",
    "ScoreRangesConfig",
    "SharingConfig",
    "SplitConfig",
    "TrainConfig",
    "downstream_config",
    "dump_config",
    "expand_grid",
    "expand_runs",
    "is_named_axis",
    "load_config",
    "parse_override",
    "parse_partition",
    "read_yaml",
    "section_label",
    "set_dotted",
    "validate",
]
