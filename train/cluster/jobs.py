"""The cluster logic of every launch, in one place and standard library only (the batch shell's or the cloud
node's bare python3 runs it from the checkout): hostlists, ports, torchrun's flags and environment, and the
jobs of the Slurm template and the SkyPilot task (what each node starts: its shell assignments).

  python3 -m train.cluster job -- TRAINER ARGS  for slurm/multinode.sh, shell assignments: NNODES,
                                                 NPROC_PER_NODE, CPUS_PER_TASK, MASTER_ADDR, MASTER_PORT,
                                                 RUN_DIR (a --run-dir among the trainer's arguments, else
                                                 RUNS_DIR/RUN_NAME), RUN_DIR_ARG, LAUNCH (the runtime's
                                                 command prefix), TORCHRUN (torchrun's arguments) and
                                                 TRAINER_ARGS (the trainer's, without --run-dir)
  python3 -m train.cluster after RUN_DIR [--preempted]
                                                 what the batch shell does once the step ended, and the
                                                 job's exit code: done | requeue | stopped | failed CODE
                                                 (from RUN_DIR/status.json)
  python3 -m train.cluster sky                   the same assignments for one node of a SkyPilot task
                                                 (slurm/skypilot.yaml), from SkyPilot's environment

Bad input (unknown RUNTIME, missing NAS folder or image, bad NPROC_PER_NODE, MAX_RESTARTS or MAX_REQUEUES, DATA_DIR
beside a --data-dir of the local runtime) is one line on stderr and exit code 2, before any process starts.

The trainer takes the same hostlist (train/cluster/hostlist.py) and port rules (train/cluster/identity.py: a srun task
per rank) and torchrun flags (train/launch.py: `make train`) from here, so every launch path shares one copy.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path

from train.cluster.hostlist import JobError, expand_hostlist
from train.files.rundir import read_status

RUNTIMES = ("local", "pyxis", "apptainer")
WORKDIR = "/opt/trainbox"  # the image's checkout; the NAS folders are mounted under it
DEFAULT_MAX_RESTARTS = 3  # torchrun restarts of the workers after one fails (MAX_RESTARTS overrides)
DEFAULT_MAX_REQUEUES = 10  # Slurm requeues of a preempted job (MAX_REQUEUES overrides)
# A fresh rendezvous store for each torchrun attempt. The trainer namespaces its keys by attempt either
# way (train/cluster/distributed.py), so torchrun's shared store works too (pytorch/pytorch#135712).
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def count(name: str, value: int | str | None, default: int) -> int:
    """A count set in the environment (MAX_RESTARTS, MAX_REQUEUES), checked; empty means the default."""
    text = "" if value is None else str(value).strip()
    if not text:
        return default
    if not text.isdecimal():
        raise JobError(f"{name}={value!r} is not a number: use 0, 1, 3, ...")
    return int(text)


def port_problem(name: str, value: str) -> str | None:
    """Why `value`, set as `name` (MASTER_PORT), is not a port a rendezvous can listen on; None if it is one."""
    if re.fullmatch(r"[0-9]{1,5}", value) and 1 <= int(value) <= 65535:
        return None
    return f"{name}={value!r} is not a port number (1-65535)"


# The signals torchrun's agent passes on to its workers. SIGUSR2 is the preemption signal (Slurm --signal); torchrun
# passes on only the others by default.
PASSED_ON = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR2")


def torchrun_flags(max_restarts: int | str | None = None) -> list[str]:
    """The torchrun flags of every multi-worker launch (make train, compose, the Slurm template)."""
    return [f"--max-restarts={count('MAX_RESTARTS', max_restarts, DEFAULT_MAX_RESTARTS)}",
            f"--signals-to-handle={','.join(PASSED_ON)}",
            "--shutdown-timeout=100"]  # time for the workers to agree on a step and save before SIGKILL


def multinode_torchrun(nnodes: int, nproc: int, endpoint: str, rdzv_id: str, max_restarts: str | None,
                       host: bool | None = None) -> list[str]:
    """torchrun's arguments for one node of a multi-node run: c10d rendezvous at `endpoint` (on the
    first node), the shared flags. host: whether this node hosts the rendezvous store (None: torchrun
    tells by matching the endpoint against the node's own names and addresses)."""
    conf = [] if host is None else [f"--rdzv-conf=is_host={str(host).lower()}"]
    return ["-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}", *conf,
            *torchrun_flags(max_restarts)]


def master_port(job_id: str) -> int:
    """A port derived from the job id, so two jobs sharing a node do not collide."""
    return 20000 + int(job_id) % 20000


def gpus_on_node(env) -> int:
    """GPUs Slurm gave this node (SLURM_GPUS_ON_NODE), else those CUDA_VISIBLE_DEVICES lists."""
    if env.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return int(env["SLURM_GPUS_ON_NODE"])
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return len(visible)


def cpus_per_task(env) -> int:
    """CPUs for the one task (torchrun) per node: --cpus-per-task when given, else every CPU the job has
    on its smallest node (SLURM_JOB_CPUS_PER_NODE, e.g. '64(x2),32'). srun would otherwise give the task
    one CPU, and where cgroups pin it, every worker and loader of the node would share that core."""
    if env.get("SLURM_CPUS_PER_TASK", "").isdigit():
        return int(env["SLURM_CPUS_PER_TASK"])
    counts = [int(n) for n in re.findall(r"(\d+)(?:\(x\d+\))?", env.get("SLURM_JOB_CPUS_PER_NODE", ""))]
    return min(counts) if counts else 1


def split_run_dir(args: list[str]) -> tuple[str | None, list[str]]:
    """The trainer's --run-dir among its arguments (the last one, as the trainer takes it; or run_dir in
    its --config file), and the arguments without it."""
    run_dir, rest, config, i = None, [], None, 0
    while i < len(args):
        arg = args[i]
        if arg == "--run-dir" and i + 1 < len(args):
            run_dir, i = args[i + 1], i + 2
            continue
        if arg.startswith("--run-dir="):
            run_dir, i = arg.partition("=")[2], i + 1
            continue
        if arg == "--config" and i + 1 < len(args):
            config = args[i + 1]
        elif arg.startswith("--config="):
            config = arg.partition("=")[2]
        rest.append(arg)
        i += 1
    if run_dir is None and config:
        run_dir = _config_run_dir(Path(config))
    return run_dir or None, rest


def _config_run_dir(path: Path) -> str | None:
    """run_dir in a trainer config file (JSON, or TOML where this python3 reads it), if it sets one; a file
    that cannot be read is the trainer's to report."""
    try:
        text = path.read_text()
        if path.suffix == ".toml":
            import tomllib  # noqa: PLC0415 - Python 3.11+; an older python3 leaves a TOML file to the trainer
            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except (OSError, ValueError, ImportError):
        return None
    value = data.get("run_dir") if isinstance(data, dict) else None
    return value if isinstance(value, str) and value else None


def run_location(env, trainer_args: list[str], base: Path, where: str,
                 default_name: str | None) -> tuple[Path, str, list[str]]:
    """(runs folder, run name, the trainer's arguments without --run-dir). A --run-dir among the trainer's
    arguments is the run's folder for everything the job decides (resume, requeue, done, MLflow): the same
    as RUNS_DIR=its parent RUN_NAME=its name, which it must not contradict."""
    run_dir, rest = split_run_dir(trainer_args)
    if run_dir is None:
        return _runs_dir(env, base, where), env.get("RUN_NAME") or default_name or "", rest
    path = Path(os.path.normpath(base / run_dir))
    named = Path(env["RUNS_DIR"]) / (env.get("RUN_NAME") or path.name) if env.get("RUNS_DIR") else None
    if env.get("RUN_NAME") and env["RUN_NAME"] != path.name or named and named.resolve() != path.resolve():
        raise JobError(f"--run-dir {run_dir} and RUNS_DIR/RUN_NAME ({named or env['RUN_NAME']}) name two "
                        f"different run folders: give one of them")
    if path.name in ("", ".", ".."):
        raise JobError(f"--run-dir {run_dir}: name the run's own folder, e.g. --run-dir /nas/runs/exp1")
    return _runs_dir({**env, "RUNS_DIR": str(path.parent)}, base, where), path.name, rest


def slurm_job(env, trainer_args: list[str] = ()) -> dict[str, str | list[str]]:
    """Everything the batch script needs to start one torchrun per node, checked first. trainer_args: the
    script's arguments (TRAINER_ARGS is them without a --run-dir, which becomes RUN_DIR)."""
    if "SLURM_JOB_ID" not in env:
        raise JobError("not inside a Slurm job: submit with sbatch slurm/multinode.sh")
    runtime = env.get("RUNTIME", "local")
    if runtime not in RUNTIMES:
        raise JobError(f"RUNTIME={runtime!r}: use one of {', '.join(RUNTIMES)}")
    workers = _nproc_per_node(env) or gpus_on_node(env) or 1
    count("MAX_REQUEUES", env.get("MAX_REQUEUES"), DEFAULT_MAX_REQUEUES)  # checked now, used after the step
    trainbox_dir = Path(env.get("TRAINBOX_DIR") or env.get("SLURM_SUBMIT_DIR", "."))
    runs_dir, run_name, rest = run_location(env, list(trainer_args), trainbox_dir,
                                            env.get("SLURMD_NODENAME", "this node"), f"slurm-{env['SLURM_JOB_ID']}")
    data_dir, rest = data_folder(env, trainbox_dir, rest, runtime == "local")
    nodes = expand_hostlist(env.get("SLURM_JOB_NODELIST", "localhost"), env)
    port = env.get("MASTER_PORT") or str(master_port(env["SLURM_JOB_ID"]))
    if port_problem("MASTER_PORT", port):
        raise JobError(f"{port_problem('MASTER_PORT', port)}: unset it (the job's port is derived from its id) or "
                        f"set a free port")
    out: dict[str, str | list[str]] = {
        "NNODES": str(len(nodes)),
        "NPROC_PER_NODE": str(workers),
        "CPUS_PER_TASK": str(cpus_per_task(env)),
        "MASTER_ADDR": nodes[0], "MASTER_PORT": port,
        "RUN_DIR": str(runs_dir / run_name),
        "TORCHRUN": multinode_torchrun(len(nodes), workers, f"{nodes[0]}:{port}", env["SLURM_JOB_ID"],
                                       env.get("MAX_RESTARTS")),
        "TRAINER_ARGS": rest,
    }
    if runtime == "local":
        out["LAUNCH"] = [_python(env, trainbox_dir)]
        out["RUN_DIR_ARG"] = str(runs_dir / run_name)
        return out
    image = env.get("IMAGE", "")
    suffix = ".sqsh" if runtime == "pyxis" else ".sif"
    if not image or ("/" in image and not Path(image).exists()):
        raise JobError(f"RUNTIME={runtime} needs IMAGE=/nas/path/trainbox{suffix}: build it with "
                              f"`make {'enroot' if runtime == 'pyxis' else 'apptainer'}`")
    mounts = [(str(runs_dir), f"{WORKDIR}/runs", "rw")]
    if data_dir.is_dir():
        mounts.append((str(data_dir), f"{WORKDIR}/data", "ro"))
    if env.get("TORCH_HOME"):  # the cache of named --weights on the NAS, at the same path inside
        mounts.append((env["TORCH_HOME"], env["TORCH_HOME"], "rw"))
    if runtime == "pyxis":
        out["LAUNCH"] = [f"--container-image={image}",
                         "--container-mounts=" + ",".join(f"{s}:{d}:{m}" for s, d, m in mounts),
                         f"--container-workdir={WORKDIR}", "python"]
    else:
        out["LAUNCH"] = ["apptainer", "exec", "--nv", "--pwd", WORKDIR,
                         *[a for s, d, m in mounts for a in ("--bind", f"{s}:{d}:{m}")], image, "python"]
    out["RUN_DIR_ARG"] = f"runs/{run_name}"
    return out


def data_folder(env, trainbox_dir: Path, trainer_args: list[str], local: bool) -> tuple[Path, list[str]]:
    """(the data folder, the trainer's arguments). A container mounts it at the trainer's default --data-dir; in the
    local runtime DATA_DIR is the trainer's --data-dir, never a knob left unread, and not given beside another."""
    data_dir = Path(env.get("DATA_DIR") or trainbox_dir / "data")
    if env.get("DATA_DIR") and not data_dir.is_dir():
        raise JobError(f"DATA_DIR={data_dir} does not exist: mount the NAS there or set DATA_DIR")
    if not (local and env.get("DATA_DIR")):
        return data_dir, trainer_args
    if any(a == "--data-dir" or a.startswith("--data-dir=") for a in trainer_args):
        raise JobError(f"DATA_DIR={data_dir} and --data-dir among the arguments both name the data: give one")
    return data_dir, ["--data-dir", str(data_dir), *trainer_args]


def sky_job(env) -> dict[str, str | list[str]]:
    """One node of a SkyPilot task (slurm/skypilot.yaml): one torchrun per node, c10d rendezvous on the
    first node of SKYPILOT_NODE_IPS, which hosts the store; the run in RUNS_DIR/RUN_NAME on the task's
    mounted storage (or the --run-dir in ARGS), so that a relaunch (a managed job recovered after a
    preemption) resumes it. TRAINER_ARGS: ARGS as words, without the --run-dir."""
    ips = env.get("SKYPILOT_NODE_IPS", "").split()
    if not ips or not env.get("SKYPILOT_NODE_RANK", "").isdigit():
        raise JobError("not inside a SkyPilot task (no SKYPILOT_NODE_IPS / SKYPILOT_NODE_RANK): launch with "
                        "sky launch slurm/skypilot.yaml")
    try:
        args = shlex.split(env.get("ARGS", ""))
    except ValueError as e:
        raise JobError(f"ARGS={env.get('ARGS')!r} cannot be split into words ({e}): check its quotes") from None
    trainbox_dir = Path(env.get("TRAINBOX_DIR") or ".")
    where = f"node {env['SKYPILOT_NODE_RANK']}"
    runs_dir, run_name, rest = run_location(env, args, trainbox_dir, where, None)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", run_name):
        raise JobError(f"RUN_NAME={run_name!r}: name the run (letters, digits, . _ -), e.g. sky launch "
                        f"--env RUN_NAME=resnet50-a slurm/skypilot.yaml; a relaunch with the same name resumes it")
    gpus = env.get("SKYPILOT_NUM_GPUS_PER_NODE", "")
    workers = _nproc_per_node(env) or (int(gpus) if gpus.isdigit() and int(gpus) > 0 else 1)
    port = env.get("MASTER_PORT") or "29400"
    if port_problem("MASTER_PORT", port):
        raise JobError(f"{port_problem('MASTER_PORT', port)}: unset it (29400) or set a free port")
    rank = int(env["SKYPILOT_NODE_RANK"])
    return {
        "NNODES": str(len(ips)),
        "NODE_RANK": str(rank),
        "NPROC_PER_NODE": str(workers),
        "MASTER_ADDR": ips[0],
        "MASTER_PORT": port,
        "RUN_DIR": str(runs_dir / run_name),
        "LAUNCH": [_python(env, trainbox_dir)],
        "TORCHRUN": multinode_torchrun(len(ips), workers, f"{ips[0]}:{port}", run_name, env.get("MAX_RESTARTS"),
                                       host=rank == 0),
        "TRAINER_ARGS": rest,
    }


def _nproc_per_node(env) -> int | None:
    """NPROC_PER_NODE, checked (None: not set)."""
    nproc = env.get("NPROC_PER_NODE", "")
    if nproc and (not nproc.isdecimal() or int(nproc) < 1):
        raise JobError(f"NPROC_PER_NODE={nproc!r}: give the workers per node as a positive number")
    return int(nproc) if nproc else None


def _runs_dir(env, trainbox_dir: Path, where: str) -> Path:
    """RUNS_DIR, checked; its default, runs/ beside the checkout, is made (a folder the user named must exist)."""
    runs_dir = Path(env.get("RUNS_DIR") or trainbox_dir / "runs")
    if not env.get("RUNS_DIR"):
        try:
            runs_dir.mkdir(exist_ok=True)
        except OSError as e:
            raise JobError(f"cannot create {runs_dir} ({e.strerror}): set RUNS_DIR to a writable folder on "
                            f"the NAS") from None
    if not runs_dir.is_dir():
        raise JobError(f"RUNS_DIR={runs_dir} does not exist on {where}: create it on the NAS (or mount the "
                        f"storage there) or set RUNS_DIR")
    if not os.access(runs_dir, os.W_OK):
        raise JobError(f"RUNS_DIR={runs_dir} is not writable: fix its permissions or set RUNS_DIR")
    return runs_dir


def _python(env, trainbox_dir: Path) -> str:
    """PYTHON (a path, or a name on PATH such as the image's `python`), else the checkout's .venv."""
    python = env.get("PYTHON") or str(trainbox_dir / ".venv" / "bin" / "python")
    if not (Path(python).exists() if "/" in python else shutil.which(python)):
        raise JobError(f"{python} not found: run `make setup` in {trainbox_dir.resolve()} or set PYTHON")
    return python


def after(run_dir: Path, env, preempted: bool) -> tuple[str, int]:
    """What the batch shell does once the step ended, and the job's exit code: requeue (stopped at a
    checkpoint on a preemption notice, requeues left), done, stopped (at a checkpoint, on a cancel or a
    signal of the user's: not requeued), or failed (with the code the run recorded: 2 for an error a
    restart cannot mend, such as out of memory; else 0, the step's own code stands)."""
    status = read_status(run_dir)
    state = status.get("state")
    if state == "done":
        return "done", 0
    attempt = int(env.get("SLURM_RESTART_COUNT", "0"))
    this_attempt = status.get("slurm_restart_count", attempt) == attempt
    if state == "failed" and this_attempt and isinstance(status.get("exit_code"), int):
        return "failed", status["exit_code"]
    if state != "stopped" or not this_attempt:
        return "failed", 0  # a crash, or an earlier attempt's status: this one never started training
    if not preempted:
        return "stopped", 75
    if attempt < count("MAX_REQUEUES", env.get("MAX_REQUEUES"), DEFAULT_MAX_REQUEUES):
        return "requeue", 0
    return "failed", 0


def main(argv: list[str]) -> int:
    try:
        if argv[:1] in (["job"], ["sky"]):
            trainer_args = argv[2:] if argv[1:2] == ["--"] else argv[1:]
            planned = slurm_job(os.environ, trainer_args) if argv[0] == "job" else sky_job(os.environ)
            for key, value in planned.items():
                if isinstance(value, list):
                    print(f"{key}=({' '.join(shlex.quote(v) for v in value)})")
                else:
                    print(f"{key}={shlex.quote(value)}")
            for key, value in TORCHRUN_ENV.items():
                print(f"export {key}={shlex.quote(os.environ.get(key, value))}")
            return 0
        if argv[:1] == ["after"] and len(argv) in (2, 3) and argv[2:] in ([], ["--preempted"]):
            print(*after(Path(argv[1]), os.environ, preempted=argv[2:] == ["--preempted"]))
            return 0
    except JobError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("usage: python3 -m train.cluster job [-- TRAINER ARGS] | after RUN_DIR [--preempted] | sky",
          file=sys.stderr)
    return 2

