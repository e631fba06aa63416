"""`python -m train ...` for the tests, from an interpreter that imported torch once: the suite starts hundreds of
one-process trainers, and each fresh one spends 3 to 4 CPU seconds importing torch and torch._dynamo before it reads
its first flag (docs/development.md). A server per pytest worker imports them once; for each command it forks a
child that becomes what `python -m MODULE ARGS` would be (the module run as `__main__` by runpy, as -m runs it; the
command's argv, working directory, environment, stdin, stdout and stderr; the interpreter's own exit), so the
trainer's code runs unchanged and a test reads its exit code and output as from a fresh process.

Only commands of that exact form, and only where the environment differs from the server's in nothing read while
torch loads (OpenMP's and torch's settings, Python's, the temporary folder): anything else, or TRAINBOX_TESTS_COLD=1,
runs in a fresh interpreter. A --spawn launcher's fork server, which multiprocessing starts as a fresh `python -c`
that imports torch, is forked the same way (_fork_server_by_fork), and so are a plain torchrun's workers, which its
agent starts as fresh `python -u -m train` processes (_workers_by_fork). tests/e2e/test_bad_input.py runs commands
both ways and holds their exit codes and outputs, and a --spawn and a torchrun run's weights, equal. What watches a
process itself (its imports under -X importtime, signals to its group, its tree: Popen in the tests), make, the
chaos drill, the containers and Slurm's jobs start fresh interpreters as before.

Run as a script (`python tests/warm.py FD`), this file is the server; imported, it is the client (helpers.run).
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import locale
import multiprocessing.util
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

MODULES = ("train", "train.evaluate", "train.export", "torch.distributed.run")  # torchrun's agent too
# Read while torch, OpenMP and Python start (libgomp reads OMP_* as it loads; tempfile caches its folder): a command
# runs in a server started with the same values (tests/helpers.py's start_warm).
AT_START = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH", "PYTHON", "LD_", "CUDA", "NVIDIA",
            "TRITON", "MALLOC", "XDG_", "TMPDIR", "TEMP", "TMP", "HOME", "LANG", "LC_")


SERVER_MODULES: set[str] = set()  # what the server imported before any command


def at_start(env: dict) -> tuple:
    """What of an environment torch, OpenMP and Python read as they start: a server serves commands that agree."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(AT_START)))


def _request(sock: socket.socket) -> tuple[dict, list[int]] | None:
    """One command from the client: its JSON (length-prefixed) and the three file descriptors of its stdio."""
    head, fds, _, _ = socket.recv_fds(sock, 8, 3)
    if not head:
        return None
    size = int.from_bytes(head, "big")
    body = b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            return None
        body += chunk
    return json.loads(body), fds


def serve(sock: socket.socket) -> tuple[dict, list[int]]:
    """Answer commands until the client goes away (then exit); return only in a forked child, with its command."""
    while True:
        got = _request(sock)
        if got is None:
            sys.exit(0)
        command, fds = got
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            sock.close()
            return command, fds
        for fd in fds:
            os.close(fd)
        sock.sendall(pid.to_bytes(8, "big"))
        _, status = os.waitpid(pid, 0)
        sock.sendall(os.waitstatus_to_exitcode(status).to_bytes(8, "big", signed=True))


def become(command: dict, fds: list[int]) -> str:
    """Turn this forked child into `python -m MODULE ARGS`: its stdio, folder, environment, argv and sys.path[0]
    (the working directory, as -m puts it), and a fresh `__main__`. Returns the module to run."""
    for target, fd in enumerate(fds):  # none for a torchrun worker: its own already (_fork_workers)
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(command["cwd"])
    os.environ.clear()
    os.environ.update(command["env"])
    sys.argv = ["-m", *command["args"]]
    sys.path[0] = os.getcwd()
    sys.modules["__main__"] = type(sys)("__main__")
    if command.get("unbuffered"):  # -u: stdout and stderr written through, as a fresh interpreter makes them
        for name in ("stdout", "stderr"):
            old = getattr(sys, name)
            new = io.TextIOWrapper(io.FileIO(old.fileno(), "w", closefd=False), encoding=old.encoding,
                                   errors=old.errors, newline="\n", write_through=True)
            setattr(sys, name, new)
            setattr(sys, f"__{name}__", new)
    if command.get("threads"):  # OMP_NUM_THREADS, which OpenMP read as the server started, set as it would be
        import torch

        torch.set_num_threads(command["threads"])
    if command["module"] == "train":  # whose --spawn launcher never calls torch (train/cluster/forkserver.py)
        multiprocessing.util.spawnv_passfds = _fork_server_by_fork(multiprocessing.util.spawnv_passfds)
    elif command["module"] == "torch.distributed.run":
        return _workers_by_fork(command)
    return command["module"]


def _fork_server_by_fork(spawnv_passfds):
    """multiprocessing's way to start its fork server (`python -c "from multiprocessing.forkserver import main;
    ..."` with its preload: torch, and the trainer for --spawn), replaced by a fork of this child as that fresh
    interpreter would be after importing torch: the descriptors it is given and stdio alone, the signals' handlers
    as an exec leaves them, no module but the server's own from before the command (the command's modules, the
    trainer's and multiprocessing.forkserver's, import again), a fresh `__main__`; then the same code. Anything else,
    or a caller with a second thread (its own or OpenMP's), starts a fresh interpreter as before."""
    def start(path, args, passfds):
        code = args[-1] if len(args) > 2 and args[-2] == "-c" else ""
        threads = len(os.listdir("/proc/self/task"))  # OpenMP's too: a fork would copy their locks, not them
        if not code.startswith("from multiprocessing.forkserver import main;") or threads > 1:
            return spawnv_passfds(path, args, passfds)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            return pid
        status = 1
        try:
            multiprocessing.util.spawnv_passfds = spawnv_passfds  # the fresh interpreter's own
            _as_if_exec({0, 1, 2, *map(int, passfds)})
            sys.argv = ["-c"]
            exec(code, sys.modules["__main__"].__dict__)  # noqa: S102 - multiprocessing's own command line
            status = 0
        except SystemExit as e:  # the server's end (its clients gone), as the interpreter reads SystemExit
            status = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            sys.excepthook(*sys.exc_info())
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)

    return start


# What torchrun adds to its workers' environment that nothing reads as torch loads; OMP_NUM_THREADS, which OpenMP
# reads as it loads, is set in the forked worker (become) as a fresh one would have it.
WORKER_ENV = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
# Signals torchrun's agent passes on: its fork of workers ignores them, as the workers' parent that only a
# SIGKILL or the agent's end ends (the agent is their parent in a plain torchrun)
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR2)


def _workers_by_fork(command: dict) -> str:
    """A plain torchrun's workers (`python -u -m train ARGS`, which its agent starts with subprocess.Popen, each in
    a session of its own) forked from a process forked here before the agent runs (single-threaded, the server's
    modules alone), each made what that fresh interpreter would be, as a command is (become): stdio (the agent's,
    or the files it redirects to), folder, environment, argv, -u, OpenMP's thread count. The agent gets an object
    that answers as its Popen would (pid, poll, wait; its signals go to the pid and its session). The forking
    process ends when the agent does, however it ends, so the workers, which watch their parent (a plain torchrun's
    watch the agent), see it end then. Anything else the agent starts, or a worker whose environment differs in
    what torch reads as it loads, starts afresh. Returns the module to run (torchrun's)."""
    ours, theirs = socket.socketpair()
    sys.stdout.flush()
    sys.stderr.flush()
    if os.fork() == 0:
        ours.close()
        return become(*_fork_workers(theirs))
    theirs.close()
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    workers = _Workers(ours, at_start(command["env"]))
    popen = subprocess_handler.SubprocessHandler._popen

    def _popen(handler, args, env):
        outs = [f.fileno() if f else fd for fd, f in ((1, handler._stdout), (2, handler._stderr))]
        return workers.start(tuple(map(str, args)), env, [0, *outs]) or popen(handler, args, env)

    subprocess_handler.SubprocessHandler._popen = _popen
    return command["module"]


def _fork_workers(sock: socket.socket) -> tuple[dict, list[int]]:
    """The forking process: a worker for each request (reported by its pid), each end reported (pid and exit code)
    and the worker left a zombie until the agent has read its end (asks to reap it), as its Popen's would be: its pid
    and session, which the agent signals, stay until then. Returns only in a forked worker, with its command. Ends
    when the agent's side closes."""
    for sig in PASSED_ON:
        signal.signal(sig, signal.SIG_IGN)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    running: set[int] = set()
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            for pid in sorted(running):
                ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                if ended is not None:
                    running.discard(pid)
                    code = ended.si_status if ended.si_code == os.CLD_EXITED else -ended.si_status
                    sock.sendall(b"e" + pid.to_bytes(8, "big") + code.to_bytes(8, "big", signed=True))
        if sock in ready:
            got = _request(sock)
            if got is None:
                os._exit(0)
            worker, fds = got
            if "reap" in worker:
                os.waitpid(worker["reap"], 0)
                continue
            pid = os.fork()
            if pid == 0:
                sock.close()
                for sig in PASSED_ON:
                    signal.signal(sig, signal.SIG_DFL)  # ignored here alone: an exec would leave them as they were
                os.setsid()
                for target, fd in enumerate(fds):
                    os.dup2(fd, target)
                    os.close(fd)
                _as_if_exec({0, 1, 2})  # the wakeup pipe and any other descriptor closed, SIGCHLD's handler reset
                if worker["env"].get("TRAINBOX_TESTS_FORKED"):  # tests/e2e/test_bad_input.py: which way it started
                    with open(worker["env"]["TRAINBOX_TESTS_FORKED"], "a") as log:
                        log.write(f"{os.getpid()}\n")
                return worker, []
            for fd in fds:
                os.close(fd)
            running.add(pid)
            sock.sendall(b"s" + pid.to_bytes(8, "big") + bytes(8))
            with contextlib.suppress(BlockingIOError):  # (a byte there already wakes it as well)
                os.write(wake_w, b"\0")  # it may have ended before it was counted


class _Workers:
    """The agent's side of the forking process: asks it for workers and reads their ends."""

    def __init__(self, sock: socket.socket, start: tuple):
        self.sock, self.start_env, self.lock, self.ended = sock, start, threading.RLock(), {}

    def start(self, args: tuple, env: dict, fds: list[int]) -> _Worker | None:
        if args[:3] != (sys.executable, "-u", "-m") or len(args) < 4 or args[3] != "train":
            return None
        threads, started = env.get("OMP_NUM_THREADS"), dict(self.start_env).get("OMP_NUM_THREADS")
        if threads != started and not (threads or "").isdigit() or threads == "0":
            return None  # OpenMP's default, or a value torch.set_num_threads would not give as OpenMP reads it
        if ({kv for kv in at_start(env) if not kv[0].startswith(WORKER_ENV) and kv[0] != "OMP_NUM_THREADS"} !=
                {kv for kv in self.start_env if kv[0] != "OMP_NUM_THREADS"}):
            return None
        command = {"module": "train", "args": list(args[4:]), "cwd": os.getcwd(), "env": env, "unbuffered": True,
                   "threads": int(threads) if threads != started else 0}
        with self.lock:
            self._send(command, fds)
            while True:
                kind, pid, _ = self._message()
                if kind == b"s":
                    return _Worker(self, pid, list(args))

    def reap(self, pid: int) -> int:
        """The worker's exit code, read as its Popen's poll reads it: the zombie reaped then."""
        with self.lock:
            self._send({"reap": pid}, [])
            return self.ended.pop(pid)

    def _send(self, command: dict, fds: list[int]) -> None:
        body = json.dumps(command).encode()
        socket.send_fds(self.sock, [len(body).to_bytes(8, "big")], fds)
        self.sock.sendall(body)

    def _message(self) -> tuple[bytes, int, int]:
        data = b""
        while len(data) < 17:
            chunk = self.sock.recv(17 - len(data))
            if not chunk:
                raise RuntimeError("the process that forks torchrun's workers ended")
            data += chunk
        kind, pid, code = data[:1], int.from_bytes(data[1:9], "big"), int.from_bytes(data[9:], "big", signed=True)
        if kind == b"e":
            self.ended[pid] = code
        return kind, pid, code

    def collect(self, timeout: float) -> None:
        """Read the ends reported within timeout seconds (0: those already reported)."""
        with self.lock:
            while select.select([self.sock], [], [], timeout)[0]:
                self._message()
                timeout = 0


class _Worker:
    """A forked worker, as the agent reads its subprocess.Popen: pid, args, returncode, poll, wait, signals."""

    def __init__(self, workers: _Workers, pid: int, args: list[str]):
        self.workers, self.pid, self.args, self.returncode = workers, pid, args, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.workers.collect(0)
            if self.pid in self.workers.ended:
                self.returncode = self.workers.reap(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.workers.collect(min(left, 1.0))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _as_if_exec(keep: set[int]) -> None:
    gc.collect()  # garbage that holds a descriptor closes it now, not after another file took its number
    for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
        if fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            if callable(signal.getsignal(sig)) and signal.getsignal(sig) is not signal.default_int_handler:
                signal.signal(sig, signal.SIG_DFL)
    for name in [name for name in sys.modules if name not in SERVER_MODULES]:
        del sys.modules[name]
    sys.modules["__main__"] = type(sys)("__main__")


def main() -> None:
    import runpy

    import torch  # noqa: F401 - what each command would import first
    import torch._dynamo  # noqa: F401 - torch's optimizers import it (train/cluster/forkserver.py)

    SERVER_MODULES.update(sys.modules)
    sock = socket.socket(fileno=int(sys.argv[1]))
    module = become(*serve(sock))
    del sock
    try:
        runpy._run_module_as_main(module)  # as `python -m` runs it: SystemExit's code is the interpreter's to read
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # printed as the interpreter prints it, without this file's frames, and exit 1
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        sys.excepthook(type(e), e, e.with_traceback(tb).__traceback__)
        sys.exit(1)


class Server:
    """The client's side: one server per pytest worker, started on first use, gone when the worker goes."""

    def __init__(self, python: str, cwd: str, env: dict):
        self.env = env
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([python, __file__, str(theirs.fileno())], cwd=cwd, env=env,
                                     pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        self.sock = ours
        self.busy = threading.Lock()  # one command at a time: a second one at once runs in a fresh interpreter

    def start(self, module: str, args: list[str], cwd: str, env: dict) -> Started | None:
        """The command, forked from the server; None while the server runs another (then a fresh interpreter)."""
        assert at_start(env) == at_start(self.env), "a server runs commands of its own start-up environment only"
        if not self.busy.acquire(blocking=False):
            return None
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        body = json.dumps({"module": module, "args": args, "cwd": str(cwd), "env": env}).encode()
        try:
            socket.send_fds(self.sock, [len(body).to_bytes(8, "big")], [0, out_w, err_w])
            self.sock.sendall(body)
            pid = int.from_bytes(self._read(8), "big")
        except BaseException:
            self.busy.release()
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        return Started(self, pid, out_r, err_r)

    def _read(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            if not chunk:
                raise RuntimeError("the warm interpreter's server ended")
            data += chunk
        return data

    def exit_code(self) -> int:
        return int.from_bytes(self._read(8), "big", signed=True)

    def stop(self) -> None:
        self.sock.close()
        self.proc.kill()
        self.proc.wait()


class Started:
    """A command the server forked, read as subprocess.Popen(..., stdout=PIPE, stderr=PIPE, text=True) is."""

    def __init__(self, server: Server, pid: int, out: int, err: int):
        self.server, self.pid, self.returncode = server, pid, None
        self.selector = selectors.DefaultSelector()
        self.data = {out: bytearray(), err: bytearray()}
        self.streams = [out, err]
        for fd in self.streams:
            self.selector.register(fd, selectors.EVENT_READ)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.selector.get_map():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(["warm", str(self.pid)], timeout)
            for key, _ in self.selector.select(left):
                chunk = os.read(key.fd, 65536)
                if chunk:
                    self.data[key.fd] += chunk
                else:
                    self.selector.unregister(key.fd)
                    os.close(key.fd)
        if self.returncode is None:
            self.returncode = self.server.exit_code()
        self.server.busy.release()
        encoding = locale.getpreferredencoding(False)  # as Popen's text mode, its universal newlines too
        return tuple(bytes(self.data[fd]).decode(encoding).replace("\r\n", "\n").replace("\r", "\n")
                     for fd in self.streams)

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> Started:
        return self

    def __exit__(self, *exc) -> None:
        if self.returncode is None:  # left early (an error in the test): end it, keep the server in step
            self.kill()
            self.communicate()


if __name__ == "__main__":
    main()
