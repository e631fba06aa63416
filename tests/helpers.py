"""Helpers the tests share: run the trainer exactly as a user would (python -m train, torchrun, make), read
what a run left behind, and find its processes. Fixtures live in conftest.py."""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import http.server
import importlib.util
import io
import json
import os
import pickle
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch

from tests import warm
# RECIPE: a published recipe's state on top of a run (the drill's --recipe), what a preempted or killed run brings back
from tests.chaos import RECIPE  # noqa: F401 - the tests import it from here
from tests.processes import children, describe, descendants, rank_of
from train.files.rundir import read_metrics, read_status

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
DEBUG = ["--preset", "debug"]
# Trains at lr 0.01 for 30 steps, then at 1.0 until step 40: its best evaluation (step 30, about 20 % top-1) is not
# its last (about 9 %), so best.pt and CHECKPOINT=best differ from model.pt and the last evaluation.
PEAKED = [*DEBUG, "--eval-every", 10, "--lr", 1.0, "--warmup-method", "constant", "--warmup-decay", 0.01,
          "--warmup-steps", 30, "--lr-scheduler", "constant"]
# A few seconds on 2 cores, long enough that a fault or a signal lands mid-run; a checkpoint every 20 steps,
# so a fault lands between two of them. The faults, signals and stop tests share its references.
LONG = [*DEBUG, "--max-steps", 240, "--width", 16, "--log-every", 5, "--save-every", 20, "--eval-every", 0]
# Four workers on the two test nodes (tests/cluster/up.sh): long enough to preempt or kill a node mid-run.
SLURM_LONG = [*DEBUG, "--max-steps", 160, "--log-every", 5, "--eval-every", 0]  # the default path, exact too
CLUSTER_NODES = {"n1": "10.231.77.11", "n2": "10.231.77.12"}  # tests/cluster/up.sh: NET=10.231.77
CLUSTER_HOST = "10.231.77.1"  # this machine, as the nodes reach it
# Slurm hostlists and their hosts as `scontrol show hostnames` on the test cluster (Slurm 22.05) gives them:
# tests/unit/test_identity.py holds train.cluster.hostlist's own parser to this table, tests/e2e/test_slurm.py the table to
# scontrol. Several brackets in one name go round in hostlist.c's order: the last fastest, then the first, ...
HOSTLISTS = [
    ("n1", ["n1"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("gpu[01-03,7]", ["gpu01", "gpu02", "gpu03", "gpu7"]),
    ("a[1-2],b5,c[09-10]", ["a1", "a2", "b5", "c09", "c10"]),
    ("a1,b[2-3],c", ["a1", "b2", "b3", "c"]),
    ("a[1,3,5-7]", ["a1", "a3", "a5", "a6", "a7"]),
    ("a[01-10]", ["a01", "a02", "a03", "a04", "a05", "a06", "a07", "a08", "a09", "a10"]),
    ("a[001-100]", [f"a{n:03d}" for n in range(1, 101)]),
    ("a[8-11]", ["a8", "a9", "a10", "a11"]),  # as wide as the first number
    ("a[098-101]", ["a098", "a099", "a100", "a101"]),
    ("a[1-03]", ["a1", "a2", "a3"]),
    ("a[1-3,2]", ["a1", "a2", "a3", "a2"]),  # repeats stay
    ("a[1-2]-ib[3-4]", ["a1-ib3", "a1-ib4", "a2-ib3", "a2-ib4"]),
    ("a[1-2][3-4]", ["a13", "a14", "a23", "a24"]),
    ("a[1-2]b[3-4]c[5-6]", ["a1b3c5", "a1b3c6", "a2b3c5", "a2b3c6", "a1b4c5", "a1b4c6", "a2b4c5", "a2b4c6"]),
    ("a[1-2,4-5]-b[1,3]", ["a1-b1", "a1-b3", "a2-b1", "a2-b3", "a4-b1", "a4-b3", "a5-b1", "a5-b3"]),
    ("dc1.rack-7.r[1-2]-n[08-09]",
     ["dc1.rack-7.r1-n08", "dc1.rack-7.r1-n09", "dc1.rack-7.r2-n08", "dc1.rack-7.r2-n09"]),
    ("gpu-a100-[1-2],login-1.x", ["gpu-a100-1", "gpu-a100-2", "login-1.x"]),
    ("a[1-2],,b c", ["a1", "a2", "b", "c"]),  # commas or white space; empty entries skipped
    ("n1-3", ["n1-3"]),  # no bracket, no range
]
# Text after the last bracket: Slurm reads it since 23.02.5 ("Extend hostlist to support suffix"); 22.05 says
# `Invalid hostlist` (and then the parser answers).
SUFFIXED_HOSTLISTS = [
    ("rack1-n[3-4]-ib", ["rack1-n3-ib", "rack1-n4-ib"]),
    ("node-1.dc[1-2].x,b", ["node-1.dc1.x", "node-1.dc2.x", "b"]),
    ("r[1-2]-g[7,9].ib", ["r1-g7.ib", "r1-g9.ib", "r2-g7.ib", "r2-g9.ib"]),
]
# scontrol: `Invalid hostlist` (a range backwards, empty, not numbers, negative, nested, unbalanced, over 65536 hosts)
MALFORMED_HOSTLISTS = ["a[3-1]", "a[]", "a[x-y]", "a[-2]", "a[1--2]", "a[1-2-3]", "a[[1-2]]", "a[1-2]]", "a[0-65536]"]


def env_for_tests(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("MASTER_PORT", None)
    for key in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS"):  # a test's `make` is a user's own, not one nested in `make test`
        env.pop(key, None)
    for key in list(env):  # never inherit a launcher's identity from the shell running the tests
        if key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE") or key.startswith("SLURM_"):
            env.pop(key)
    env.update(extra)
    return env


def python_cmd(*args) -> list[str]:
    return [PY, "-m", "train", *map(str, args)]


def torchrun_cmd(nprocs: int, *args) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}", "-m", "train",
            *map(str, args)]


# This pytest worker's warm interpreters (tests/warm.py), one per start-up environment (warm.at_start), the last two
_warm: dict[tuple, warm.Server] = {}


def start_warm(cmd: list[str], cwd: Path, env: dict) -> warm.Started | None:
    """`python -m train|train.evaluate|train.export|torch.distributed.run ARGS` forked from this worker's interpreter
    that imported torch once (tests/warm.py); None for any other command, which runs in a fresh interpreter."""
    if (os.environ.get("TRAINBOX_TESTS_COLD") == "1" or cmd[:2] != [PY, "-m"] or len(cmd) < 3
            or cmd[2] not in warm.MODULES):
        return None
    key = warm.at_start(env)
    if key in _warm and _warm[key].proc.poll() is not None:  # gone (a test killed it): start another
        _warm.pop(key).stop()
    if key not in _warm:
        if len(_warm) >= 2:  # room for this environment's: stop one that runs nothing
            idle = [k for k, server in _warm.items() if not server.busy.locked()]
            if not idle:
                return None
            _warm.pop(idle[0]).stop()
        _warm[key] = warm.Server(PY, str(REPO), env)
    return _warm[key].start(cmd[2], [str(a) for a in cmd[3:]], str(cwd), env)


def run(cmd: list[str], *, expect: int | None = 0, timeout: float = 300, env: dict | None = None,
        cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = env or env_for_tests()
    with (start_warm(cmd, cwd, env) or
          subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)) as started:
        try:
            out, err = started.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            out, err = end_hung(started)
            raise AssertionError(f"{' '.join(cmd)} still ran after {timeout} s\n--- stdout\n{out[-3000:]}\n"
                                 f"--- stderr\n{err[-12000:]}") from None
    proc = subprocess.CompletedProcess(cmd, started.returncode, out, err)
    if expect is not None and proc.returncode != expect:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}, expected {expect}\n"
                             f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def end_hung(proc: subprocess.Popen) -> tuple[str, str]:
    """End a command that hangs so that its output says where: each process still alive (its state and the kernel
    function it waits in), then SIGABRT to its descendants (a trainbox worker's faulthandler prints every thread's
    Python stack), then SIGKILL to all. Returns its stdout and its stderr, the process list appended."""
    tree = descendants(proc.pid)
    listing = [line for line in map(describe, [proc.pid, *tree]) if line]
    for pid in tree:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGABRT)
    time.sleep(3)
    for pid in [*tree, proc.pid]:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    out, err = proc.communicate()
    return out, err + "\n--- processes still running at the timeout\n" + "\n".join(listing)


def make(*args, expect: int | None = 0, timeout: float = 600) -> subprocess.CompletedProcess:
    return run(["make", "--no-print-directory", *args], expect=expect, timeout=timeout, cwd=REPO)


@contextlib.contextmanager
def one_at_a_time(name: str):
    """Hold a lock of this machine named `name` (an flock on a file in the temporary folder): what two test workers
    must not do at once, such as installing a tool's environment into the one folder."""
    with open(Path(tempfile.gettempdir()) / f"trainbox-tests-{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def without_bytecode(site_packages: Path) -> list[str]:
    """The modules under site_packages that compile but have no bytecode beside them (make's setup targets compile
    every one; a process under PYTHONDONTWRITEBYTECODE would compile them again at each import)."""
    missing = []
    for source in site_packages.rglob("*.py"):
        if Path(importlib.util.cache_from_source(str(source))).is_file():
            continue
        try:
            compile(source.read_bytes(), str(source), "exec", dont_inherit=True)
        except (SyntaxError, ValueError):
            continue  # as pip, make leaves a file this Python cannot compile to its source
        missing.append(str(source.relative_to(site_packages)))
    return missing


def load_model(run_dir: Path) -> dict:
    return torch.load(run_dir / "model.pt", weights_only=True)


def assert_bit_identical(a: Path, b: Path) -> None:
    sa, sb = load_model(a), load_model(b)
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), f"{key} differs between {a} and {b}"
    assert (a / "model.pt").read_bytes() == (b / "model.pt").read_bytes()


def assert_same_final_figures(a: Path, b: Path) -> None:
    """The final validation figures in status.json, bit for bit (runs of the same world size)."""
    fa, fb = ({k: v for k, v in status(d).items() if k.startswith("val_")} for d in (a, b))
    assert fa and fa == fb, f"final validation figures differ: {fa} vs {fb}"


def metrics(run_dir: Path, kind: str | None = None) -> list[dict]:
    """metrics.jsonl's records (of one kind): the file and every line must be there."""
    return read_metrics(run_dir, kind, strict=True)


def status(run_dir: Path) -> dict:
    record = read_status(run_dir)
    assert record, f"no readable status.json in {run_dir}"
    return record


def snapshot(folder: Path) -> dict:
    """Every file under folder and its SHA-256: what a refused run must leave as it was."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def attempts(run_dir: Path) -> int:
    """How many attempts started training in run_dir: each logs its "run RUN_DIR: N worker(s) ..." line to
    train.log once (a torchrun restart, a requeue or a resume is one more)."""
    log = run_dir / "train.log"
    return sum(1 for line in log.read_text().splitlines() if f" run {run_dir}: " in line) if log.is_file() else 0


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"process ended ({proc.returncode}) before {what}\n{out[-3000:]}\n{err[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def reached_step(run_dir: Path, step: int):
    def check() -> bool:
        try:
            return any(m["step"] >= step for m in metrics(run_dir, "train"))
        except (OSError, ValueError):
            return False
    return check


def host_tool(relative: str):
    """A standard-library host script (docker/mlflow_server.py) loaded by its path, as a module."""
    path = REPO / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Evil:
    """Unpickling this runs a shell command: what a weights-only load must never do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def worker_pid(launcher: subprocess.Popen, rank: int) -> int:
    """The torchrun worker of this rank among the launcher's descendants (plain torchrun's children, make train's
    fork server's)."""
    for agent in children(launcher.pid):
        for pid in [agent, *children(agent)]:
            if rank_of(pid) == str(rank):
                return pid
    raise AssertionError(f"no worker of rank {rank} under {launcher.pid}")


def tracked_env(uri: str, tmp_path: Path) -> dict:
    """The tests' environment, tracking to the MLflow server at uri in an experiment of the test's own."""
    return env_for_tests(MLFLOW_TRACKING_URI=uri, MLFLOW_EXPERIMENT_NAME=f"test-{tmp_path.name}")


def the_one_mlflow_run(client, run_dir: Path, experiment: str):
    """The experiment holds one run, the one RUN_DIR/mlflow.json names."""
    run_id = json.loads((run_dir / "mlflow.json").read_text())["run_id"]
    found = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert [r.info.run_id for r in found] == [run_id]
    return client.get_run(run_id)


def assert_mlflow_run_complete(client, tracked, run_dir: Path, tmp_path: Path, max_steps: int = 240) -> None:
    """Each metric's steps once, train/loss at every logged step with the values of metrics.jsonl, the
    model as an artifact bit for bit, and the run finished."""
    run_id = tracked.info.run_id
    for key in tracked.data.metrics:
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        assert len(steps) == len(set(steps)), f"{key}: a step sent twice: {steps}"
    losses = {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")}
    assert losses == {m["step"]: m["loss"] for m in metrics(run_dir, "train")}
    assert sorted(losses) == list(range(5, max_steps + 1, 5))
    assert [m.step for m in client.get_metric_history(run_id, "eval/accuracy")] == [max_steps]
    assert tracked.info.status == "FINISHED"
    downloaded = client.download_artifacts(run_id, "model.pt", str(tmp_path))
    assert open(downloaded, "rb").read() == (run_dir / "model.pt").read_bytes()


class FileServer:
    """Files served over HTTP on 127.0.0.1 from a thread of this process (python's http.server), by name, in
    64 KiB writes with `delay` seconds after each (slow enough for several clients to overlap); `requests`
    records each GET as (name, start, end, whole) on time.monotonic()."""

    def __init__(self, files: dict[str, bytes], delay: float = 0.0):
        self.files, self.delay, self.requests = files, delay, []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # http.server calls it by this name
                name, start = self.path.lstrip("/"), time.monotonic()
                body = server.files.get(name)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    for offset in range(0, len(body), 1 << 16):
                        self.wfile.write(body[offset:offset + (1 << 16)])
                        time.sleep(server.delay)
                except (BrokenPipeError, ConnectionResetError):  # a client that read the headers alone
                    server.requests.append((name, start, time.monotonic(), False))
                    return
                server.requests.append((name, start, time.monotonic(), True))

            def log_message(self, *args):
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"

    def __enter__(self) -> FileServer:
        threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.http.shutdown()
        self.http.server_close()

    def whole(self, name: str) -> list[tuple[float, float]]:
        """(start, end) of each whole transfer of `name`."""
        return [(start, end) for n, start, end, whole in self.requests if n == name and whole]


def small_cifar(images: int) -> tuple[bytes, dict, dict]:
    """A small CIFAR-10 in its own layout (cifar-10-batches-py/: five training batches, a test batch, the
    meta file; random pixels, so the archive is as large as its files): the .tar.gz, the checksums a CIFAR10
    class carries, and each file's bytes."""
    rng = np.random.default_rng(0)
    files = {f"data_batch_{i}": {"data": rng.integers(0, 256, (images, 3072), dtype=np.uint8),
                                 "labels": rng.integers(0, 10, images).tolist()} for i in range(1, 6)}
    files["test_batch"] = {"data": rng.integers(0, 256, (images, 3072), dtype=np.uint8),
                           "labels": rng.integers(0, 10, images).tolist()}
    files["batches.meta"] = {"label_names": [f"class{c}" for c in range(10)]}
    contents = {name: pickle.dumps(value, protocol=2) for name, value in files.items()}
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as tar:
        folder = tarfile.TarInfo("cifar-10-batches-py")
        folder.type, folder.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(folder)
        for name, data in contents.items():
            member = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            member.size, member.mode = len(data), 0o644
            tar.addfile(member, io.BytesIO(data))
    md5 = {name: hashlib.md5(data).hexdigest() for name, data in contents.items()}
    checksums = {"train_list": [[f"data_batch_{i}", md5[f"data_batch_{i}"]] for i in range(1, 6)],
                 "test_list": [["test_batch", md5["test_batch"]]],
                 "meta": {"filename": "batches.meta", "key": "label_names", "md5": md5["batches.meta"]},
                 "tgz_md5": hashlib.md5(buffer.getvalue()).hexdigest()}
    return buffer.getvalue(), checksums, contents


class MlflowServer:
    """A real MLflow tracking server (docker/mlflow_server.py, as `make mlflow` runs it, from the environment
    `make mlflow-setup` makes), its store in `root`; stop() kills it, start() brings it back on the same
    store and port. exposed: a team server (MLFLOW_EXPOSE=1) on every interface with a login; login: the same
    login on 127.0.0.1 (MLFLOW_AUTH=1); either way the admin's password is in `root`/admin-password
    (set_password() writes another) and `credentials` are what a client passes. env: more of the server's
    settings (MLFLOW_BACKEND_STORE_URI, ...)."""

    def __init__(self, root: Path, port: int, exposed: bool = False, login: bool = False, env: dict | None = None):
        self.root, self.port, self.proc, self.exposed, self.login = root, port, None, exposed, login or exposed
        self.uri = f"http://127.0.0.1:{port}"
        self.env = env or {}
        self.credentials: dict[str, str] = {}
        if self.login:
            self.set_password(base64.urlsafe_b64encode(os.urandom(18)).decode())

    def set_password(self, password: str) -> None:
        """Write the admin's password file (the server takes it at its next start)."""
        path = self.root / "admin-password"
        path.write_text(password + "\n")
        path.chmod(0o600)
        self.credentials = {"MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": password}

    def start(self) -> None:
        venv = REPO / ".venv-mlflow" / "bin"
        env = {**env_for_tests(MLFLOW_PORT=str(self.port)), "PATH": f"{venv}{os.pathsep}{os.environ['PATH']}"}
        for key in ("MLFLOW_EXPOSE", "MLFLOW_BIND", "MLFLOW_AUTH", "MLFLOW_ADMIN_PASSWORD_FILE",
                    "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_BACKEND_STORE_URI"):
            env.pop(key, None)
        if self.login:
            env.update({"MLFLOW_EXPOSE" if self.exposed else "MLFLOW_AUTH": "1",
                        "MLFLOW_ADMIN_PASSWORD_FILE": str(self.root / "admin-password")})
        env.update(self.env)
        log = open(self.root / "server.log", "a")
        self.proc = subprocess.Popen([str(venv / "python"), str(REPO / "docker" / "mlflow_server.py"), str(self.root)],
                                     env=env, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if urllib.request.urlopen(f"{self.uri}/health", timeout=2).read() == b"OK":
                    return
            except OSError:
                time.sleep(0.5)
            if self.proc.poll() is not None:
                break
        raise AssertionError(f"the MLflow server did not start: {(self.root / 'server.log').read_text()[-3000:]}")

    def freeze(self, frozen: bool) -> None:
        """Stop the whole server where it stands (SIGSTOP: it accepts connections and never answers, as a
        hung server does), or let it go on."""
        os.killpg(self.proc.pid, signal.SIGSTOP if frozen else signal.SIGCONT)

    def stop(self) -> None:
        """The whole server (its workers too), at once, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def byte_level_tokenizer(texts: list[str], path: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE tokenizer.json trained here on `texts` (tokenizers' own trainer: no download), as a team's
    would be: its merges, a byte-level pre-tokenizer and decoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(path))
    return path
