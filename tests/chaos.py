"""make chaos: a drill of real faults. Each trial starts a run of 2 or 4 workers on the default path (no
--deterministic), hits it once at a random moment (mid-step, during a checkpoint save, during an
evaluation, during shutdown) and checks that it still ends with model.pt and its final validation figures
bit-identical to a run of as many workers that was never hit.

  python -m tests.chaos                                  20 trials per launcher, fault and world size
  python -m tests.chaos --trials 5 --launchers torchrun --faults kill --workers 4
  python -m tests.chaos --out runs/chaos-a --seed 7      trial folders, logs and results.json there
  python -m tests.chaos --recipe                         the runs with a published recipe's knobs on
  python -m tests.chaos --task segmentation              the runs of the built-in segmentation task
  python -m tests.chaos --task lm                        the runs of the built-in language model (gpt-tiny, copy)
  python -m tests.chaos --task lm --parallel fsdp        ... its model sharded over the workers (FSDP2)
  python -m tests.chaos --task lm --parallel fsdp --checkpoint-format sharded   ... each worker saving its shards
  python -m tests.chaos --task lm --parallel fsdp --precision bf16              ... in FSDP2's bf16 mixed precision

Faults:
  kill    kill -9 of a random worker; the launcher's restarts must bring the run back
  signal  SIGTERM or SIGUSR2 to a worker or the launcher (make: Ctrl-C's SIGINT to the whole process
          group; Slurm: the preemption notice, USR2 to the batch shell): the run stops at a checkpoint,
          then the same command resumes it (Slurm requeues a preempted job by itself)
Launchers:
  torchrun  `torchrun --standalone --max-restarts=3 --nproc-per-node=N -m train ...` as the tutorials call
            it: TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset, and no --run-dir in kill trials (the restarts
            must find their own run directory)
  make      `make train GPUS=N RUNTIME=local ARGS=...`
  slurm     `sbatch slurm/multinode.sh` on the 2-node test cluster (tests/cluster/up.sh; needs root and
            slurm-wlm + munge, and no other test cluster running), N/2 workers per node
World sizes (--workers): 2 and 4. With more than 2 workers the all-reduce's sums depend on DDP's bucket
layout, which every attempt settles before its first step (train/run/exact.py: settle_buckets).

Prints every trial, then ok=N/N per launcher, fault and world size with the recovery times, then the failures with
the end of their logs. Exit 0 when every trial ended bit-identical, 1 otherwise.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tests.processes import alive, cmdline, descendants, environ, in_session, pids, rank_of
from train.files.rundir import read_json, read_metrics, read_status

PY = sys.executable
REPO = Path(__file__).resolve().parents[1]
MAX_STEPS, SAVE_EVERY, EVAL_EVERY = 24, 3, 8
# A short run: 24 steps, a checkpoint every 3 and an evaluation every 8; one thread per worker whatever the
# launcher gives it (all workers on one node or half on each), so every launcher computes the same bits.
ARGS = ["--preset", "debug", "--seed", "5", "--batch-size", "8", "--max-steps", str(MAX_STEPS),
        "--save-every", str(SAVE_EVERY), "--eval-every", str(EVAL_EVERY), "--log-every", "1", "--timeout-s", "60",
        "--threads", "1"]
# --recipe: a published recipe's state on top (the EMA and its count, Mixup/CutMix, random erasing and label
# smoothing): everything it adds to a checkpoint must come back as well.
RECIPE = ["--model-ema", "--model-ema-steps", "2", "--model-ema-decay", "0.9", "--mixup-alpha", "0.2",
          "--cutmix-alpha", "1.0", "--random-erase", "0.25", "--label-smoothing", "0.1"]
MOMENTS = ("step", "save", "eval", "shutdown")
LAUNCHERS = ("torchrun", "make", "slurm")
FAULTS = ("kill", "signal")
WORKERS = (2, 4)
TRIAL_TIMEOUT_S = {"torchrun": 300, "make": 300, "slurm": 900}


# ---------------------------------------------------------------- what the run directory says

def steps(run_dir: Path, kind: str) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir, kind)]


def saving(run_dir: Path, at_least: int) -> bool:
    return any(int(re.search(r"step_(\d+)", p.name).group(1)) >= at_least
               for p in (run_dir / "checkpoints").glob(".step_*.tmp*"))  # a file's or a sharded folder's


def evaluating(run_dir: Path, at_least: int) -> bool:
    """Between the train record of an evaluation step (and, at the last step, the final checkpoint)
    and its eval record."""
    trained, evaluated = steps(run_dir, "train"), set(steps(run_dir, "eval"))
    for s in (s for s in trained if s >= at_least and s % EVAL_EVERY == 0 or s == MAX_STEPS):
        saved = (run_dir / "checkpoints" / f"step_{s:08d}.pt.crc32").exists() or \
            (run_dir / "checkpoints" / f"step_{s:08d}.dcp" / "CHECKSUMS").exists()
        if s not in evaluated and (s < MAX_STEPS or saved):
            return True
    return False


def check(run_dir: Path, reference: Path) -> str | None:
    """None when the run ended as the reference did, else what differs."""
    st, ref = read_status(run_dir), read_status(reference)
    if st.get("state") != "done":
        return f"status.json says {st.get('state')!r} at step {st.get('step')}, not done"
    model = run_dir / "model.pt"
    if not model.is_file() or model.read_bytes() != (reference / "model.pt").read_bytes():
        return "model.pt differs from the uninterrupted run"
    ema = run_dir / "model_ema.pt"
    if (reference / "model_ema.pt").is_file() and (not ema.is_file() or ema.read_bytes() !=
                                                   (reference / "model_ema.pt").read_bytes()):
        return "model_ema.pt differs from the uninterrupted run"
    figures = {k: (st.get(k), ref[k]) for k in ref if k.startswith("val_") and st.get(k) != ref[k]}
    if figures:
        return f"final validation figures differ (this run, uninterrupted): {figures}"
    logged = steps(run_dir, "train")
    if logged != sorted(set(logged)) or not logged or logged[-1] != MAX_STEPS:
        return "metrics.jsonl does not hold each step once"
    return None


# ---------------------------------------------------------------- launchers

class Local:
    """torchrun or make on this machine: the launcher and everything it starts are one session."""

    def __init__(self, name: str, out: Path, extra: list[str]):
        self.name, self.out, self.workers, self.extra = name, out, 2, extra

    def command(self, trial: Path, run_dir: Path | None) -> list[str]:
        args = [*ARGS, *self.extra, *(["--run-dir", str(run_dir)] if run_dir else [])]
        if self.name == "torchrun":
            return [PY, "-m", "torch.distributed.run", "--standalone", "--max-restarts=3",
                    f"--nproc-per-node={self.workers}", "-m", "train", *args]
        return ["make", "-C", str(REPO), "--no-print-directory", "train", f"GPUS={self.workers}", "RUNTIME=local",
                "ARGS=" + " ".join(args)]

    def start(self, trial: Path, kind: str, run_dir: Path | None, log_name: str) -> dict:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        for key in [k for k in env if k.startswith(("SLURM_", "TORCHELASTIC_")) or k in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "GPUS", "ARGS", "MAX_RESTARTS")]:
            env.pop(key)
        log = open(trial / log_name, "w")
        proc = subprocess.Popen(self.command(trial, run_dir), cwd=trial, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        return {"proc": proc, "log": log, "run_dir": run_dir, "trial": trial}

    def run_dir(self, handle: dict) -> Path | None:
        if handle["run_dir"] is None:  # plain torchrun names it runs/<its start time>
            found = sorted((handle["trial"] / "runs").glob("*"))
            return found[0] if found else None
        return handle["run_dir"]

    def worker(self, handle: dict, rank: int) -> int | None:
        for pid in descendants(handle["proc"].pid):  # torchrun's children, or make train's fork server's
            if rank_of(pid) == str(rank):
                return pid
        return None

    def signal_target(self, handle: dict, rng: random.Random) -> tuple[str, int, signal.Signals]:
        """(description, pid, signal): a negative pid is a process group."""
        proc = handle["proc"]
        ranks = [f"rank {r}" for r in range(self.workers)]
        if self.name == "torchrun":  # plain torchrun passes on SIGTERM only; SIGUSR2 would kill it alone
            choice = rng.choice(["torchrun", *ranks])
            sig = signal.SIGTERM if choice == "torchrun" else rng.choice([signal.SIGTERM, signal.SIGUSR2])
            pid = proc.pid if choice == "torchrun" else self.worker(handle, int(choice[5:]))
            return choice, pid, sig
        choice = rng.choice(["launcher", *ranks, "process group"])
        if choice == "process group":  # Ctrl-C in the terminal of `make train`
            return choice, -proc.pid, signal.SIGINT
        sig = rng.choice([signal.SIGTERM, signal.SIGUSR2])
        if choice == "launcher":
            pid = next((p for p in descendants(proc.pid) if "-m train.launch" in cmdline(p)), None)
            return "the launcher (python -m train.launch)", pid, sig
        return choice, self.worker(handle, int(choice[5:])), sig

    def running(self, handle: dict) -> bool:
        return handle["proc"].poll() is None

    def wait(self, handle: dict, timeout: float) -> str | None:
        """None once the launcher and everything it started have ended, else why not."""
        proc, deadline = handle["proc"], time.monotonic() + timeout
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop(handle)
            return f"still running after {timeout:.0f} s (killed)"
        finally:
            handle["log"].close()
        while in_session(proc.pid) and time.monotonic() < deadline:  # orphaned workers, if any
            time.sleep(0.05)
        if in_session(proc.pid):
            self.stop(handle)
            return f"{self.name} exited ({proc.returncode}) but its workers did not"
        handle["code"] = proc.returncode
        return None

    def stop(self, handle: dict) -> None:
        for pid in in_session(handle["proc"].pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        handle["proc"].wait()

    def exit_ok(self, handle: dict) -> bool:
        return handle.get("code") == 0

    def stop_code_problem(self, handle: dict, target: str, log: str) -> str | None:
        """Whether the launcher ended as a stop makes it end, or why not. torchrun: 0 when its workers stopped (a
        stop is a clean end for it; status.json says stopped), its own failure code when the signal was its own;
        make: the launcher's 75, reported by make as a failed recipe (Ctrl-C to the process group interrupts make
        itself, which then reports the interrupt)."""
        code = handle.get("code")
        if self.name == "torchrun":
            expected = "non-zero" if target.endswith("to torchrun") else 0
            ok = code != 0 if expected == "non-zero" else code == 0
        elif "process group" in target:
            expected, ok = "non-zero", code not in (0, None)
        else:
            expected, ok = "2 with make's 'Error 75'", code == 2 and "Error 75" in log
        return None if ok else f"{self.name} exited {code}, not {expected}, after the stop"


class Slurm:
    """sbatch slurm/multinode.sh on the 2-node test cluster, half the workers on each node."""

    name, workers = "slurm", 2
    TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")

    def __init__(self, out: Path, extra: list[str]):
        self.out, self.extra = out, extra
        self.lab = Path(os.environ.get("TMPDIR", "/tmp")) / "trainbox-chaos-cluster"
        self.env = {**os.environ, "LAB": str(self.lab), "SLURM_CONF": str(self.lab / "slurm.conf")}
        self.runs = out / "slurm-runs"

    def available(self) -> str | None:
        missing = [t for t in ("slurmctld", "slurmd", "munged", "sbatch") if not shutil.which(t)]
        if os.geteuid() != 0 or missing:
            return "needs root and slurm-wlm + munge (apt-get install slurm-wlm munge)"
        return None

    def up(self) -> None:
        subprocess.run(["bash", str(REPO / "tests/cluster/down.sh")], env=self.env, capture_output=True)
        up = subprocess.run(["bash", str(REPO / "tests/cluster/up.sh")], env=self.env, capture_output=True,
                            text=True, timeout=300)
        if up.returncode:
            raise RuntimeError(f"the test cluster did not start: {(up.stdout + up.stderr)[-2000:]}")
        self.runs.mkdir(parents=True, exist_ok=True)

    def down(self) -> None:
        subprocess.run(["bash", str(REPO / "tests/cluster/down.sh")], env=self.env, capture_output=True)

    def start(self, trial: Path, kind: str, run_dir: Path | None, log_name: str) -> dict:
        name = run_dir.name if run_dir is not None and run_dir.parent == self.runs else trial.name
        env = {**self.env, "RUNS_DIR": str(self.runs), "RUN_NAME": name, "PYTHON": PY,
               "NPROC_PER_NODE": str(self.workers // 2)}
        log = trial / log_name
        proc = subprocess.run(["sbatch", "--parsable", "--nodes=2", f"--output={log}", str(REPO / "slurm/multinode.sh"),
                               *ARGS, *self.extra], cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"sbatch failed: {proc.stderr.strip()}")
        return {"job": proc.stdout.strip().split(";")[0], "run_dir": self.runs / name, "log_path": log}

    def run_dir(self, handle: dict) -> Path:
        return handle["run_dir"]

    def worker(self, handle: dict, rank: int) -> int | None:
        for pid in pids():
            env = environ(pid)
            if env.get("SLURM_JOB_ID") == handle["job"] and env.get("RANK") == str(rank) and \
                    "TORCHELASTIC_RUN_ID" in env:
                return pid
        return None

    def signal_target(self, handle: dict, rng: random.Random) -> tuple[str, int | None, signal.Signals]:
        if rng.random() < 0.5:
            return "the batch shell (preemption notice)", None, signal.SIGUSR2
        rank = rng.randrange(self.workers)
        return f"rank {rank}", self.worker(handle, rank), signal.SIGTERM

    def job(self, handle: dict) -> dict:
        out = subprocess.run(["scontrol", "show", "job", handle["job"]], env=self.env, capture_output=True,
                             text=True).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def running(self, handle: dict) -> bool:
        return self.job(handle).get("JobState") not in self.TERMINAL

    def send(self, handle: dict, sig: signal.Signals) -> None:
        subprocess.run(["scancel", f"--signal={sig.name[3:]}", "--batch", handle["job"]], env=self.env, check=True)

    def wait(self, handle: dict, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(handle)
            if info.get("JobState") in self.TERMINAL:
                handle["info"] = info
                return None
            time.sleep(0.5)
        subprocess.run(["scancel", handle["job"]], env=self.env)
        return f"job {handle['job']} still {self.job(handle).get('JobState')} after {timeout:.0f} s (cancelled)"

    def stop(self, handle: dict) -> None:
        subprocess.run(["scancel", "--signal=KILL", handle["job"]], env=self.env)

    def exit_ok(self, handle: dict) -> bool:
        return handle.get("info", {}).get("JobState") == "COMPLETED"

    def stop_code_problem(self, handle: dict, target: str, log: str) -> str | None:
        """A stop that is not a preemption: the job ends with the run's 75, not requeued."""
        info = handle.get("info", {})
        if info.get("ExitCode") == "75:0" and "stopped at a checkpoint, not requeued" in log:
            return None
        return f"job {handle['job']} ended {info.get('JobState')} with {info.get('ExitCode')}, not 75 unrequeued"


# ---------------------------------------------------------------- one trial

@dataclass
class Trial:
    launcher: str
    fault: str
    workers: int
    index: int
    moment: str
    target: str = ""
    landed: bool = False
    ok: bool = False
    problem: str = ""
    recovery_s: float | None = None
    folder: str = ""
    logs: list[str] = field(default_factory=list)


def wait_for_moment(launcher, handle: dict, moment: str, rng: random.Random, victim_pids: dict):
    """Poll until the run is at `moment`; return its description and a check that the run still is there
    (None, None: the run ended first)."""
    after = rng.randrange(3, MAX_STEPS - 3)
    first_save = rng.choice(range(2 * SAVE_EVERY, MAX_STEPS + 1, SAVE_EVERY))
    first_eval = rng.choice(range(EVAL_EVERY, MAX_STEPS + 1, EVAL_EVERY))
    running = lambda d: read_status(d).get("state") == "running"  # noqa: E731
    what, reached, still = {
        "step": (f"mid-run after step {after}", lambda d: (steps(d, "train") or [0])[-1] >= after and running(d),
                 running),
        "save": (f"during a checkpoint save (step >= {first_save})", lambda d: saving(d, first_save),
                 lambda d: saving(d, first_save)),
        "eval": (f"during an evaluation (step >= {first_eval})", lambda d: evaluating(d, first_eval),
                 lambda d: evaluating(d, first_eval)),
        "shutdown": ("during shutdown (status.json done)", lambda d: read_status(d).get("state") == "done",
                     lambda d: any(alive(p) for p in victim_pids.values() if p)),
    }[moment]
    asked = -1.0
    while True:
        if time.monotonic() - asked > 0.2:  # asking Slurm takes a while: not on every poll
            if not launcher.running(handle):
                return None, None
            asked = time.monotonic()
        run_dir = launcher.run_dir(handle)
        if run_dir is None or not steps(run_dir, "train"):
            time.sleep(0.002)
            continue
        if not victim_pids:
            victim_pids.update({r: launcher.worker(handle, r) for r in range(launcher.workers)})
        if reached(run_dir):
            if moment == "step":
                time.sleep(rng.uniform(0, 0.005))
            return what, functools.partial(still, run_dir)
        time.sleep(0.001)


def back_to_training(run_dir: Path, hit: float) -> float | None:
    """When the attempt that resumed after the fault trained its first step (None: it had none to train).
    Records of later steps from before the fault were dropped by the resume, so any step past the one
    it resumed from is its own."""
    try:
        resumed = read_json(run_dir / "manifest.json")["resumed_from_step"] or 0
    except KeyError:
        return None
    return next((r["time"] for r in read_metrics(run_dir, "train") if r["step"] > resumed
                 and r["time"] > hit), None)


def newest_checkpoint(run_dir: Path) -> int | None:
    """The step of the newest complete checkpoint (a file with its size-and-CRC32 sidecar, or a sharded folder: renamed
    into place once complete, its CHECKSUMS in it)."""
    done = [int(p.name[5:13]) for p in (run_dir / "checkpoints").glob("step_*.pt")
            if (p.parent / f"{p.name}.crc32").exists()]
    done += [int(p.name[5:13]) for p in (run_dir / "checkpoints").glob("step_*.dcp") if (p / "CHECKSUMS").exists()]
    return max(done, default=None)


def stop_problem(launcher, handle: dict, run_dir: Path, target: str, hit: float, preemption: bool) -> str | None:
    """None when the signal stopped the run as a stop must, else what went wrong: every rank at one step, that
    step's checkpoint saved and named in the log, status.json 'stopped' with exit code 75 at that step, and the
    launcher's own code for a stop (a preemption instead requeues the job, which resumes from that checkpoint).
    A signal after the last step has nothing to stop: the run finishes."""
    status, log = read_status(run_dir), (run_dir / "train.log").read_text(errors="replace")
    last = next((r for r in read_metrics(run_dir, "train") if r["step"] == MAX_STEPS), None)
    saved = [int(m) for m in re.findall(r"saving at step (\d+) and exiting with code 75", log)]
    if not saved:
        if status.get("state") == "done" and last is not None and last["time"] < hit:
            return None  # the signal came after training ended: the final save, evaluation or shutdown
        return (f"after {target} no rank saved and exited with 75: status.json says {status.get('state')!r} at step "
                f"{status.get('step')}")
    step = saved[0]
    if preemption:
        resumed = re.search(r"resumed from \S*step_(\d+)\.pt", log)
        if "requeueing job" not in handle_log(launcher, handle) or not resumed or int(resumed.group(1)) != step:
            return f"the preemption stopped the run at step {step}, but the job was not requeued to resume from it"
        return None
    if (status.get("state"), status.get("exit_code"), status.get("step")) != ("stopped", 75, step):
        return (f"the stop saved step {step}, but status.json says {status.get('state')!r} at step "
                f"{status.get('step')} with exit code {status.get('exit_code')}, not stopped at {step} with 75")
    if newest_checkpoint(run_dir) != step:
        return f"the stop at step {step} left step {newest_checkpoint(run_dir)} as the newest complete checkpoint"
    return launcher.stop_code_problem(handle, target, handle_log(launcher, handle))


def handle_log(launcher, handle: dict) -> str:
    path = handle.get("log_path") or Path(handle["log"].name)
    return Path(path).read_text(errors="replace") if Path(path).exists() else ""


def run_trial(launcher, fault: str, index: int, rng: random.Random, out: Path, reference: Path,
              moment: str) -> Trial:
    trial = Trial(launcher.name, fault, launcher.workers, index, moment)
    folder = out / f"{launcher.name}-{fault}-{launcher.workers}w-{index:02d}"
    folder.mkdir(parents=True)
    trial.folder = str(folder)
    # Plain torchrun names the run directory itself in kill trials; a resume needs it named.
    given = None if (launcher.name == "torchrun" and fault == "kill") else folder / "run"
    timeout = TRIAL_TIMEOUT_S[launcher.name]
    handle = launcher.start(folder, fault, given, "attempt-1.log")
    trial.logs.append(str(folder / "attempt-1.log"))
    victims: dict = {}
    what, still = wait_for_moment(launcher, handle, moment, rng, victims)
    if what is None:
        launcher.wait(handle, timeout)
        trial.problem = f"the run ended before the moment ({moment}) came: nothing was injected"
        return trial
    if fault == "kill":
        rank = rng.randrange(launcher.workers)
        pid = victims.get(rank)
        trial.target = f"kill -9 rank {rank}"
        trial.landed = bool(pid) and alive(pid) and still()
        if pid:
            os.kill(pid, signal.SIGKILL)
    else:
        description, pid, sig = launcher.signal_target(handle, rng)
        trial.target = f"{sig.name} to {description}"
        trial.landed = still()
        if pid is None and launcher.name == "slurm" and sig == signal.SIGUSR2:
            launcher.send(handle, sig)
        elif pid and pid < 0:
            os.killpg(-pid, sig)
        elif pid:
            os.kill(pid, sig)
    hit = time.time()
    trial.moment = what
    problem = launcher.wait(handle, timeout)
    run_dir = launcher.run_dir(handle)
    preemption = launcher.name == "slurm" and "preemption" in trial.target
    if not problem and fault == "signal":
        problem = stop_problem(launcher, handle, run_dir, trial.target, hit, preemption)
    resumed = fault == "signal" and not preemption
    if not problem and resumed:  # the same command resumes a stopped run from its checkpoint (or finds it done)
        stopped_at = read_status(run_dir).get("step") if read_status(run_dir).get("state") == "stopped" else None
        handle = launcher.start(folder, fault, run_dir, "attempt-2.log")
        trial.logs.append(str(folder / "attempt-2.log"))
        problem = launcher.wait(handle, timeout)
        began = read_json(run_dir / "manifest.json").get("resumed_from_step")
        if not problem and stopped_at is not None and began != stopped_at:
            problem = f"the run stopped at step {stopped_at}, but the same command resumed it from {began}"
    if not problem and not launcher.exit_ok(handle):
        problem = f"the {'resumed ' if resumed else ''}run did not end cleanly " \
                  f"({handle.get('code', handle.get('info', {}).get('JobState'))})"
    ended = time.time()  # for a fault after the last step: the run ended instead of training again
    trial.problem = problem or check(run_dir, reference) or ""
    trial.ok = not trial.problem
    back = back_to_training(run_dir, hit) if run_dir else None
    trial.recovery_s = round((back or ended) - hit, 2)
    return trial


# ---------------------------------------------------------------- the drill

def reference_run(out: Path, workers: int, extra: list[str]) -> Path:
    run_dir = out / f"reference-{workers}w"
    proc = subprocess.run([PY, "-m", "train", *ARGS, *extra, "--spawn", str(workers), "--run-dir", str(run_dir)],
                          cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode:
        raise RuntimeError(f"the uninterrupted reference run failed:\n{proc.stderr[-3000:]}")
    return run_dir


def summary(trials: list[Trial], skipped: dict) -> list[str]:
    lines = [f"{'launcher':<9} {'fault':<7} {'workers':>7} {'ok':>7} {'landed':>7}  training again after s "
             f"(median, max)"]
    for name in dict.fromkeys(t.launcher for t in trials):
        for fault, workers in dict.fromkeys((t.fault, t.workers) for t in trials if t.launcher == name):
            group = [t for t in trials if (t.launcher, t.fault, t.workers) == (name, fault, workers)]
            times = [t.recovery_s for t in group if t.recovery_s is not None]
            spread = f"{statistics.median(times):.1f}, {max(times):.1f}" if times else "-"
            lines.append(f"{name:<9} {fault:<7} {workers:>7} {sum(t.ok for t in group):>3}/{len(group):<3} "
                         f"{sum(t.landed for t in group):>3}/{len(group):<3}  {spread}")
        group = [t for t in trials if t.launcher == name]
        lines.append(f"{name}: ok={sum(t.ok for t in group)}/{len(group)}")
    lines += [f"{name}: skipped ({why})" for name, why in skipped.items()]
    return lines


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str], list[str], list[int], Path]:
    """The drill's arguments, or SystemExit(2) after one line naming what is wrong."""
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20,
                        help="trials per launcher, fault and world size (default 20)")
    parser.add_argument("--launchers", default=",".join(LAUNCHERS), help="comma-separated: " + ", ".join(LAUNCHERS))
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated: " + ", ".join(FAULTS))
    parser.add_argument("--workers", default=",".join(map(str, WORKERS)),
                        help="comma-separated world sizes, even for slurm (half on each node): default 2,4")
    parser.add_argument("--recipe", action="store_true", help="train with a published recipe's knobs on (EMA, "
                        "Mixup/CutMix, random erasing, label smoothing)")
    parser.add_argument("--task", default="classification", choices=("classification", "segmentation", "lm"),
                        help="the built-in task the runs train (segmentation: the shapes' masks, torchvision's "
                             "lraspp_mobilenet_v3_large; lm: gpt-tiny on the generated copy documents)")
    parser.add_argument("--parallel", default="ddp", choices=("ddp", "fsdp"),
                        help="how the runs spread the model over the workers (fsdp: sharded, FSDP2)")
    parser.add_argument("--checkpoint-format", default="full", choices=("full", "sharded"),
                        help="how the runs save their checkpoints (sharded: each worker its shards, --parallel fsdp)")
    parser.add_argument("--precision", choices=("bf16",), help="bf16: FSDP2's mixed precision (bf16 parameters, "
                        "fp32 reduction; on a CPU with --parallel fsdp alone)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the victims and moments")
    parser.add_argument("--out", default=time.strftime("runs/chaos-%Y%m%d-%H%M%S"), help="output folder")
    parser.add_argument("--reference", help="an uninterrupted run of the drill's settings at its one --workers "
                        "size to compare the trials with, instead of training one")
    ns = parser.parse_args(argv)
    launchers = [x for x in ns.launchers.split(",") if x]
    faults = [x for x in ns.faults.split(",") if x]
    sizes = [x for x in ns.workers.split(",") if x]
    even = "slurm" in launchers  # Slurm puts half the workers on each of its 2 nodes
    out = Path(ns.out).resolve()
    bad = [x for x in launchers if x not in LAUNCHERS] + [x for x in faults if x not in FAULTS]
    if bad or ns.trials < 1:
        problem = (f"unknown launcher or fault {bad} (or --trials < 1): use --launchers {','.join(LAUNCHERS)} "
                   f"--faults {','.join(FAULTS)}")
    elif not sizes or not all(x.isdigit() and int(x) >= 2 and (int(x) % 2 == 0 or not even) for x in sizes):
        problem = (f"--workers {ns.workers!r}: give world sizes of at least 2{', even for slurm' if even else ''}, "
                   f"e.g. --workers 2,4")
    elif re.search(r"\s", str(out)):
        problem = f"--out {out} contains whitespace (make's ARGS would split it): choose another folder"
    elif out.exists() and any(out.iterdir()):
        problem = f"{out} is not empty: pass a new --out"
    elif ns.recipe and ns.task != "classification":
        problem = "--recipe's knobs (Mixup/CutMix, random erasing, label smoothing) are classification's: drop --task"
    elif ns.recipe and ns.parallel == "fsdp":
        problem = "--recipe's EMA is not available with --parallel fsdp (docs/training.md): drop one of them"
    elif ns.checkpoint_format == "sharded" and ns.parallel != "fsdp":
        problem = "--checkpoint-format sharded writes each worker's shards of a sharded model: add --parallel fsdp"
    elif ns.precision and ns.parallel != "fsdp":
        problem = "--precision bf16 on a CPU is FSDP2's mixed-precision policy: add --parallel fsdp"
    elif ns.reference and (len(sizes) != 1 or not (Path(ns.reference) / "model.pt").is_file()):
        problem = f"--reference {ns.reference}: give the model.pt folder of a finished run and a single --workers"
    else:
        return ns, launchers, faults, [int(x) for x in sizes], out
    print(f"error: {problem}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str]) -> int:
    try:
        ns, launchers, faults, sizes, out = parse(argv)
    except SystemExit as e:
        return int(e.code or 0)
    out.mkdir(parents=True, exist_ok=True)
    print(f"chaos: {ns.trials} trial(s) x {faults} x {launchers} x {sizes} workers{' (recipe)' if ns.recipe else ''}"
          f"{f' ({ns.task})' if ns.task != 'classification' else ''}"
          f"{f' (--parallel {ns.parallel})' if ns.parallel != 'ddp' else ''}"
          f"{f' (--precision {ns.precision})' if ns.precision else ''}, seed {ns.seed}, in {out}", flush=True)
    extra = RECIPE if ns.recipe else ["--task", ns.task] if ns.task != "classification" else []
    extra += ["--parallel", ns.parallel] if ns.parallel != "ddp" else []
    extra += ["--checkpoint-format", ns.checkpoint_format] if ns.checkpoint_format != "full" else []
    extra += ["--precision", ns.precision] if ns.precision else []
    references = {n: Path(ns.reference).resolve() if ns.reference else reference_run(out, n, extra) for n in sizes}
    rng = random.Random(ns.seed)
    trials, skipped = [], {}
    for name in launchers:
        launcher = Slurm(out, extra) if name == "slurm" else Local(name, out, extra)
        if name == "slurm":
            why = launcher.available()
            if why:
                skipped[name] = why
                print(f"{name}: skipped ({why})", flush=True)
                continue
            launcher.up()
        try:
            for fault, workers in ((f, n) for f in faults for n in sizes):
                launcher.workers = workers
                for index in range(ns.trials):  # the moments go round the whole drill: a short one covers them all
                    moment = MOMENTS[len(trials) % len(MOMENTS)]
                    trial = run_trial(launcher, fault, index, rng, out, references[workers], moment)
                    trials.append(trial)
                    verdict = "ok" if trial.ok else f"FAILED: {trial.problem}"
                    print(f"{name} {fault} {workers}w #{index}: {trial.target or '-'} {trial.moment}"
                          f"{'' if trial.landed else ' (landed after the moment)'}: {verdict}, "
                          f"training again {trial.recovery_s} s after it", flush=True)
        finally:
            if name == "slurm":
                launcher.down()
    (out / "results.json").write_text(json.dumps([asdict(t) for t in trials], indent=1) + "\n")
    print("\n".join(["", *summary(trials, skipped)]))
    for t in (t for t in trials if not t.ok):
        print(f"\n--- {t.launcher} {t.fault} {t.workers}w #{t.index} failed: {t.problem}")
        for log in t.logs:
            text = Path(log).read_text(errors="replace") if Path(log).exists() else "(no log)"
            print(f"--- {log} (last 40 lines)\n" + "\n".join(text.splitlines()[-40:]))
    return 0 if trials and all(t.ok for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
