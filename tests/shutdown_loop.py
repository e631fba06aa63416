"""The end of a multi-rank run, again and again: does every run that logged `done` also exit? For whoever changes the
shutdown (Trainer.release, distributed.teardown, errors.end_process): run it before and after.

  python -m tests.shutdown_loop                          50 runs each of --spawn 3 plain, --static-graph, --compile
  python -m tests.shutdown_loop --runs 10 --variants compile --parallel 3 --out runs/shutdown-a

Runs --parallel of them at a time (default 2: on a 2-core machine both cores stay busy, the load a CI machine
has). A run that has not exited --timeout seconds after it started is a hang: its processes are listed with the
kernel function each waits in, then sent SIGABRT (every trainbox worker's faulthandler prints all its threads'
stacks), then SIGKILL; its output and the stacks go to OUT/<variant>-<n>.log. Prints a line per run and the counts
(runs, exits 0, hangs, other failures) per variant; exit 0 when every run ended with code 0 and status.json done.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.helpers import PY, end_hung, env_for_tests
from train.files.rundir import read_status

VARIANTS = {"plain": [], "static-graph": ["--static-graph"], "compile": ["--compile"]}
# Short runs: the end of the run is what is tested. An evaluation and a checkpoint at the end, as in every run.
ARGS = ["--preset", "debug", "--max-steps", "6", "--save-every", "3", "--eval-every", "3", "--log-every", "3"]


def one_run(variant: str, index: int, out: Path, timeout: float, workers: int) -> tuple[str, float]:
    """(outcome, seconds): ok, hang (the stacks in the log), or failed (exit code and state)."""
    run_dir = out / f"{variant}-{index}"
    cmd = [PY, "-m", "train", *ARGS, *VARIANTS[variant], "--spawn", str(workers), "--run-dir", str(run_dir)]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env=env_for_tests(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        outcome = "ok" if proc.returncode == 0 and read_status(run_dir).get("state") == "done" else \
            f"failed (exit {proc.returncode}, {read_status(run_dir).get('state')})"
    except subprocess.TimeoutExpired:
        stdout, stderr = end_hung(proc)
        done = read_status(run_dir).get("state") == "done"
        outcome = f"hang ({'after' if done else 'before'} status done)"
    seconds = time.monotonic() - started
    (out / f"{variant}-{index}.log").write_text(f"$ {' '.join(cmd)}\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    return outcome, seconds


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.shutdown_loop", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="runs of each variant (default 50)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated: {', '.join(VARIANTS)}")
    parser.add_argument("--workers", type=int, default=3, help="--spawn N (default 3)")
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time (default 2)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds before a run counts as hung")
    parser.add_argument("--out", type=Path, help="run folders and logs (default: a new temporary folder)")
    ns = parser.parse_args(argv)
    variants = [v for v in ns.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or ns.runs < 1 or ns.parallel < 1:
        print(f"error: --variants {ns.variants!r} --runs {ns.runs} --parallel {ns.parallel}: give variants of "
              f"{', '.join(VARIANTS)}, and counts of 1 or more", file=sys.stderr)
        return 2
    out = ns.out or Path(tempfile.mkdtemp(prefix="shutdown-loop-"))
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(v, i) for i in range(ns.runs) for v in variants]  # interleaved: the variants share the load alike
    counts = {v: {"runs": 0, "ok": 0, "hang": 0, "failed": 0} for v in variants}
    print(f"shutdown loop: {ns.runs} x {variants}, --spawn {ns.workers}, {ns.parallel} at a time, in {out}",
          flush=True)
    with ThreadPoolExecutor(ns.parallel) as pool:
        futures = {pool.submit(one_run, v, i, out, ns.timeout, ns.workers): (v, i) for v, i in jobs}
        for future in futures:
            variant, index = futures[future]
            outcome, seconds = future.result()
            counts[variant]["runs"] += 1
            counts[variant][outcome.split()[0]] += 1
            print(f"{variant}-{index}: {outcome} in {seconds:.1f} s", flush=True)
    for variant, c in counts.items():
        print(f"{variant}: runs={c['runs']} ok={c['ok']} hangs={c['hang']} failed={c['failed']}")
    return 0 if all(c["ok"] == c["runs"] for c in counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
