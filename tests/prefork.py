"""``python harness.py ...`` without paying its imports each time: the harness runs in a process forked from a
forkserver (multiprocessing's) that has imported what a job imports, once per test process.

A harness's start is mostly imports: torch, transformers, peft (which imports bitsandbytes, which imports
torch's compiler), Hydra, FastAPI, openai, matplotlib: 6-10 s of CPU before any work, paid by every
harness a test starts. A forked harness is still a process of its own, in a session of its own: it can be
killed with -9, it holds its own locks and files, and it resumes a run as a fresh one does. What runs in it
is harness.py itself, as ``__main__``, with the test's command line, environment and working directory.

A test starts one with ``Forked`` (tests/runs.py's ``harness``) or ``run`` (``subprocess.run``'s shape); a command
a test's shell runs reaches it through ``ForkService`` (tests/test_doc_examples.py).

What it is not: a fresh interpreter. Tests of what happens before harness.py's first line (the allocator's
re-exec, a ``/proc/<pid>/cmdline`` that names harness.py, the CUDA lane's settings that must precede
torch) start ``sys.executable`` as before: ``forkable`` says which.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
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
from pathlib import Path

from agl.memory import allocator_library, runs_on_cuda

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "harness.py"

# What a CPU job imports before its first step, in that order (multiprocessing skips a name that fails to
# import without a word: tests/test_prefork.py checks that a forked harness finds each imported).
PRELOAD = [
    "agl",  # first: it quiets bitsandbytes' import-time logging (agl/policy/quiet.py); it reads no environment
    "torch",
    "transformers",
    "peft",
    "bitsandbytes",
    "hydra",
    "fastapi",
    "uvicorn",
    "httpx",
    "openai",
    "matplotlib.figure",
    "safetensors.torch",
    "llguidance",
]
# Left out: agl's own modules past its package (about 1 s). Some read the environment when imported
# (agl/jobs/launchers.py reads OMP_NUM_THREADS), and a forked harness must read the test's.

_start_lock = threading.Lock()
_context: multiprocessing.context.ForkServerContext | None = None


def forkable(args: list[str] | tuple[str, ...], env: dict) -> bool:
    """Whether a harness with this command line and environment may run forked: a CPU job (a CUDA one sets
    cuBLAS up before torch loads) under the allocator the forkserver was started with."""
    return not runs_on_cuda(list(args), env) and "AGL_ALLOCATOR" not in env and "LD_PRELOAD" not in env


def context() -> multiprocessing.context.ForkServerContext:
    """This process's forkserver, started on first use: under the malloc a harness preloads itself
    (agl/memory.py), with ``PRELOAD`` imported."""
    global _context
    with _start_lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            library = allocator_library("auto")
            before = os.environ.get("LD_PRELOAD")
            if library:
                os.environ["LD_PRELOAD"] = library  # for the forkserver alone: it inherits this environment
            try:
                from multiprocessing import forkserver

                forkserver.ensure_running()
            finally:
                if before is None:
                    os.environ.pop("LD_PRELOAD", None)
                else:
                    os.environ["LD_PRELOAD"] = before
            _context = ctx
        return _context


def _forked_main(args: list[str], env: dict, cwd: str, stdout: str, stderr: str) -> None:
    """In the forked process: become ``cd cwd && env python harness.py *args >stdout 2>stderr`` started in a
    session of its own, run harness.py as ``__main__``, and end as that interpreter would: its exit code (minus
    the signal of a Ctrl-C it did not handle), its threads joined, then its atexit handlers."""
    os.setsid()
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(target, fd)
        os.close(target)
    # unbuffered, as under PYTHONUNBUFFERED=1: a harness killed with -9 has written all it printed
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace"
    )
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, as `python harness.py` in a shell has
    multiprocessing.set_start_method(None, force=True)  # the platform's default again, not this forkserver
    os.chdir(cwd)
    preload = os.environ.get("LD_PRELOAD")
    os.environ.clear()
    os.environ.update(env)
    if preload:  # what harness.py's preload_allocator would have set, before exec'ing itself under it
        os.environ["LD_PRELOAD"] = preload
    # sys.path as `python harness.py` has it: the script's dir, PYTHONPATH's entries, then the interpreter's own
    # (not the test process's additions, such as tests/)
    front = [str(HARNESS.parent), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    prefixes = {Path(sys.prefix), Path(sys.base_prefix)}
    own = [p for p in sys.path if p not in front and any(Path(p).is_relative_to(x) for x in prefixes)]
    sys.path[:] = front + own
    sys.argv = [str(HARNESS), *args]
    sys.orig_argv = [sys.executable, *sys.argv]  # what a re-exec runs (agl/memory.py, preload_allocator)
    code, interrupted = 0, False
    try:
        runpy.run_path(str(HARNESS), run_name="__main__")
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException as error:
        sys.excepthook(type(error), error, error.__traceback__)
        code, interrupted = 1, isinstance(error, KeyboardInterrupt)
    threading._shutdown()  # as an interpreter ends: its threads joined, then its atexit handlers
    atexit._run_exitfuncs()
    sys.stdout.flush(), sys.stderr.flush()
    if interrupted:  # Python's own exit for an unhandled Ctrl-C: killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


class Forked:
    """A forked harness, with the surface of ``subprocess.Popen`` the tests use: ``pid`` (it leads its own
    process group), ``poll``, ``wait``, ``returncode`` (minus the signal that killed it), ``send_signal``,
    ``kill``, ``terminate``."""

    def __init__(self, args: list[str], env: dict, stdout: str, stderr: str, cwd: Path = ROOT):
        self.args = [sys.executable, str(HARNESS), *args]
        self._process = context().Process(
            target=_forked_main, args=(list(args), dict(env), str(cwd), stdout, stderr), name="harness"
        )
        self._process.start()
        # not joined by multiprocessing when this test process exits: a harness a failed test left running is an
        # orphan, as a Popen one is, not a wait without end
        multiprocessing.process._children.discard(self._process)
        self.pid = self._process.pid
        self.returncode: int | None = None
        self._await_session()

    def _await_session(self) -> None:
        """Return once it leads its own session, as Popen(start_new_session=True) returns: a test may
        ``os.killpg(pid)`` at once."""
        while self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                if os.getpgid(self.pid) == self.pid:
                    return
            time.sleep(0.005)

    def poll(self) -> int | None:
        if self.returncode is None and self._process.exitcode is not None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def run(args: list[str], env: dict, timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``subprocess.run([python, harness.py, *args], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout)``, forked where ``forkable``."""
    if not forkable(args, env):
        command = [sys.executable, str(HARNESS), *args]
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="agl-harness-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        proc = Forked(args, env, str(out), str(err), cwd=cwd)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, _text(out), _text(err))


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def missing_preloads(path: str) -> None:
    """In a forked process: write the ``PRELOAD`` names it does not find imported into ``path``, one a line."""
    Path(path).write_text("".join(f"{name}\n" for name in PRELOAD if name not in sys.modules))


class ForkService:
    """Forked harnesses for the commands a test's shell runs (tests/test_doc_examples.py): a ``python`` put
    first on ``PATH`` (``bin``) runs ``python <checkout>/harness.py ...`` as tests/fork_client.py, which hands
    the command line, environment and working directory to this process; the harness is forked here with the
    client's stdout and stderr (``/proc/<pid>/fd/1`` and ``2``), and the client exits as it did. Every other
    ``python`` command is the test's python itself. A client that goes away (its shell was killed) takes its
    harness with it."""

    def __init__(self, where: Path):
        self.bin, self.address = where / "bin", str(where / "forks.sock")
        self.bin.mkdir(parents=True)
        shim = self.bin / "python"
        client = HARNESS.parent / "tests" / "fork_client.py"
        shim.write_text(
            "#!/bin/sh\n"
            f'if [ "$1" = "{HARNESS}" ] && [ -n "$AGL_TEST_FORKS" ]; then\n'
            f'    exec "{sys.executable}" -S -E "{client}" "$@"\n'
            "fi\n"
            f'exec "{sys.executable}" "$@"\n'
        )
        shim.chmod(0o755)
        context()  # started here, not in a client's thread
        self._listener = socket.socket(socket.AF_UNIX)
        self._listener.bind(self.address)
        self._listener.listen()
        threading.Thread(target=self._accept, daemon=True, name="agl-fork-service").start()

    def env(self, env: dict) -> dict:
        """``env`` with this service's ``python`` first on ``PATH``."""
        return {**env, "PATH": f"{self.bin}{os.pathsep}{env.get('PATH', '')}", "AGL_TEST_FORKS": self.address}

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread in accept()
        self._listener.close()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # closed
            while True:
                conn, _ = self._listener.accept()
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            request = json.loads(conn.makefile("rb").readline())
            env = {k: v for k, v in request["env"].items() if k != "AGL_TEST_FORKS"}
            if request["harness"] != str(HARNESS) or not forkable(request["args"], env):
                conn.sendall(b'{"fresh": true}\n')
                return
            pid = request["pid"]
            proc = Forked(request["args"], env, f"/proc/{pid}/fd/1", f"/proc/{pid}/fd/2", cwd=Path(request["cwd"]))
            conn.setblocking(False)
            while proc.poll() is None:
                with contextlib.suppress(BlockingIOError, ProcessLookupError):
                    if conn.recv(1) == b"":  # the client is gone
                        os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(0.2)
            conn.setblocking(True)
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"returncode": proc.returncode}).encode() + b"\n")
