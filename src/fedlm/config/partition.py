"""The partition section: one typed model per partitioner kind, told apart by ``kind``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    Tag,
    field_validator,
    model_serializer,
)

from fedlm.config.sections import Section

Positive = Annotated[float, Field(gt=0.0, strict=True, allow_inf_nan=False)]
Share = Annotated[float, Field(ge=0.0, strict=True, allow_inf_nan=False)]
GroupValue = str | int | float | bool


def _sums_to_one(mix: list[float]) -> list[float]:
    """One client's label shares are proportions of its data."""
    if abs(sum(mix) - 1) > 1e-6:
        raise ValueError(f"a client's label shares must sum to 1, these sum to {sum(mix):g}")
    return mix


Mix = Annotated[list[Share], AfterValidator(_sums_to_one)]


class PartitionSection(Section):
    """What every partition kind has: the number of clients and the local test share."""

    kind: str
    num_clients: int = Field(10, ge=1)
    holdout: float = Field(
        0.0, ge=0.0, lt=1.0, description="share of each client's examples kept as its local test set (0.2: 80/20)")

    @model_serializer(mode="wrap")
    def _chosen(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Kind, num_clients and the parameters that differ from their defaults, so that run labels, data.json
        and grid overrides that switch the kind carry only what was chosen."""
        fields = type(self).model_fields
        return {key: value for key, value in handler(self).items()
                if key in ("kind", "num_clients") or getattr(self, key) != fields[key].default}

    def spec(self) -> dict[str, Any]:
        """The kind and its parameters as a plain dict (without num_clients), as a run's data.json records it."""
        return self.model_dump(mode="json", exclude={"num_clients"})


class IidPartitionConfig(PartitionSection):
    """Uniform: equal sizes, examples at random."""

    kind: Literal["iid"] = "iid"


class QuantityDirichletConfig(PartitionSection):
    """FedNLP quantity skew: client sizes ~ Dir(beta); small beta gives very unequal sizes."""

    kind: Literal["quantity_dirichlet"] = "quantity_dirichlet"
    beta: Positive


class LabelDirichletConfig(PartitionSection):
    """FedNLP label skew: each client's label shares ~ Dir(alpha · label frequencies)."""

    kind: Literal["label_dirichlet"] = "label_dirichlet"
    alpha: Positive = Field(description="small alpha: few labels per client; large: the overall label mix")
    beta: Positive | None = Field(None, description="also draw client sizes from Dir(beta) (null: equal sizes)")


class LabelMixConfig(PartitionSection):
    """FedSplitBERT: client j holds the labels in the fixed shares mixes[j]."""

    kind: Literal["label_mix"] = "label_mix"
    mixes: list[Mix] = Field(min_length=1, description="one row of label shares per client, each summing to 1")

    @field_validator("mixes")
    @classmethod
    def _one_share_per_label(cls, mixes: list[list[float]]) -> list[list[float]]:
        """Share i of every row is label i's, so all rows need the same length."""
        for i, mix in enumerate(mixes):
            if len(mix) != len(mixes[0]):
                raise ValueError(f"mixes[{i}] has {len(mix)} shares but mixes[0] has {len(mixes[0])}; "
                                 "give every client one share per label")
        return mixes


class ScoreRangesConfig(PartitionSection):
    """FedSplitBERT STS-B: sorted by score, cut into contiguous equal parts."""

    kind: Literal["score_ranges"] = "score_ranges"


class NaturalPartitionConfig(PartitionSection):
    """FedNLP natural factor: one client per value of a data column, or per group of values."""

    kind: Literal["natural"] = "natural"
    column: str = Field(min_length=1, strict=True, description="the data column whose values define the clients")
    groups: list[Annotated[list[GroupValue], Field(min_length=1)]] | None = Field(
        None, min_length=1, description="lists of column values, one client each (values in no group are left out)")

    @field_validator("groups")
    @classmethod
    def _each_value_once(cls, groups: list[list[GroupValue]] | None) -> list[list[GroupValue]] | None:
        """Values are compared as strings, as the partitioner matches them (a YAML 1 is the column's '1')."""
        seen: set[str] = set()
        for value in (str(v) for group in groups or () for v in group):
            if value in seen:
                raise ValueError(f"value {value!r} is in more than one group")
            seen.add(value)
        return groups


class ClusteredPartitionConfig(PartitionSection):
    """FedNLP input-feature shift: k-means clusters of sentence embeddings, split like labels."""

    kind: Literal["clustered"] = "clustered"
    clusters: int = Field(ge=2, strict=True, description="k-means clusters of the texts' sentence embeddings")
    alpha: Positive = Field(description="label Dirichlet concentration over the cluster ids")
    beta: Positive | None = Field(None, description="also draw client sizes from Dir(beta) (null: equal sizes)")


class FdaptQuantityConfig(PartitionSection):
    """FDAPT quantity skew: client i holds i / Σj of the texts."""

    kind: Literal["fdapt_quantity"] = "fdapt_quantity"


class FdaptLengthConfig(PartitionSection):
    """FDAPT sentence-length skew at equal sizes and vocabularies."""

    kind: Literal["fdapt_length"] = "fdapt_length"


class FdaptVocabConfig(PartitionSection):
    """FDAPT vocabulary skew at equal sizes and mean lengths."""

    kind: Literal["fdapt_vocab"] = "fdapt_vocab"


def _partition_kind(section: Any) -> Any:
    """The kind a partition section names; a mapping without one is iid, the default."""
    if isinstance(section, dict):
        return section.get("kind", "iid")
    return getattr(section, "kind", None)


PartitionConfig = Annotated[
    Annotated[IidPartitionConfig, Tag("iid")]
    | Annotated[QuantityDirichletConfig, Tag("quantity_dirichlet")]
    | Annotated[LabelDirichletConfig, Tag("label_dirichlet")]
    | Annotated[LabelMixConfig, Tag("label_mix")]
    | Annotated[ScoreRangesConfig, Tag("score_ranges")]
    | Annotated[NaturalPartitionConfig, Tag("natural")]
    | Annotated[ClusteredPartitionConfig, Tag("clustered")]
    | Annotated[FdaptQuantityConfig, Tag("fdapt_quantity")]
    | Annotated[FdaptLengthConfig, Tag("fdapt_length")]
    | Annotated[FdaptVocabConfig, Tag("fdapt_vocab")],
    Discriminator(_partition_kind),
]
"""`kind` picks the partitioner; each kind has its own parameters beside it (alpha, beta, mixes, ...)."""
