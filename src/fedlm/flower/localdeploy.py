"""A Flower deployment on this machine, as subprocesses: one SuperLink, one SuperNode per client, ``flwr run``.

The binaries, app and message path of a real deployment (HTTP over localhost, ``--insecure``), for the
multi-process test, ``benchmarks/bench_flower_round.py`` and trying a deployment before spreading it over
machines. Every process gets its own session, so stopping a node (``kill_node``) takes its ClientApp
processes with it; its worker follows within seconds (it watches the SuperNode side).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import yaml

from fedlm.split.certs import throwaway_certificates

BINARIES = ("flower-superlink", "flower-supernode", "flower-superexec", "flwr")
APP_DIR = Path(__file__).resolve().parents[3] / "deploy" / "flower"  # in a source checkout


def bin_dir() -> Path:
    return Path(sys.executable).parent


def flower_binaries_available() -> bool:
    """Whether Flower's command-line programs sit next to this Python (or on PATH)."""
    return all((bin_dir() / name).exists() or shutil.which(name) for name in BINARIES)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def toml_value(value: object) -> str:
    """One ``--run-config`` / ``--node-config`` value as TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return "'" + str(value).replace("'", "") + "'"


def config_arg(values: dict[str, object]) -> str:
    return " ".join(f"{key}={toml_value(value)}" for key, value in values.items())


def cores() -> int:
    """The cores this process may run on (its affinity, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def share_cores(node_configs: list[dict[str, object]]) -> list[dict[str, object]]:
    """Each node's ``threads``, where not set: this machine's cores divided among its nodes (at least 1).

    Every node's worker trains at once when a round starts; with torch's default (every core each) ten workers
    on two cores run twenty busy-waiting threads, and a round took 7x the simulator's.
    """
    each = max(1, cores() // max(1, len(node_configs)))
    return [{"threads": each, **config} for config in node_configs]


def trunk_credentials(folder: Path, partitions: list[int]) -> tuple[dict[str, str], dict[int, str]]:
    """Throwaway TLS files and one random token per client for a split run on this machine: the ServerApp's
    ``trunk-*`` run config keys, and each partition's token (its node's ``trunk-token``)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, pem in throwaway_certificates("localhost").items():
        (folder / f"{name}.pem").write_bytes(pem)
    tokens = {partition: secrets.token_urlsafe(24) for partition in partitions}
    (folder / "tokens.yaml").write_text(yaml.safe_dump({str(p): token for p, token in tokens.items()}))
    run_config = {"trunk-listen": "localhost:0", "trunk-cert": str(folder / "server_cert.pem"),
                  "trunk-key": str(folder / "server_key.pem"), "trunk-ca": str(folder / "ca.pem"),
                  "trunk-tokens": str(folder / "tokens.yaml")}
    return run_config, tokens


class LocalDeployment:
    """``with LocalDeployment(workdir, node_configs) as d: d.run(run_config)``; logs go to ``workdir``.

    The nodes share this machine's cores (``share_cores``) unless their configs set ``threads``.
    """

    def __init__(self, workdir: Path, node_configs: list[dict[str, object]], start_wait_s: float = 60.0) -> None:
        self.workdir = Path(workdir)
        self.node_configs = share_cores(node_configs)
        self.start_wait_s = start_wait_s
        self.port = free_port()
        self.env = {**os.environ, "PATH": f"{bin_dir()}{os.pathsep}{os.environ.get('PATH', '')}",
                    "FLWR_HOME": str(self.workdir / "flwr-home"), "FLWR_TELEMETRY_ENABLED": "0"}
        self.superlink: subprocess.Popen | None = None
        self.nodes: list[subprocess.Popen | None] = []
        self._logs: list[IO[bytes]] = []

    def __enter__(self) -> LocalDeployment:
        self.workdir.mkdir(parents=True, exist_ok=True)
        home = self.workdir / "flwr-home"
        home.mkdir(exist_ok=True)
        (home / "config.toml").write_text(f'[superlink.local]\naddress = "127.0.0.1:{self.port}"\ninsecure = true\n')
        try:
            self.superlink = self._spawn("superlink", ["flower-superlink", "--insecure", "--host", "127.0.0.1",
                                                       "--port", str(self.port),
                                                       "--disable-runtime-dependency-installation"])
            self._wait_for_port(self.port)
            for index in range(len(self.node_configs)):
                self.nodes.append(self._start_node(index))
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, name: str, command: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - closed in close()
        self._logs.append(log)
        return subprocess.Popen(command, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True, cwd=self.workdir)

    def _start_node(self, index: int) -> subprocess.Popen:
        return self._spawn(f"node-{index}", [
            "flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{self.port}", "--host", "127.0.0.1",
            "--port", str(free_port()), "--node-config", config_arg(self.node_configs[index])])

    def _wait_for_port(self, port: int) -> None:
        deadline = time.monotonic() + self.start_wait_s
        while time.monotonic() < deadline:
            if self.superlink is not None and self.superlink.poll() is not None:
                raise RuntimeError(f"flower-superlink exited; see {self.workdir / 'superlink.log'}")
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"flower-superlink did not listen on {port} within {self.start_wait_s:.0f}s")

    def start_run(self, run_config: dict[str, object], app_dir: Path = APP_DIR) -> subprocess.Popen:
        """``flwr run`` with ``--stream``: the ServerApp's output goes to ``run.log``."""
        return self._spawn("run", ["flwr", "run", str(app_dir), "local", "--stream",
                                   "--run-config", config_arg(run_config)])

    def run(self, run_config: dict[str, object], timeout_s: float = 600.0, app_dir: Path = APP_DIR) -> int:
        process = self.start_run(run_config, app_dir)
        try:
            return process.wait(timeout_s)
        finally:
            _stop(process)

    def kill_node(self, index: int) -> None:
        """kill -9 a SuperNode and everything it started (no goodbye to the SuperLink)."""
        _stop(self.nodes[index], signal.SIGKILL)
        self.nodes[index] = None

    def close(self) -> None:
        for process in [*self.nodes, self.superlink]:
            _stop(process)
        self.nodes, self.superlink = [], None
        for log in self._logs:
            log.close()
        self._logs = []


def _stop(process: subprocess.Popen | None, sig: int = signal.SIGTERM) -> None:
    """Signal a process's whole session (it was started in its own), then reap it."""
    if process is None or process.poll() is not None:
        return
    try:
        os.killpg(process.pid, sig)
        process.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
    except ProcessLookupError:
        pass
