"""Partitioners, partition statistics/report, cache and hold-out split."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from fedlm.config import LabelDirichletConfig
from fedlm.data.partition import (
    Partition,
    Partitioner,
    PartitionInput,
    build_partitioner,
    first_come_counts,
    holdout_split,
    partition_cached,
)
from fedlm.data.partition_stats import client_statistics, distributions, js_divergence, write_partition_report
from fedlm.errors import UserError

LABEL_PRIOR = [0.4, 0.3, 0.2, 0.1]


def synthetic_texts(n: int, seed: int = 0, vocab: int = 20_000) -> list[str]:
    """Texts of 3-40 words; each mixes a shared Zipf vocabulary with uniform (rare) words at its own
    rate, so texts differ in length and in how rare their words are, as real text does."""
    rng = np.random.default_rng(seed)
    zipf = 1.0 / np.arange(1, vocab + 1) ** 1.1
    lengths = rng.integers(3, 41, n)
    total = int(lengths.sum())
    common = rng.choice(vocab, size=total, p=zipf / zipf.sum())
    rare = rng.integers(0, vocab, total)
    rare_rate = np.repeat(rng.uniform(0.0, 0.6, n), lengths)
    words = np.where(rng.random(total) < rare_rate, rare, common)
    pieces = np.split(words, np.cumsum(lengths)[:-1])
    return [" ".join(f"w{w}" for w in piece) for piece in pieces]


def labelled(n: int, seed: int = 0) -> PartitionInput:
    labels = np.random.default_rng(seed).choice(len(LABEL_PRIOR), size=n, p=LABEL_PRIOR)
    return PartitionInput(n=n, labels=labels, fingerprint=f"labelled-{n}-{seed}")


@pytest.fixture(scope="module")
def rich_data() -> PartitionInput:
    """Labels, scores, texts and a natural-factor column on the same 1,200 examples."""
    rng = np.random.default_rng(3)
    n = 1200
    return PartitionInput(
        n=n,
        labels=rng.choice(len(LABEL_PRIOR), size=n, p=LABEL_PRIOR),
        texts=synthetic_texts(n, seed=3),
        columns={"group": [f"g{v}" for v in rng.integers(0, 6, n)]},
        fingerprint="rich",
    )


@pytest.fixture(scope="module")
def corpus() -> PartitionInput:
    texts = synthetic_texts(3000, seed=7)
    return PartitionInput(n=len(texts), texts=texts, fingerprint="corpus")


def label_fractions(partition: Partition, labels: np.ndarray) -> np.ndarray:
    held = [labels[partition.client_indices(c)] for c in range(partition.num_clients)]
    return distributions(np.stack([np.bincount(client_labels, minlength=4) for client_labels in held]))


COVERING_SPECS = [
    ({"kind": "iid"}, 6),
    ({"kind": "quantity_dirichlet", "beta": 0.5}, 6),
    ({"kind": "label_dirichlet", "alpha": 0.5}, 6),
    ({"kind": "label_dirichlet", "alpha": 0.5, "beta": 1.0}, 6),
    ({"kind": "natural", "column": "group"}, 6),
    ({"kind": "fdapt_quantity"}, 4),
    ({"kind": "fdapt_length"}, 4),
    ({"kind": "fdapt_vocab"}, 4),
]
# natural, score_ranges and the FDAPT length/vocabulary sorts are deterministic (the seed only breaks ties)
DETERMINISTIC = ("natural", "fdapt_length", "fdapt_vocab")
MIXES = [[0.7, 0.1, 0.1, 0.1], [0.1, 0.7, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]]
RANDOM_SPECS = [spec for spec, _ in COVERING_SPECS if spec["kind"] not in DETERMINISTIC]
RANDOM_SPECS.append({"kind": "label_mix", "mixes": MIXES})


def assert_exact_cover(partition: Partition) -> None:
    """client_indices of all clients are disjoint and together are exactly the assigned examples."""
    pieces = [partition.client_indices(c) for c in range(partition.num_clients)]
    joined = np.sort(np.concatenate(pieces))
    assert np.array_equal(joined, np.flatnonzero(partition.assignment >= 0))
    assert all(np.all(np.diff(piece) > 0) for piece in pieces)
    assert partition.sizes().sum() + partition.left_out == partition.assignment.size


@pytest.mark.parametrize(("spec", "clients"), COVERING_SPECS, ids=lambda x: str(x))
def test_every_example_goes_to_exactly_one_client(rich_data, spec, clients):
    partition = build_partitioner(spec).partition(rich_data, clients, seed=0)
    assert partition.left_out == 0
    assert partition.assignment.dtype == np.int32
    assert_exact_cover(partition)
    assert np.all(partition.sizes() > 0)


def test_score_ranges_are_contiguous_and_ordered():
    scores = np.random.default_rng(0).uniform(0, 5, 1000)
    data = PartitionInput(n=1000, labels=scores)
    partition = build_partitioner({"kind": "score_ranges"}).partition(data, 3, 0)
    assert_exact_cover(partition)
    assert partition.left_out == 0 and list(partition.sizes()) == [334, 333, 333]
    parts = [scores[partition.client_indices(c)] for c in range(3)]
    assert parts[0].max() <= parts[1].min() and parts[1].max() <= parts[2].min()


@pytest.mark.parametrize("spec", RANDOM_SPECS, ids=lambda x: x["kind"])
def test_same_seed_same_assignment_other_seed_different(rich_data, spec):
    clients = len(spec.get("mixes", [])) or 4
    partitioner = build_partitioner(spec)
    first = partitioner.partition(rich_data, clients, seed=11).assignment
    assert np.array_equal(first, partitioner.partition(rich_data, clients, seed=11).assignment)
    assert not np.array_equal(first, partitioner.partition(rich_data, clients, seed=12).assignment)


def test_huge_alpha_gives_near_uniform_label_distributions():
    data = labelled(20_000)
    partition = build_partitioner({"kind": "label_dirichlet", "alpha": 1e4}).partition(data, 10, 0)
    deviation = np.abs(label_fractions(partition, data.labels) - LABEL_PRIOR)
    assert deviation.max() < 0.05


def test_tiny_alpha_gives_mostly_single_label_clients():
    data = labelled(20_000)
    partition = build_partitioner({"kind": "label_dirichlet", "alpha": 0.01}).partition(data, 40, 0)
    top_share = label_fractions(partition, data.labels).max(axis=1)
    assert np.mean(top_share > 0.95) > 0.6


def test_first_come_counts_stop_when_a_label_is_used_up():
    wanted = np.array([[3, 0], [2, 2], [1, 4]])
    taken = first_come_counts(wanted, np.array([4, 5]))
    assert taken.tolist() == [[3, 0], [1, 2], [0, 3]]


def test_dynamic_reassigning_keeps_every_client_at_its_size():
    # 1% of label 1 and a tiny alpha: about half of the clients want almost only label 1, which runs out.
    labels = np.zeros(5000, dtype=int)
    labels[:50] = 1
    data = PartitionInput(n=5000, labels=labels)
    partition = build_partitioner({"kind": "label_dirichlet", "alpha": 0.01}).partition(data, 20, 0)
    assert partition.left_out == 0
    assert np.all(partition.sizes() == 250)
    both = {"kind": "label_dirichlet", "alpha": 0.01, "beta": 2.0}
    with_sizes = build_partitioner(both).partition(data, 20, 0)
    drawn = build_partitioner({"kind": "quantity_dirichlet", "beta": 2.0}).partition(data, 20, 0)
    assert with_sizes.left_out == 0
    assert np.array_equal(with_sizes.sizes(), drawn.sizes())  # sizes are the first draw of the seed


@pytest.mark.parametrize(
    "mixes",
    [
        [[0.8, 0.2], [0.5, 0.5], [0.2, 0.8]],  # FedSplitBERT Table I, "Other"
        [[0.9 - 0.1 * i, 0.1 + 0.1 * i] for i in range(9)] + [[0.02, 0.98]],  # Table II, 10 clients
    ],
    ids=["3-clients", "10-clients"],
)
def test_explicit_label_mixes_are_met(mixes):
    labels = np.random.default_rng(0).choice(2, size=6000, p=[0.55, 0.45])
    data = PartitionInput(n=labels.size, labels=labels)
    partition = build_partitioner({"kind": "label_mix", "mixes": mixes}).partition(data, len(mixes), 0)
    assert_exact_cover(partition)
    sizes = partition.sizes()
    assert sizes.min() == sizes.max() > 0
    assert partition.left_out == labels.size - sizes.sum()
    for client, mix in enumerate(mixes):
        share = np.mean(labels[partition.client_indices(client)] == 0)
        assert abs(share - mix[0]) < 0.01


def test_natural_factor_gives_one_client_per_value_or_group(rich_data):
    values = np.asarray(rich_data.columns["group"])
    partition = build_partitioner({"kind": "natural", "column": "group"}).partition(rich_data, 6, 0)
    for client, value in enumerate(sorted(set(values))):
        assert set(values[partition.client_indices(client)]) == {value}
    grouped = build_partitioner({"kind": "natural", "column": "group", "groups": [["g0", "g1"], ["g2"]]})
    partition = grouped.partition(rich_data, 2, 0)
    assert set(values[partition.client_indices(0)]) == {"g0", "g1"}
    assert partition.left_out == np.isin(values, ["g3", "g4", "g5"]).sum()


def test_natural_factor_on_a_users_column_by_its_own_name_or_as_group():
    """Issue 37 item 1: data.columns.group: hospital loads the column as group; the partition names it either way."""
    hospitals = ["north", "south", "east"] * 4
    data = PartitionInput(n=12, columns={"group": hospitals}, aliases={"hospital": "group"})
    for column in ("hospital", "group"):
        partition = build_partitioner({"kind": "natural", "column": column}).partition(data, 3, 0)
        assert [hospitals[partition.client_indices(c)[0]] for c in range(3)] == ["east", "north", "south"]
    with pytest.raises(UserError, match=r"^partition.column 'ward' is not a column of the data \(its partition "
                                        r"columns: group, hospital\)"):
        build_partitioner({"kind": "natural", "column": "ward"}).partition(data, 3, 0)


def test_natural_test_split_keeps_the_training_splits_clients():
    """Issue 37 item 1: client j holds the same hospital in the test split as in training, though the test split
    lacks one hospital (that client has no test examples) and has one the training split lacks (left out)."""
    train = PartitionInput(n=6, columns={"group": ["a", "b", "c", "a", "b", "c"]})
    test = PartitionInput(n=4, columns={"group": ["c", "a", "d", "c"]})
    partitioner = build_partitioner({"kind": "natural", "column": "group"})
    partition = partitioner.for_test(train).partition(test, 3, 0)
    assert partition.assignment.tolist() == [2, 0, -1, 2]
    assert partitioner.for_test(train).for_test(test) == partitioner.for_test(train)  # its groups are kept


def test_report_records_each_clients_group(tmp_path: Path):
    """Issue 37 item 1: partition.csv names each client's group (by the data's own name for the column) and the
    summary counts them; a column of one value per row (an id) is no grouping and is left out."""
    hospitals = [f"h{i % 3}" for i in range(30)]
    data = PartitionInput(n=30, texts=["a b c"] * 30, aliases={"hospital": "group"},
                          columns={"group": hospitals, "id": [str(i) for i in range(30)]})
    partition = build_partitioner({"kind": "natural", "column": "hospital"}).partition(data, 3, 0)
    summary = write_partition_report(tmp_path, partition, data, None)
    rows = (tmp_path / "partition.csv").read_text().splitlines()
    assert rows[0] == "client,examples,mean_words,vocab_size,hospital"
    assert [row.rsplit(",", 1)[1] for row in rows[1:]] == ["h0", "h1", "h2"]
    assert summary["groups"] == {"hospital": {"values": 3, "per_client": {"mean": 1.0, "std": 0.0, "min": 1.0,
                                                                          "max": 1.0}}}
    iid = build_partitioner({"kind": "iid"}).partition(data, 2, 0)
    write_partition_report(tmp_path, iid, data, None)
    assert all(row.endswith(",h0; h1; h2") for row in (tmp_path / "partition.csv").read_text().splitlines()[1:])


def statistics(data: PartitionInput, kind: str, clients: int) -> dict[str, np.ndarray]:
    partition = build_partitioner({"kind": kind}).partition(data, clients, seed=0)
    assert partition.left_out == 0
    return client_statistics(partition, data)


def spreads(data: PartitionInput, kind: str, clients: int) -> dict[str, float]:
    return {name: float(values.std()) for name, values in statistics(data, kind, clients).items()}


def test_fdapt_skews_spread_their_statistic_and_keep_the_others(corpus):
    clients = 4
    iid = spreads(corpus, "iid", clients)
    means = {name: float(values.mean()) for name, values in statistics(corpus, "iid", clients).items()}

    def small(name: str, value: float) -> bool:
        return value <= max(2 * iid[name], 0.02 * means[name])

    length = spreads(corpus, "fdapt_length", clients)
    assert length["mean_words"] > 0.15 * means["mean_words"] > 10 * iid["mean_words"]
    assert length["examples"] <= 0.5 and small("vocab_size", length["vocab_size"])

    vocab = spreads(corpus, "fdapt_vocab", clients)
    assert vocab["vocab_size"] > 0.15 * means["vocab_size"] > 10 * iid["vocab_size"]
    assert vocab["examples"] <= 0.5 and small("mean_words", vocab["mean_words"])

    quantity = spreads(corpus, "fdapt_quantity", clients)
    assert quantity["examples"] > 0.4 * means["examples"]
    assert small("mean_words", quantity["mean_words"])


def test_fdapt_quantity_gives_client_i_share_i_over_sum(corpus):
    partition = build_partitioner({"kind": "fdapt_quantity"}).partition(corpus, 4, 0)
    expected = corpus.n * np.arange(1, 5) / 10
    assert np.all(np.abs(partition.sizes() - expected) <= 1)


def test_same_seed_gives_train_and_test_the_same_label_proportions():
    train, test = labelled(30_000, seed=1), labelled(6_000, seed=2)
    partitioner = build_partitioner({"kind": "label_dirichlet", "alpha": 0.5})
    train_q = label_fractions(partitioner.partition(train, 10, seed=5), train.labels)
    test_q = label_fractions(partitioner.partition(test, 10, seed=5), test.labels)
    same_client = js_divergence(train_q, test_q)
    other_client = js_divergence(train_q, np.roll(test_q, 1, axis=0))
    assert same_client.mean() < 0.05 < other_client.mean()


def test_quantity_dirichlet_sizes_match_across_splits():
    partitioner = build_partitioner({"kind": "quantity_dirichlet", "beta": 0.5})
    train = partitioner.partition(PartitionInput(n=50_000), 8, seed=3).sizes()
    test = partitioner.partition(PartitionInput(n=10_000), 8, seed=3).sizes()
    assert np.allclose(train / 50_000, test / 10_000, atol=2e-4)


@dataclass(frozen=True, kw_only=True)
class CountingIid(Partitioner):
    """IID that counts its calls, to see whether the cache was used."""

    name: ClassVar[str] = "counting_iid"
    calls: ClassVar[list[int]] = []

    def assign(self, data, num_clients, rng):
        self.calls.append(1)
        return build_partitioner({"kind": "iid"}).assign(data, num_clients, rng)


def test_cache_returns_the_stored_assignment(tmp_path):
    data = labelled(500)
    first = partition_cached(CountingIid(), data, 5, 1, tmp_path)
    again = partition_cached(CountingIid(), data, 5, 1, tmp_path)
    assert len(CountingIid.calls) == 1
    assert np.array_equal(first.assignment, again.assignment)
    partition_cached(CountingIid(), data, 5, 2, tmp_path)
    partition_cached(CountingIid(), labelled(500, seed=9), 5, 1, tmp_path)
    assert len(CountingIid.calls) == 3 and len(list(tmp_path.glob("*.npy"))) == 3


def test_cache_keys_differ_with_params_but_not_with_holdout():
    key = build_partitioner({"kind": "label_dirichlet", "alpha": 1.0}).cache_key()
    assert key != build_partitioner({"kind": "label_dirichlet", "alpha": 2.0}).cache_key()
    assert key != build_partitioner({"kind": "label_dirichlet", "alpha": 1.0, "beta": 1.0}).cache_key()
    assert key == build_partitioner({"kind": "label_dirichlet", "alpha": 1.0, "holdout": 0.2}).cache_key()


def test_typed_config_and_mapping_build_the_same_partitioner():
    typed = build_partitioner(LabelDirichletConfig(alpha=0.5, beta=2.0, holdout=0.2, num_clients=3))
    mapped = build_partitioner({"kind": "label_dirichlet", "alpha": 0.5, "beta": 2.0, "holdout": 0.2})
    assert typed == mapped and typed.holdout == 0.2


def test_content_fingerprint_tells_datasets_apart():
    a = PartitionInput(n=3, labels=np.array([0, 1, 0]))
    b = PartitionInput(n=3, labels=np.array([0, 1, 1]))
    assert a.cache_fingerprint() != b.cache_fingerprint()
    assert a.cache_fingerprint() == PartitionInput(n=3, labels=np.array([0, 1, 0])).cache_fingerprint()


def test_holdout_split_is_disjoint_and_covers_each_client():
    partitioner = build_partitioner({"kind": "quantity_dirichlet", "beta": 1.0, "holdout": 0.2})
    partition = partitioner.partition(labelled(2000), 7, 0)
    train, test = holdout_split(partition, partitioner.holdout, seed=4)
    for client in range(7):
        mine, fit, held = (p.client_indices(client) for p in (partition, train, test))
        assert np.intersect1d(fit, held).size == 0
        assert np.array_equal(np.union1d(fit, held), mine)
        assert abs(held.size - 0.2 * mine.size) <= 0.5 and fit.size >= 1
    again = holdout_split(partition, 0.2, seed=4)[1]
    assert np.array_equal(again.assignment, test.assignment)


def test_report_writes_table_summary_and_plots(tmp_path: Path, rich_data):
    partition = build_partitioner({"kind": "label_dirichlet", "alpha": 1.0}).partition(rich_data, 5, 0)
    summary = write_partition_report(tmp_path, partition, rich_data, ["a", "b", "c", "d"])
    pngs = {"label_distribution.png", "js_divergence.png", "client_sizes.png"}
    assert {"partition.csv", "partition_summary.json", *pngs} <= {p.name for p in tmp_path.iterdir()}
    assert json.loads((tmp_path / "partition_summary.json").read_text()) == summary
    assert summary["left_out"] == 0
    assert {"examples", "mean_words", "vocab_size", "js_to_overall"} <= set(summary["statistics"])
    rows = (tmp_path / "partition.csv").read_text().splitlines()
    assert len(rows) == 6 and rows[0].startswith("client,examples,mean_words,vocab_size,label_a")


def test_report_on_scores_without_texts(tmp_path: Path):
    scores = np.linspace(0, 5, 300)
    data = PartitionInput(n=300, labels=scores)
    partition = build_partitioner({"kind": "score_ranges"}).partition(data, 3, 0)
    summary = write_partition_report(tmp_path, partition, data, None)
    assert summary["statistics"]["examples"]["std"] == 0
    assert (tmp_path / "label_distribution.png").exists()


@pytest.mark.parametrize(
    ("spec", "key"),
    [
        ({"kind": "label_dirichlet", "alpha": 0}, "alpha"),
        ({"kind": "label_dirichlet", "alpha": -1.0}, "alpha"),
        ({"kind": "label_dirichlet"}, "alpha"),
        ({"kind": "quantity_dirichlet", "beta": 0.0}, "beta"),
        ({"kind": "dirichlet"}, "kind"),
        ({"kind": "iid", "alpha": 1.0}, "alpha"),
        ({"kind": "label_mix", "mixes": [[0.5, 0.6], [0.5, 0.5]]}, "mixes[0]"),
        ({"kind": "label_mix", "mixes": [[0.5, 0.5], [1.0]]}, "mixes[1]"),
        ({"kind": "clustered", "clusters": 1, "alpha": 1.0}, "clusters"),
        ({"kind": "iid", "holdout": 1.0}, "holdout"),
    ],
)
def test_bad_specs_raise_one_line_user_errors(spec, key):
    with pytest.raises(UserError, match=key.replace("[", r"\[")) as error:
        build_partitioner(spec)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("spec", "clients", "key"),
    [
        ({"kind": "iid"}, 1201, "num_clients"),
        ({"kind": "label_mix", "mixes": [[0.5, 0.5, 0, 0]] * 3}, 2, "mixes"),
        ({"kind": "label_mix", "mixes": [[0.5, 0.5], [0.5, 0.5]]}, 2, "mixes"),
        ({"kind": "natural", "column": "user"}, 2, "column"),
        ({"kind": "natural", "column": "group"}, 2, "num_clients"),
    ],
)
def test_bad_partition_requests_raise_one_line_user_errors(rich_data, spec, clients, key):
    with pytest.raises(UserError, match=key) as error:
        build_partitioner(spec).partition(rich_data, clients, 0)
    assert "\n" not in str(error.value)


SENTENCES = {
    "football": [
        "The striker scored twice in the second half.",
        "The goalkeeper saved a penalty in extra time.",
        "Fans cheered as the team won the league title.",
        "The coach changed the defence at half time.",
        "A late header gave the visitors a draw.",
        "The midfielder was booked for a rough tackle.",
        "The club signed a new winger before the transfer deadline.",
        "The referee awarded a free kick outside the box.",
    ],
    "cooking": [
        "Simmer the tomato sauce with garlic for twenty minutes.",
        "Knead the bread dough until it is smooth and elastic.",
        "Whisk the eggs with sugar before folding in the flour.",
        "Roast the vegetables in olive oil until golden.",
        "Season the soup with salt, pepper and fresh thyme.",
        "Let the cake cool before adding the chocolate icing.",
        "Fry the onions slowly until they caramelise.",
        "Marinate the chicken overnight in yoghurt and spices.",
    ],
    "computers": [
        "The laptop needs more memory to run the compiler.",
        "Restart the router if the wifi connection drops.",
        "The new graphics card doubled the frame rate.",
        "Install the security update before rebooting the server.",
        "The hard drive failed and the backup saved the files.",
        "The program crashed with a segmentation fault.",
        "Upgrade the operating system to get the latest drivers.",
        "The keyboard shortcut opens a terminal window.",
    ],
}


def test_clustered_partition_uses_minilm_topics():
    texts = [text for group in SENTENCES.values() for text in group]
    topics = np.repeat(np.arange(3), 8)
    data = PartitionInput(n=len(texts), texts=texts)
    partitioner = build_partitioner({"kind": "clustered", "clusters": 3, "alpha": 0.01})
    partition = partitioner.partition(data, 3, seed=0)
    assert partition.left_out == 0 and np.all(partition.sizes() == 8)
    from fedlm.data.partition import cluster_ids

    clusters = cluster_ids(texts, 3)
    purity = sum(np.bincount(topics[clusters == c]).max() for c in range(3) if np.any(clusters == c))
    assert purity >= 22  # the encoder separates the three topics (random vectors would not)
