"""`fedlm run --workers N`: one run over N local processes, and what each of them does when started.

``launch`` starts N copies of the same command as ``torchrun`` would (RANK, WORLD_SIZE, MASTER_ADDR, ... in
their environment, each with its share of the CPU threads and, when there are GPUs, its own GPU) and watches
them: the first that fails stops the others, so a dead or hung worker never leaves the run waiting forever.
Rank 0 prints as a one-process run does; the others' output is kept and its last line shown if one fails.
``join`` is the started side: under ``torchrun`` or ``launch`` it joins the group, else the run is alone.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fedlm.errors import UserError

if TYPE_CHECKING:
    from fedlm.federation.collective import Collective

LAUNCHED_ENV = "FEDLM_LAUNCHED"  # set in the processes `fedlm run --workers` starts: the launcher speaks for them
STOP_GRACE_S = 10.0  # how long a stopped worker may take to exit before it is killed


def check_workers(workers: int, backend: str = "auto") -> None:
    """Refuse, in one line, a worker count this machine cannot give one share each of its GPUs."""
    if workers < 1:
        raise UserError(f"--workers {workers}: give 1 or more worker processes")
    if os.environ.get("WORLD_SIZE"):
        raise UserError("--workers starts its own processes, but this one was started by torchrun (WORLD_SIZE is "
                        "set): leave --workers out and let torchrun's --nproc-per-node say how many")
    gpus = gpu_count()
    if gpus and workers > gpus and workers % gpus:
        raise UserError(f"--workers {workers} on {gpus} GPUs: the workers would share them unevenly; give a "
                        f"multiple of {gpus}, or list as many devices as workers in CUDA_VISIBLE_DEVICES")
    choose_backend(backend, workers, gpus)


def gpu_count() -> int:
    """The GPUs torch sees. On a machine without a GPU driver (no NVIDIA or ROCm device files) 0, without
    importing torch: the launcher of ``--workers`` starts its workers seconds sooner."""
    if "torch" not in sys.modules and not any(Path(p).exists() for p in ("/proc/driver/nvidia", "/dev/kfd")):
        return 0
    import torch

    return torch.cuda.device_count()


def choose_backend(requested: str, processes_here: int, gpus: int) -> str:
    """The ``torch.distributed`` backend for ``processes_here`` processes on a machine with ``gpus`` GPUs: NCCL
    needs a GPU of its own for each process (it refuses two ranks on one device), gloo runs anywhere. ``auto``
    takes NCCL exactly when it can."""
    if requested != "nccl" and not 0 < processes_here <= gpus:
        return "gloo"  # nothing to ask torch: NCCL cannot fit
    import torch.distributed as dist

    fits = 0 < processes_here <= gpus and dist.is_nccl_available()
    if requested == "auto":
        return "nccl" if fits else "gloo"
    if requested == "nccl" and not fits:
        why = ("torch sees no GPU" if not gpus else "this torch build has no NCCL" if not dist.is_nccl_available()
               else f"{processes_here} processes here share {gpus} GPUs")
        raise UserError(f"--backend nccl needs a GPU of its own for every process, but {why}: use --backend gloo "
                        "(or auto)" + (f", or at most {gpus} workers" if gpus and dist.is_nccl_available() else ""))
    return requested


def launch(argv: list[str], workers: int, run_dir: str = "RUN_DIR", backend: str = "auto") -> int:
    """Run ``fedlm <argv>`` as ``workers`` processes of one group; the exit code of the first that fails, else 0.
    ``run_dir``: where the run goes, for the line that says how to continue it."""
    check_workers(workers, backend)
    port = _free_port()
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // workers))
    with tempfile.TemporaryDirectory(prefix="fedlm-workers-") as logs:
        procs = [_start(argv, rank, workers, port, threads, Path(logs)) for rank in range(workers)]
        try:
            return _watch(procs, Path(logs), run_dir)
        finally:
            _stop(procs)


def _start(argv: list[str], rank: int, workers: int, port: int, threads: str, logs: Path) -> subprocess.Popen:
    env = {**os.environ, LAUNCHED_ENV: "1", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(workers),
           "LOCAL_WORLD_SIZE": str(workers), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": threads}
    command = [sys.executable, "-m", "fedlm.cli", *argv]
    if rank == 0:
        return subprocess.Popen(command, env=env)
    with open(logs / f"worker-{rank}.log", "wb") as log:
        return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log)


def _watch(procs: list[subprocess.Popen], logs: Path, run_dir: str) -> int:
    """Wait for every process; at the first failure say which stopped and why, and return its exit code."""
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            rank = failed[0]
            if rank != 0 and codes[0] in (None, 0):  # rank 0 speaks for itself when it failed
                print(f"fedlm: worker {rank} of {len(procs)} stopped (exit {codes[rank]}): "
                      f"{_last_line(logs / f'worker-{rank}.log')}; the run keeps its rounds up to its last "
                      f"checkpoint: continue with `fedlm run --resume {run_dir} --workers {len(procs)}`",
                      file=sys.stderr)
            return codes[rank] or 1
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.2)


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()] if path.exists() else []
    return lines[-1].strip() if lines else "no message"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def without_workers(argv: list[str]) -> list[str]:
    """``argv`` without its ``--workers N`` (or ``--workers=N``): what each worker process is started with."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--workers":
            skip = True
        elif not arg.startswith("--workers="):
            out.append(arg)
    return out


def join(timeout_s: float, backend: str = "auto") -> Collective:
    """This process's group: the one ``torchrun`` or ``launch`` described in its environment, else alone. A
    worker with GPUs takes its own (LOCAL_RANK), so the run's ``train.device: auto`` resolves to it. Every
    process of a machine decides the backend alike (from the same GPUs and LOCAL_WORLD_SIZE); across machines
    give ``--backend`` explicitly if they differ."""
    import torch

    from fedlm.federation.collective import LOCAL, TorchCollective

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return LOCAL
    gpus = torch.cuda.device_count()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    chosen = choose_backend(backend, local_world, gpus)
    if gpus:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % gpus)
    return TorchCollective.from_environment(timeout_s, chosen)
