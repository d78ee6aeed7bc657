"""Run a script as `python SCRIPT ARGS` would, in a process forked from a warm interpreter.

Importing torch and internlm_core costs ~6 s of CPU per process on the test machines, more than most e2e runs
train; a test suite that starts a hundred processes spends most of its time importing. A forkserver
(multiprocessing's, one per test process) imports them once; each run is a fork of it that sets argv, the
environment, the working directory and stdout/stderr, then runs the script as `__main__` (runpy), exits with
its status (SystemExit's code, 1 on an exception with its traceback on stderr, -N when killed by signal N), and
runs the interpreter's exit steps (non-daemon threads joined, atexit handlers). What the fork cannot give:
settings read when the interpreter starts (glibc's MALLOC_* variables) and a resident-memory figure of its own
(the forkserver's pages count in its RSS): memory measurements use real subprocesses (`fresh=True`).

Several ranks (`nproc > 1`) are forked with the environment torchrun gives its workers (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT, TORCHELASTIC_*); as torchrun does, when one rank fails the others are stopped
and the run's status is 1. torchrun itself, as users start it, is covered by the tests that name it.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

# torch._dynamo: every model is built on the meta device, where nn.Embedding's init imports it (~1 s);
# torch.utils.tensorboard: every run with monitor.tensorboard (the default) imports it, and with it boto3 and
# protobuf through tensorboard's gfile (~1.5 s per rank otherwise)
PRELOAD = ["torch", "torch._dynamo", "torch.utils.tensorboard", "internlm_core.trainer.build",
           "internlm_core.trainer.simulate", "internlm_core.estimate"]
_ctx = None


def context():
    """multiprocessing's forkserver context, its server warm (PRELOAD imported): Process(target=f) starts a fork
    of it; torch.multiprocessing.start_processes(..., start_method="forkserver") uses the same server."""
    global _ctx
    if _ctx is None:
        _ctx = multiprocessing.get_context("forkserver")
        _ctx.set_forkserver_preload(PRELOAD)
    return _ctx


def _child(script: str, argv: list[str], env: dict, cwd: str, out: str, err: str) -> None:
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    module = script[3:] if script.startswith("-m ") else None  # `python -m MODULE ARGS`
    sys.argv = [script if module is None else module, *argv]
    # as `python SCRIPT` puts the script's folder first, and `python -m` the working folder
    sys.path[0:0] = [cwd if module else str(Path(script).resolve().parent)]
    if env.get("OMP_NUM_THREADS"):
        import torch
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    code = 0
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # the interpreter joins non-daemon threads before atexit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(script: str, args: list[str], env: dict, cwd: Path, timeout: float, nproc: int = 1
        ) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` (nproc 1) or its torchrun equivalent on `nproc` local ranks, forked warm;
    script "-m MODULE" runs `python -m MODULE ARGS`."""
    ctx = context()
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in range(nproc):
            e = dict(env)
            if nproc > 1:
                e.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
                         GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                         TORCHELASTIC_RUN_ID="warm")
            p = ctx.Process(target=_child, args=(str(script), list(args), e, str(cwd), f"{tmp}/out{rank}",
                                                 f"{tmp}/err{rank}"))
            p.start()
            procs.append(p)
        deadline = time.monotonic() + timeout
        failed = False
        while any(p.exitcode is None for p in procs):
            if time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                for p in procs:
                    p.join()
                raise subprocess.TimeoutExpired([script, *args], timeout)
            if not failed and any(p.exitcode not in (None, 0) for p in procs):
                failed = True  # torchrun stops the other workers of a failed group
                for p in procs:
                    if p.exitcode is None:
                        p.terminate()
            time.sleep(0.05)
        codes = [p.exitcode for p in procs]
        out = "".join(Path(f"{tmp}/out{r}").read_text(errors="replace") for r in range(nproc))
        err = "".join(Path(f"{tmp}/err{r}").read_text(errors="replace") for r in range(nproc))
    code = codes[0] if nproc == 1 else (0 if all(c == 0 for c in codes) else 1)
    return subprocess.CompletedProcess([script, *args], code, out, err)


class Started:
    """A warm run in the background (`start`), with the parts of subprocess.Popen the tests use: pid, poll,
    send_signal, wait, communicate (stdout and stderr together, as Popen with stderr=STDOUT gives them)."""

    def __init__(self, process, tmp: tempfile.TemporaryDirectory, args: list[str]):
        self._process, self._tmp, self.args = process, tmp, args
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        return self._process.pid

    def poll(self) -> int | None:
        if self.returncode is None and self._process.exitcode is not None:
            self.returncode = self._process.exitcode
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self._process.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def output(self) -> str:
        return "".join(Path(self._tmp.name, f).read_text(errors="replace") for f in ("out", "err"))

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        out = self.output()
        self._tmp.cleanup()
        return out, None


def start(script: str, args: list[str], env: dict, cwd: Path) -> Started:
    """`python SCRIPT ARGS` forked warm, in the background (for tests that signal a run or watch it)."""
    tmp = tempfile.TemporaryDirectory()
    p = context().Process(target=_child, args=(str(script), list(args), dict(env), str(cwd), f"{tmp.name}/out",
                                               f"{tmp.name}/err"))
    p.start()
    return Started(p, tmp, [script, *args])
