"""Peers side by side (issue 33, item 5): the same FedAvg job in fedlm, Flower 1.42's simulation engine and pfl.

Every arm trains the same job: fedlm's tiny BERT (``model.preset: tiny``: 2 blocks, width 64) with the WordPiece
tokenizer fedlm trains on the job's sentences, the same seeded initial weights, the same SST-2 sentences split
the same way among the clients (fedlm's iid partition), every client in every round, one local epoch of AdamW
(lr 5e-4, no weight decay) in batches of 16 with the gradient norm clipped to 1, FedAvg, the GLUE validation
set (872 sentences) scored before round 1 and after the last round. The peers run fedlm's client step itself
(``_peer_common.py``: the same batch order and dropout seeds), so every arm ends with fedlm's train loss (the
check that the jobs are equal) and the seconds compare frameworks, not jobs. The arms:

* ``fedlm-1``: ``fedlm run`` (the project's CLI, ``.venv/bin/fedlm``), 1 process x 1 thread;
* ``fedlm-2``: ``fedlm run --workers 2``, 2 processes x 1 thread (skipped, with a note, while ``fedlm run --help``
  does not list ``--workers``);
* ``flower``: Flower 1.42 simulation, Ray backend, Ray given 2 CPUs and each ClientApp 1 (2 actors x 1 thread,
  plus the driver that runs the ServerApp) (``_peer_flower.py``);
* ``pfl-1`` / ``pfl-2``: Apple's pfl 0.6, PyTorch backend, 1 process, and 2 processes under ``torchrun``
  (pfl's own multi-worker mode) (``_peer_pfl.py``).

Each arm is one fresh subprocess with ``OMP_NUM_THREADS=1``. Two times are printed: *job s*, the subprocess's
wall time from start to exit (interpreter start, imports, data loading, tokenizing, fedlm's tokenizer training and
its run directory's plots / model / summary, Ray's start and stop, torchrun's rendezvous), and *rounds s*, from
the end of the round-0 evaluation to the end of the last round's evaluation, as each framework's own clock sees
it (fedlm: the rounds' ``wall_s`` in ``metrics.jsonl``). Ratios are peer / fedlm (above 1: fedlm is faster).

The peers live in their own virtual environments under ``--venvs`` (default ``../peer-venvs`` beside the
repository), made on first use with the interpreter fedlm's venv was made from, and installed through a constraint
file that pins torch to the repository's ``constraints.txt`` and transformers / tokenizers to the versions in
fedlm's venv (so every arm runs the same model code and no pip run can pull another torch):

    pip install -c CONSTRAINTS torch==2.13.0 'flwr[simulation]==1.42.*' transformers tokenizers
    pip install -c CONSTRAINTS torch==2.13.0 'pfl[pytorch]==0.6.*' transformers tokenizers

    .venv/bin/python benchmarks/bench_peers.py                 # 10x200, 100x20, 1000x2, 3 rounds, every arm
    .venv/bin/python benchmarks/bench_peers.py --quick         # smoke run: 4x16 and 16x2, 1 round (~7 min here)
    .venv/bin/python benchmarks/bench_peers.py --repeats 3     # each arm 3 times, taking turns; medians shown
    .venv/bin/python benchmarks/bench_peers.py --sizes 100x20 --rounds 5 --arms fedlm-1,pfl-1 --timeout 900
    .venv/bin/python benchmarks/bench_peers.py --setup-only    # make / check the peer venvs and stop
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
FEDLM = Path(sys.executable).parent / "fedlm"
RESULT_PREFIX = "PEER_RESULT "  # what _peer_common.report prints
ARMS = ("fedlm-1", "fedlm-2", "flower", "pfl-1", "pfl-2")
# The peers' own requirements; torch, transformers and tokenizers are added with the pins (see constraints()).
PEERS: dict[str, list[str]] = {"flower": ["flwr[simulation]==1.42.*"], "pfl": ["pfl[pytorch]==0.6.*"]}


@dataclass(frozen=True)
class Size:
    """Clients x examples per client."""

    clients: int
    examples: int

    @property
    def label(self) -> str:
        return f"{self.clients}x{self.examples}"

    @property
    def total(self) -> int:
        return self.clients * self.examples


@dataclass
class Outcome:
    """What one arm printed and how long it ran."""

    arm: str
    size: str
    status: str  # ok, timeout, failed, skipped
    job_s: float | None = None
    rounds_s: float | None = None
    round_s: list[float] = field(default_factory=list)  # each round's seconds
    start_accuracy: float | None = None
    final_accuracy: float | None = None
    train_loss: float | None = None
    load: float | None = None  # 1-minute load average when the arm started
    note: str = ""
    extra: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------ peer environments


def constraints(venvs: Path) -> Path:
    """The constraint file every peer install goes through: the repository's torch pin (a CPU wheel on this
    machine; any other torch would pull CUDA wheels) and fedlm's own transformers / tokenizers versions."""
    pins = [line.strip() for line in (ROOT / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    pins += [f"{name}=={importlib.metadata.version(name)}" for name in ("transformers", "tokenizers")]
    path = venvs / "constraints.txt"
    venvs.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(pins) + "\n")
    return path


def torch_pin(constraint_file: Path) -> str:
    return next(line for line in constraint_file.read_text().splitlines() if line.startswith("torch=="))


def ensure_venv(name: str, venvs: Path, constraint_file: Path) -> Path:
    """The peer's venv python, made and installed when missing or when its requirements changed (a stamp file
    records what was installed), so repeated runs skip the minutes pip takes."""
    venv = venvs / name
    python = venv / "bin" / "python"
    wanted = [torch_pin(constraint_file), *PEERS[name], "transformers", "tokenizers"]
    stamp = venv / ".bench-peers-installed"
    record = json.dumps({"requirements": wanted, "constraints": constraint_file.read_text()})
    if python.exists() and stamp.exists() and stamp.read_text() == record:
        return python
    base = getattr(sys, "_base_executable", sys.executable)
    print(f"[setup] {name}: making {venv} and installing {' '.join(wanted)} (-c {constraint_file})", flush=True)
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "-c", str(constraint_file), *wanted], check=True)
    stamp.write_text(record)
    return python


# --------------------------------------------------------------------------------------------------- the job


def read_sst2(data_dir: Path, split: str) -> list[tuple[str, int]]:
    """(sentence, label) rows of GLUE SST-2's ``train.tsv`` or ``dev.tsv`` (header line first)."""
    lines = (data_dir / "glue" / "SST-2" / f"{split}.tsv").read_text(encoding="utf-8").splitlines()[1:]
    return [(text, int(label)) for text, label in (line.rsplit("\t", 1) for line in lines if line)]


def write_jsonl(path: Path, rows: list[tuple[str, int]]) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for text, label in rows:
            handle.write(json.dumps({"text": text, "label": label}) + "\n")


def fedlm_artifacts(folder: Path, texts: list[str], seed: int) -> tuple[Path, Path]:
    """The tokenizer and initial model fedlm builds for this job (its WordPiece recipe trained on the training
    sentences, the tiny preset seeded with the run's seed), saved for the peers, which load them with
    transformers alone. ``fedlm run`` rebuilds the same ones from the same inputs."""
    from fedlm.models.build import build_model, build_tokenizer

    tokenizer = build_tokenizer(None, "bert", texts, 8000)
    model = build_model("bert", "tiny", "classification", tokenizer, num_labels=2, seed=seed)
    tokenizer.save_pretrained(folder / "tokenizer")
    model.save_pretrained(folder / "init-model")
    return folder / "tokenizer", folder / "init-model"


def fedlm_clients(size: Size, seed: int) -> list[list[int]]:
    """Each client's example indices as fedlm's iid partition deals them (same partitioner, same seed)."""
    from fedlm.data.partition import PartitionInput, build_partitioner

    part = build_partitioner({"kind": "iid"}).partition(PartitionInput(n=size.total), size.clients, seed)
    return [part.client_indices(c).tolist() for c in range(size.clients)]


def prepare_job(folder: Path, size: Size, args: argparse.Namespace, pool: list[tuple[str, int]],
                test: list[tuple[str, int]]) -> Path:
    """Write one size's data (fedlm's local train/test JSONL), tokenizer, initial model and ``job.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "data"
    data.mkdir(exist_ok=True)
    train = pool[:size.total]
    write_jsonl(data / "train.jsonl", train)
    write_jsonl(data / "test.jsonl", test)
    tokenizer, init_model = fedlm_artifacts(folder, [text for text, _ in train], args.seed)
    job = {"seed": args.seed, "rounds": args.rounds, "batch_size": args.batch_size, "lr": args.lr,
           "local_epochs": args.local_epochs, "max_grad_norm": 1.0, "max_length": 128, "eval_batch_size": 64,
           "tokenizer": str(tokenizer), "init_model": str(init_model), "train": str(data / "train.jsonl"),
           "test": str(data / "test.jsonl"), "clients": fedlm_clients(size, args.seed)}
    path = folder / "job.json"
    path.write_text(json.dumps(job))
    return path


def fedlm_config(folder: Path, size: Size, args: argparse.Namespace, name: str) -> Path:
    """The same job as a fedlm config: evaluated at round 0 and after the last round (``eval.every`` = rounds),
    checkpointed once at the end, as the peers neither score nor save in between."""
    text = f"""name: {name}
seed: {args.seed}
output_dir: {folder / "runs" / name}
checkpoint_every: {args.rounds}
data: {{source: {folder / "data"}}}
partition: {{kind: iid, num_clients: {size.clients}}}
model: {{family: bert, preset: tiny, max_length: 128, vocab_size: 8000}}
train: {{optimizer: adamw, lr: {args.lr}, weight_decay: 0.0, batch_size: {args.batch_size},
        local_epochs: {args.local_epochs}, max_grad_norm: 1.0}}
protocol: {{kind: fedavg, rounds: {args.rounds}, clients_per_round: {size.clients}}}
eval: {{every: {args.rounds}, local: false, batch_size: 64}}
"""
    path = folder / f"{name}.yaml"
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------------------ the arms


def child_env() -> dict[str, str]:
    """One thread per process for every arm; no network (hub, telemetry, usage stats); the helpers importable."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "FLWR_TELEMETRY_ENABLED": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    return env


def run_child(command: list[str], log: Path, timeout: float) -> tuple[int | None, float]:
    """Run one arm in its own session (so a timeout ends Ray's and torchrun's children too); (exit code or None
    on timeout, wall seconds). Output goes to ``log``."""
    started = time.perf_counter()
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT,
                                start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        wall = time.perf_counter() - started
        _end_group(proc)
    return code, wall


def _end_group(proc: subprocess.Popen) -> None:
    """Stop what the arm left in its process group (Ray's raylet and workers, torchrun's ranks)."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:
            time.sleep(0.5)  # the group's other members may still be exiting


def tail(log: Path, lines: int = 3) -> str:
    text = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    return " | ".join(line.strip()[:200] for line in text[-lines:])


def peer_result(log: Path) -> dict | None:
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    return None


def fedlm_result(run_dir: Path) -> dict | None:
    """Rounds time, scores and last train loss from the run's ``metrics.jsonl``."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rounds = [r for r in records if r["round"] >= 1]
    scored = [r for r in records if r.get("test_accuracy") is not None]
    if not rounds or not scored:
        return None
    return {"rounds_s": sum(r["wall_s"] for r in rounds), "round_s": [r["wall_s"] for r in rounds],
            "start_accuracy": scored[0]["test_accuracy"],
            "final_accuracy": scored[-1]["test_accuracy"], "train_loss": rounds[-1]["train_loss"]}


def fedlm_has_workers() -> bool:
    help_text = subprocess.run([str(FEDLM), "run", "--help"], capture_output=True, text=True, env=child_env()).stdout
    return "--workers" in help_text


def arm_command(arm: str, folder: Path, job: Path, size: Size, args: argparse.Namespace,
                pythons: dict[str, Path]) -> tuple[list[str], Path | None]:
    """The arm's command line, and the fedlm run directory it writes (None for the peers)."""
    if arm.startswith("fedlm"):
        workers = int(arm.split("-")[1])
        config = fedlm_config(folder, size, args, arm)
        extra = ["--workers", str(workers)] if workers > 1 else []
        return [str(FEDLM), "run", str(config), "--overwrite", *extra], folder / "runs" / arm / arm
    if arm == "flower":
        return [str(pythons["flower"]), str(HERE / "_peer_flower.py"), str(job), "--cpus", str(args.flower_cpus)], None
    workers = int(arm.split("-")[1])
    if workers == 1:
        return [str(pythons["pfl"]), str(HERE / "_peer_pfl.py"), str(job)], None
    torchrun = pythons["pfl"].parent / "torchrun"
    return [str(torchrun), "--standalone", f"--nproc-per-node={workers}", str(HERE / "_peer_pfl.py"), str(job)], None


def run_arm(arm: str, folder: Path, job: Path, size: Size, args: argparse.Namespace,
            pythons: dict[str, Path], repeat: int) -> Outcome:
    command, run_dir = arm_command(arm, folder, job, size, args, pythons)
    log = folder / f"{arm}-{repeat}.log"
    load = os.getloadavg()[0]
    code, wall = run_child(command, log, args.timeout)
    if code is None:
        return Outcome(arm, size.label, "timeout", job_s=wall, load=load, note=f"timed out after {args.timeout:.0f} s")
    found = fedlm_result(run_dir) if run_dir is not None else peer_result(log)
    if code != 0 or found is None:
        return Outcome(arm, size.label, "failed", job_s=wall, load=load, note=f"exit {code}: {tail(log)}")
    keys = ("rounds_s", "round_s", "start_accuracy", "final_accuracy", "train_loss")
    return Outcome(arm, size.label, "ok", job_s=wall, load=load, **{k: found.get(k) for k in keys},
                   extra={k: v for k, v in found.items() if k not in keys and v is not None})


def combine(runs: list[Outcome]) -> Outcome:
    """One arm's repeats as one row: the run with the median rounds time (the lower median for an even count), the
    median job time, and every run's times in the note, since on a shared machine one run says little."""
    ok = [o for o in runs if o.status == "ok"]
    if not ok:
        return runs[-1]
    ok.sort(key=lambda o: o.rounds_s or 0.0)
    chosen = ok[(len(ok) - 1) // 2]
    if len(runs) == 1:
        return chosen
    jobs = sorted(o.job_s or 0.0 for o in ok)
    spread = f"{len(ok)} of {len(runs)} ran; job s {', '.join(f'{o.job_s:.1f}' for o in runs if o.job_s)}; rounds s " \
             f"{', '.join(_num(o.rounds_s) for o in runs)}"
    return Outcome(**{**asdict(chosen), "job_s": jobs[(len(jobs) - 1) // 2], "note": spread})


# ------------------------------------------------------------------------------------------------- the table


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(peer: float | None, base: float | None) -> str:
    return "-" if peer is None or not base else f"{peer / base:.2f}"


PROCESSES = {"fedlm-1": "1 x 1", "fedlm-2": "2 x 1", "flower": "driver + {cpus} actors x 1", "pfl-1": "1 x 1",
             "pfl-2": "2 x 1 (torchrun)"}


HEAD = ("| arm | processes x threads | job s | rounds s | round 1 s | later rounds s each | job / fedlm-1 | "
        "rounds / fedlm-1 | job / fedlm-2 | rounds / fedlm-2 | accuracy start -> final | last train loss | load "
        "| note |")


def _row(o: Outcome, one: Outcome | None, two: Outcome | None, args: argparse.Namespace) -> str:
    ok = o.status == "ok"
    later = o.round_s[1:] if ok else []
    cells = [o.arm, PROCESSES[o.arm].format(cpus=args.flower_cpus), _num(o.job_s), _num(o.rounds_s if ok else None),
             _num(o.round_s[0] if ok and o.round_s else None), _num(sum(later) / len(later) if later else None)]
    for base in (one, two):
        cells += [_ratio(o.job_s if ok else None, base.job_s if base else None),
                  _ratio(o.rounds_s if ok else None, base.rounds_s if base else None)]
    cells += [f"{o.start_accuracy:.4f} -> {o.final_accuracy:.4f}" if ok else "-",
              _num(o.train_loss if ok else None, 4), _num(o.load, 2), o.note or ("" if ok else o.status)]
    return "| " + " | ".join(cells) + " |"


def table(outcomes: list[Outcome], args: argparse.Namespace) -> str:
    """One size's results as a Markdown table; ratios against fedlm-1 and, when it ran, fedlm-2."""
    base = {o.arm: o for o in outcomes if o.arm.startswith("fedlm") and o.status == "ok"}
    rows = [_row(o, base.get("fedlm-1"), base.get("fedlm-2"), args) for o in outcomes]
    return "\n".join([HEAD, "|" + "---|" * (HEAD.count("|") - 1), *rows])


# ------------------------------------------------------------------------------------------------------ main


def parse_sizes(text: str) -> list[Size]:
    sizes = []
    for part in text.split(","):
        clients, examples = part.lower().split("x")
        sizes.append(Size(int(clients), int(examples)))
    return sizes


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10x200,100x20,1000x2", help="clients x examples each, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke run: sizes 4x16,16x2 and 1 round")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"which of {', '.join(ARMS)}")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per arm before it is stopped")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every arm, taking turns; the table shows "
                        "the median")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--flower-cpus", type=int, default=2, help="CPUs Ray may use, one per ClientApp actor")
    parser.add_argument("--venvs", type=Path, default=ROOT.parent / "peer-venvs", help="where the peer venvs live")
    parser.add_argument("--work", type=Path, default=None, help="job files, logs and fedlm run directories "
                        "(default: WORK under --venvs; replaced on each run)")
    parser.add_argument("--data-dir", type=Path, default=Path(os.environ.get("FEDLM_DATA_DIR", ROOT.parent / "shared"
                                                                             / "data")))
    parser.add_argument("--setup-only", action="store_true", help="make / check the peer venvs, then stop")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.rounds = "4x16,16x2", 1
    args.arms = list(dict.fromkeys(a.strip() for a in args.arms.split(",") if a.strip()))
    if unknown := [a for a in args.arms if a not in ARMS]:
        parser.error(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    args.work = args.work or args.venvs / "work"
    return args


def setup(args: argparse.Namespace) -> dict[str, Path]:
    constraint_file = constraints(args.venvs)
    wanted = {"flower" if a == "flower" else "pfl" for a in args.arms if not a.startswith("fedlm")}
    return {name: ensure_venv(name, args.venvs, constraint_file) for name in sorted(wanted)}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    pythons = setup(args)
    if args.setup_only:
        print("peer venvs ready: " + ", ".join(f"{k} {v}" for k, v in pythons.items()))
        return 0
    arms = list(args.arms)
    notes: list[str] = []
    if "fedlm-2" in arms and not fedlm_has_workers():
        arms.remove("fedlm-2")
        notes.append("fedlm-2 skipped: `fedlm run --help` does not list --workers yet")
        print(f"[note] {notes[-1]}", flush=True)
    sizes = parse_sizes(args.sizes)
    shutil.rmtree(args.work, ignore_errors=True)
    pool = read_sst2(args.data_dir, "train")
    pool = random.Random(args.seed).sample(pool, max(size.total for size in sizes))  # one sample, every size
    test = read_sst2(args.data_dir, "dev")
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "notes": notes, "sizes": {}}
    for size in sizes:
        folder = args.work / size.label
        job = prepare_job(folder, size, args, pool, test)
        print(f"\n## {size.clients} clients x {size.examples} examples, {args.rounds} round(s)", flush=True)
        runs: dict[str, list[Outcome]] = {arm: [] for arm in arms}
        for repeat in range(args.repeats):  # the arms take turns, so a burst of load falls on all of them
            for arm in arms:
                outcome = run_arm(arm, folder, job, size, args, pythons, repeat)
                runs[arm].append(outcome)
                print(f"[{size.label}] {arm}: {outcome.status} job {_num(outcome.job_s)} s, rounds "
                      f"{_num(outcome.rounds_s)} s, accuracy {_num(outcome.final_accuracy, 4)} {outcome.note}",
                      flush=True)
        outcomes = [combine(runs[arm]) for arm in arms]
        print("\n" + table(outcomes, args) + "\n", flush=True)
        report["sizes"][size.label] = {arm: [asdict(o) for o in runs[arm]] for arm in arms}
        (args.work / "results.json").write_text(json.dumps(report, indent=1))
    print(f"results: {args.work / 'results.json'}; logs and run directories beside it")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
