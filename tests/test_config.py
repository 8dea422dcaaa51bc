"""Config validation: one line naming the key, the value and what is allowed; exit status 2 from the CLI."""

import subprocess
import sys

import pytest
import yaml

from fedlm.config import dump_config, expand_grid, load_config, validate
from fedlm.errors import UserError


@pytest.fixture
def cfg_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: t\ndata:\n  source: glue/sst2\nprotocol:\n  kind: fedavg\n  rounds: 2\n")
    return path


def test_overrides_are_typed(cfg_file):
    cfg = load_config(cfg_file, ["protocol.rounds=5", "train.lr=0.01", "partition.kind=label_dirichlet",
                               "partition.alpha=0.5"])
    assert cfg.protocol.rounds == 5 and cfg.train.lr == 0.01
    assert cfg.partition.spec()["alpha"] == 0.5


@pytest.mark.parametrize(("override", "expected"), [
    ("protocol.roundz=3", "unknown key 'protocol.roundz'"),
    ("protocol.rounds=-1", "protocol.rounds = -1"),
    ("train.lr=fast", "train.lr = 'fast'"),
    ("protocol.kind=fedmagic", "protocol.kind = 'fedmagic'"),
    ("norounds", "not key=value"),
])
def test_bad_values_name_the_key(cfg_file, override, expected):
    with pytest.raises(UserError) as err:
        load_config(cfg_file, [override])
    message = str(err.value)
    assert expected in message and "\n" not in message


def test_cli_exits_2_with_one_line_and_no_traceback(cfg_file):
    proc = subprocess.run([sys.executable, "-m", "fedlm.cli", "run", str(cfg_file), "protocol.mu=-1"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "protocol.mu" in lines[0] and "Traceback" not in proc.stderr


def test_missing_config_file_is_one_line(tmp_path):
    with pytest.raises(UserError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_grid_expands_every_combination(cfg_file):
    cfg = load_config(cfg_file, ["partition.kind=label_dirichlet", "partition.alpha=1",
                             "grid={protocol.kind: [fedavg, fedprox], partition.alpha: [1, 5, 10]}"])
    runs = expand_grid(cfg)
    assert len(runs) == 6
    assert {(c.protocol.kind, c.partition.spec()["alpha"]) for _, c in runs} == {
        (k, a) for k in ("fedavg", "fedprox") for a in (1, 5, 10)}
    assert all(not c.grid for _, c in runs)


def test_a_grid_axis_over_checkpoints_loads_them_under_the_default_preset(cfg_file):
    cfg = load_config(cfg_file, ["grid={model.checkpoint: [minilm, null]}"])
    (_, loaded), (_, fresh) = expand_grid(cfg)
    assert (loaded.model.checkpoint, loaded.model.preset) == ("minilm", None)  # the checkpoint's own weights
    assert (fresh.model.checkpoint, fresh.model.preset) == (None, "tiny")
    written = load_config(cfg_file, ["model.preset=tiny", "grid={model.checkpoint: [minilm]}"])
    assert expand_grid(written)[0][1].model.preset == "tiny"  # written out: a fresh tiny model, minilm's tokenizer


def test_baselines_run_beside_the_grid(cfg_file):
    cfg = load_config(cfg_file, ["grid={protocol.kind: [fedavg, fedopt]}",
                                 "baselines=[{protocol.kind: centralized}]"])
    labels = [label for label, _ in expand_grid(cfg)]
    assert labels == ["protocol=fedavg", "protocol=fedopt", "protocol=centralized"]


def test_baselines_without_a_grid_run_beside_the_config_itself(cfg_file):
    cfg = load_config(cfg_file, ["protocol.kind=fedavg", "protocol.rounds=4",
                                 "baselines=[{label: centralized, protocol.kind: centralized, protocol.rounds: 2}]"])
    runs = expand_grid(cfg)
    assert [label for label, _ in runs] == ["fedavg", "centralized"]
    assert [(c.protocol.kind, c.protocol.rounds) for _, c in runs] == [("fedavg", 4), ("centralized", 2)]


def test_named_grid_axis_applies_its_overrides_together_and_tags_the_run():
    cfg = validate({"data": {"source": "x"}, "grid": {
        "dataset": [{"label": "sst2", "data.source": "glue/sst2", "eval.target": 0.8},
                    {"label": "mrpc", "data.source": "glue/mrpc", "eval.target": 0.7}],
        "protocol.kind": ["fedavg", "fedprox"]}})
    runs = expand_grid(cfg)
    assert [label for label, _ in runs] == ["dataset=sst2,protocol=fedavg", "dataset=sst2,protocol=fedprox",
                                            "dataset=mrpc,protocol=fedavg", "dataset=mrpc,protocol=fedprox"]
    mrpc = runs[2][1]
    assert (mrpc.data.source, mrpc.eval.target, mrpc.tags) == ("glue/mrpc", 0.7, {"dataset": "mrpc"})
    with pytest.raises(UserError, match=r"grid\.dataset is a named axis"):
        expand_grid(validate({"data": {"source": "x"}, "grid": {"dataset": ["glue/sst2"]}}))


@pytest.mark.parametrize(("partition", "expected"), [
    ({"kind": "label_dirichlet", "alpha": 0}, "partition.alpha = 0: Input should be greater than 0"),
    ({"kind": "label_dirichlet", "alpha": True}, "partition.alpha = True: Input should be a valid number"),
    ({"kind": "label_dirichlet"}, "missing required key 'partition.alpha' for kind label_dirichlet"),
    ({"kind": "iid", "alpha": 1.0},
     "unknown key 'partition.alpha' for kind iid (allowed here: holdout, kind, num_clients)"),
    ({"kind": "dirichlet"}, "partition.kind = 'dirichlet': unknown kind; choose one of 'iid', "),
    ({"kind": "label_mix", "mixes": [[0.5, 0.6], [0.5, 0.5]]}, "partition.mixes[0] = [0.5, 0.6]: "
     "a client's label shares must sum to 1, these sum to 1.1"),
    ({"kind": "label_mix", "mixes": [[0.5, 0.5], [1.0]]}, "mixes[1] has 1 shares but mixes[0] has 2"),
    ({"kind": "label_mix", "mixes": [[1.5, -0.5]]}, "partition.mixes[0][1] = -0.5"),
    ({"kind": "clustered", "clusters": 1, "alpha": 1.0}, "partition.clusters = 1"),
    ({"kind": "natural", "column": "g", "groups": [[1, 2], ["1"]]}, "value '1' is in more than one group"),
    ({"kind": "quantity_dirichlet", "beta": 0.5, "holdout": 1.0}, "partition.holdout = 1.0"),
    ({"kind": "label_dirichlet", "alpha": float("inf")}, "partition.alpha = inf: Input should be a finite number"),
])
def test_partition_kinds_are_typed_and_errors_name_the_key(partition, expected):
    with pytest.raises(UserError) as err:
        validate({"data": {"source": "x"}, "partition": partition})
    message = str(err.value)
    assert message.startswith("config error: ") and expected in message and "\n" not in message


def test_partition_without_kind_is_iid_and_dumps_only_what_was_chosen():
    assert validate({"data": {"source": "x"}, "partition": {"num_clients": 4}}).partition.kind == "iid"
    cfg = validate({"data": {"source": "x"},
                    "partition": {"kind": "label_dirichlet", "alpha": 0.5, "beta": None, "num_clients": 4}})
    assert cfg.model_dump()["partition"] == {"kind": "label_dirichlet", "num_clients": 4, "alpha": 0.5}
    assert cfg.partition.spec() == {"kind": "label_dirichlet", "alpha": 0.5}
    assert validate(yaml.safe_load(dump_config(cfg))) == cfg


def test_a_named_axis_may_replace_the_partition_section(cfg_file):
    cfg = load_config(cfg_file, ["grid={partition: [{kind: iid, num_clients: 3}, "
                                 "{kind: label_mix, mixes: [[0.5, 0.5], [1, 0]], num_clients: 2}]}"])
    (iid_label, iid), (mix_label, mix) = expand_grid(cfg)
    assert (iid_label, mix_label) == ("partition=iid", "partition=label_mix(mixes=[[0.5, 0.5], [1, 0]])")
    assert iid.partition.num_clients == 3 and mix.partition.mixes == [[0.5, 0.5], [1.0, 0.0]]


@pytest.mark.parametrize(("raw", "line"), [
    ({"protocol": {"clients_per_round": 12}, "partition": {"num_clients": 10}},
     "config error: protocol.clients_per_round = 12 but partition.num_clients = 10: a round cannot sample more "
     "clients than there are"),
    ({"name": ".."}, "config error: name = '..' would write outside output_dir; give the run a name"),
])
def test_rules_across_sections_are_one_line_without_the_whole_config(raw, line):
    with pytest.raises(UserError) as err:
        validate({"data": {"source": "x.csv"}, **raw})
    assert str(err.value) == line


def test_centralized_and_isolated_ignore_clients_per_round():
    for kind in ("centralized", "isolated"):  # 5 of 2 clients would be refused under fedavg (test above)
        config = validate({"data": {"source": "x.csv"}, "partition": {"num_clients": 2},
                           "protocol": {"kind": kind, "clients_per_round": 5}})
        assert config.protocol.kind == kind
