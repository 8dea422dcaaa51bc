"""The `fedlm` command: run experiments, inspect partitions, report on run directories."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
import threading
import warnings
from pathlib import Path

from tqdm.contrib.logging import logging_redirect_tqdm

from fedlm.errors import UserError

# torch's CPU allocator asks for 2 MB transparent huge pages for tensors of 2 MB and more when this is set as torch
# loads (nothing above imports it): each client's fresh optimizer state and update otherwise fault in 4 KB pages
# by the thousand. MiniLM, 10 clients x 4 batches (benchmarks/bench_client_overhead.py, 2026-11-28): per-client
# overhead 55 -> -5 ms (noise) and the centralized epoch ~7% faster. A user's own value wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedlm", description="Federated and split learning for language models.")
    parser.add_argument("--data-dir", help="dataset directory (default: $FEDLM_DATA_DIR, else ../shared/data)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show everything: debug logging, library logs, warnings and progress bars")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run an experiment (or every combination of its grid)")
    run.add_argument("config", nargs="?", help="YAML config file")
    run.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. protocol.rounds=5")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue a run directory from its last checkpoint")
    run.add_argument("--output-dir", help="where run directories go (default: the config's output_dir)")
    run.add_argument("--overwrite", action="store_true",
                     help="replace a run directory of the same name (by default a re-run under an existing "
                          "run's name stops); the old run is deleted once the new one's data and model load")
    run.add_argument("--workers", type=int, metavar="N",
                     help="spread each round's clients over N local processes (torch.distributed, gloo; one GPU "
                          "each when there are GPUs); under torchrun leave it out")
    run.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                     help="how the processes of --workers or torchrun talk: gloo (CPU), nccl (one GPU per process), "
                          "auto (nccl when every process has a GPU of its own, else gloo)")
    run.add_argument("--worker-timeout-s", type=float, default=3600.0,
                     help="how long a worker waits for the others at a round's end before the run stops "
                          "(default 3600; longer than the slowest worker's share of a round)")

    part = sub.add_parser("partition", help="partition a config's data and write per-client statistics and plots")
    part.add_argument("config")
    part.add_argument("overrides", nargs="*")
    part.add_argument("--out", help="output directory (default: <output_dir>/<name>/partition)")

    report = sub.add_parser("report", help="tables and plots for finished run directories")
    report.add_argument("run_dirs", nargs="+", help="run directories or grid directories")
    report.add_argument("--rows", help="config key for the rows of a pivot table, e.g. partition")
    report.add_argument("--cols", help="config key for its columns, e.g. protocol.kind")
    report.add_argument("--headline", choices=("test", "local"),
                        help="score by the shared test split or by the clients' local test splits "
                             "(default: each run's eval.headline)")
    report.add_argument("--equivalence-band", type=float, metavar="BAND",
                        help="also judge each setting against its group's best as an equivalence claim: equivalent "
                             "only when the 95%% interval of their same-seed difference lies inside ±BAND (the "
                             "headline metric's units, fixed before the runs; default: the runs' "
                             "eval.equivalence_band)")

    audit = sub.add_parser("audit", help="attack a finished run as an honest-but-curious server; writes "
                                         "audit.md and audit.json into it")
    audit.add_argument("run_dir", help="a run directory (not a grid)")
    audit.add_argument("--public-text", help="the attacker's public text, one passage a line "
                                             "(default: wikitext-2/train.txt in the data directory)")
    audit.add_argument("--clients", type=int, nargs="+", help="client ids to attack (default: the first 8)")
    audit.add_argument("--inverter", choices=("transformer", "mlp"), default="transformer",
                       help="inversion model: a 1-layer transformer (FL-GLM's) or a per-position MLP")
    audit.add_argument("--steps", type=int, default=300, help="inversion model training steps (default 300)")
    audit.add_argument("--public-sequences", type=int, default=2000, help="public lines to train it on")
    audit.add_argument("--client-sequences", type=int, default=64, help="training sequences attacked per client")
    audit.add_argument("--seed", type=int, help="the attack's seed: inverter initialisation, its batches, the attacked "
                                                "sequences (default: the run's seed)")

    trunk = sub.add_parser("trunk", help="split learning: the server's trunk (middle transformer blocks)")
    trunk_sub = trunk.add_subparsers(dest="trunk_command", required=True)
    serve = trunk_sub.add_parser("serve", help="serve the trunk of a config's model to split-learning clients (gRPC)")
    serve.add_argument("--config", required=True, help="experiment YAML: the model (as its clients build it), seed, "
                                                       "train optimizer and clipping, and its split section")
    serve.add_argument("--address", default="[::]:50051", help="host:port to bind (default [::]:50051)")
    serve.add_argument("--tokens-file", required=True, help="YAML/JSON mapping of client id -> token")
    serve.add_argument("--tls-cert", help="server certificate chain (PEM)")
    serve.add_argument("--tls-key", help="server private key (PEM)")
    serve.add_argument("--client-ca", help="CA (PEM) that must have signed every client's certificate (mutual TLS)")
    serve.add_argument("--insecure", action="store_true", help="serve without TLS (tokens in clear; trusted networks)")
    serve.add_argument("--max-message-mb", type=float, default=None,
                       help="largest message either way (MiB; default: the largest the trunk's limits admit, <= 64)")
    serve.add_argument("--stream-timeout-s", type=float, default=600.0,
                       help="close a session this long after its last accepted message (default 600)")
    serve.add_argument("--max-sessions", type=int, default=16,
                       help="concurrent sessions in all; more are refused with RESOURCE_EXHAUSTED (default 16)")
    serve.add_argument("--max-sessions-per-client", type=int, default=2,
                       help="concurrent sessions of one client, so one cannot take them all (default 2)")
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a scheduler's stop), handled as Ctrl-C is: what the run computed stays, and one line
    says how to go on."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        return _main(raw)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return _main(raw)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(raw: list[str]) -> int:
    args = _parser().parse_args(raw)
    workers = getattr(args, "workers", None)
    try:
        if args.command == "run" and workers is not None:  # this process only starts and watches the workers
            from fedlm.cli.workers import launch, without_workers

            return launch(without_workers(raw), workers, run_dir_of(args), args.backend)
        configure_output(args.verbose)
        os.environ.setdefault("HF_HUB_OFFLINE", "0")
        with logging_redirect_tqdm():  # log lines above the progress bars, not through them
            return _dispatch(args)
    except UserError as err:
        print(f"fedlm: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt as stop:
        from fedlm.cli.workers import LAUNCHED_ENV

        terminated = isinstance(stop, Terminated)
        if not os.environ.get(LAUNCHED_ENV):  # a worker's launcher says it once for all of them
            how = "stopped by SIGTERM" if terminated else "interrupted"
            again = f" --workers {workers}" if workers is not None else ""
            resume = (f"; resume with `fedlm run --resume {run_dir_of(args)}{again}`"
                      if args.command == "run" else "")
            print(f"fedlm: {how}{resume}", file=sys.stderr)
        return 143 if terminated else 130
    except OSError as err:
        if err.errno not in _FILE_SYSTEM_ERRORS:
            raise
        print(f"fedlm: {file_system_error(err, run_dir_of(args))}", file=sys.stderr)
        return UserError.exit_code


def run_dir_of(args: argparse.Namespace) -> str:
    """The directory `fedlm run` writes (what --resume continues), for the lines that say how to go on;
    RUN_DIR where it cannot be told (another command, a config that does not load)."""
    if getattr(args, "command", None) != "run":
        return "RUN_DIR"
    if args.resume:
        return args.resume
    try:
        from fedlm.config import load_config
        from fedlm.run.recorder import slug

        config = load_config(args.config, args.overrides)
    except (UserError, OSError, TypeError):
        return "RUN_DIR"
    return str(Path(args.output_dir or config.output_dir) / slug(config.name))


# the file system refused (permissions, a read-only or full disk): the user's to fix, not a bug in fedlm
_FILE_SYSTEM_ERRORS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR,
                       errno.EISDIR}


def file_system_error(err: OSError, run_dir: str = "RUN_DIR") -> str:
    """One line for a file-system refusal: the path, the reason, and that a run keeps its last checkpoint."""
    where = f" {err.filename}" if err.filename else ""
    return (f"cannot write or read{where}: {err.strerror or err}; fix the permissions or free space (a run "
            f"stopped here resumes from its last checkpoint with fedlm run --resume {run_dir})")


def configure_output(verbose: bool) -> None:
    """What reaches the terminal besides fedlm's own lines, decided here once. By default the libraries' logs
    below errors, their load reports and progress bars, and warnings raised outside fedlm are held back: a
    fedlm user cannot act on them, and fedlm says what matters in its own line (e.g. which new head a checkpoint
    load initialised). ``verbose`` (-v) shows all of it, with fedlm and the libraries logging at DEBUG / INFO."""
    import datasets
    import huggingface_hub.utils as hub
    import transformers.utils.logging as hf_logging

    logging.basicConfig(level=logging.DEBUG if verbose else logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("fedlm").setLevel(logging.DEBUG if verbose else logging.INFO)
    if verbose:
        warnings.simplefilter("default")
        hf_logging.set_verbosity_info()
        datasets.logging.set_verbosity_info()
        for enable in (hf_logging.enable_progress_bar, hub.enable_progress_bars, datasets.enable_progress_bars):
            enable()
        return
    warnings.simplefilter("ignore")
    warnings.filterwarnings("default", module="fedlm")
    hf_logging.set_verbosity_error()
    datasets.logging.set_verbosity_error()
    for disable in (hf_logging.disable_progress_bar, hub.disable_progress_bars, datasets.disable_progress_bars):
        disable()


def _dispatch(args: argparse.Namespace) -> int:
    from fedlm.config import load_config
    from fedlm.data.sources import resolve_data_dir

    if args.command == "report":
        from fedlm.cli.commands import report_runs

        report_runs([Path(p) for p in args.run_dirs], args.rows, args.cols, args.headline, args.equivalence_band)
        return 0
    if args.command == "run":
        from fedlm.cli.commands import run_command

        return run_command(args)
    if args.command == "audit":
        from fedlm.audit import InversionSettings, audit_run

        settings = InversionSettings(args.public_sequences, args.client_sequences, args.inverter, args.steps, args.seed)
        audit_run(Path(args.run_dir), resolve_data_dir(args.data_dir), clients=args.clients, inversion=settings,
                  public_text=Path(args.public_text) if args.public_text else None)
        print(f"audit: {Path(args.run_dir) / 'audit.md'}")
        return 0
    if args.command == "trunk":
        from fedlm.cli.trunk import trunk_serve

        return trunk_serve(args)
    if args.command == "partition":
        from fedlm.cli.commands import partition_report

        config = load_config(args.config, args.overrides)
        out = partition_report(config, resolve_data_dir(args.data_dir), Path(args.out) if args.out else None)
        print(f"partition report: {out}")
        return 0
    raise UserError(f"unknown command {args.command}")

