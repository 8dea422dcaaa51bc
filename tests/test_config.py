"""Config validation: one line naming the key, the value and what is allowed; exit status 2 from the CLI."""

import subprocess
import sys

import pytest

from fedlm.config import expand_grid, load_config, validate
from fedlm.errors import UserError


@pytest.fixture
def cfg_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: t\ndata:\n  source: glue/sst2\nprotocol:\n  kind: fedavg\n  rounds: 2\n")
    return path


def test_overrides_are_typed(cfg_file):
    cfg = load_config(cfg_file, ["protocol.rounds=5", "train.lr=0.01", "partition.alpha=0.5"])
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
    cfg = load_config(cfg_file, ["grid={protocol.kind: [fedavg, fedprox], partition.alpha: [1, 5, 10]}"])
    runs = expand_grid(cfg)
    assert len(runs) == 6
    assert {(c.protocol.kind, c.partition.spec()["alpha"]) for _, c in runs} == {
        (k, a) for k in ("fedavg", "fedprox") for a in (1, 5, 10)}
    assert all(not c.grid for _, c in runs)


def test_baselines_run_beside_the_grid(cfg_file):
    cfg = load_config(cfg_file, ["grid={protocol.kind: [fedavg, fedopt]}",
                                 "baselines=[{protocol.kind: centralized}]"])
    labels = [label for label, _ in expand_grid(cfg)]
    assert labels == ["protocol=fedavg", "protocol=fedopt", "protocol=centralized"]


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
