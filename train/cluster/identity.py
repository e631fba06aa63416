"""Who am I: one function turns any launcher's environment into rank, world size and device, standard library only.

Launchers understood, in this order:
  torchrun / spawn  RANK, WORLD_SIZE, LOCAL_RANK (+ MASTER_ADDR/MASTER_PORT), env:// rendezvous
  env               the same variables set by something else (Kubeflow's PyTorchJob, a script, or a shell
                    they were left in): trains as one of several, and says so before it waits for the others
                    (from_environment, peers_never_came: the lines that say why and how to train alone)
  srun per task     SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID inside a job step; master = first node
  single            a plain `python -m train`: rank 0 of 1, no process group
Every other module asks `identity()` or `is_main()`; nobody reads RANK on their own. `check_launch` refuses, in one
line, --spawn inside another launcher and a rank from the environment without its rendezvous (the trainer's preflight
and make evaluate ask it first).
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass

from train.base.errors import ConfigError
from train.cluster.hostlist import JobError, expand_hostlist
from train.cluster.jobs import master_port, port_problem


@dataclass(frozen=True)
class Identity:
    global_rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    launcher: str  # torchrun | spawn | env | slurm | single
    master_addr: str
    master_port: int

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or self.launcher != "single"


def _int(env, key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ConfigError(f"{key}={env[key]!r} is not an integer: fix the launcher environment") from None


def _port(env, default: int) -> int:
    """MASTER_PORT, where rank 0 hosts the store, or the launcher's default."""
    if "MASTER_PORT" not in env:
        return default
    problem = port_problem("MASTER_PORT", env["MASTER_PORT"])
    if problem:
        raise ConfigError(f"{problem}: fix the launcher environment (MASTER_PORT, a free port on rank 0's host)")
    return int(env["MASTER_PORT"])


def _first_node(env) -> str:
    """The step's first node, which hosts the store when the launcher set no MASTER_ADDR."""
    hostlist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "localhost")
    try:
        return expand_hostlist(hostlist, env)[0]
    except JobError as e:
        raise ConfigError(f"{e}, or set MASTER_ADDR") from None


LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch_variables(env=None) -> str:
    """The launch variables set in env (default os.environ), as NAME=value."""
    env = os.environ if env is None else env
    return " ".join(f"{key}={env[key]}" for key in LAUNCH_VARIABLES if key in env)


def alone_fix(env=None) -> str:
    """How a process with the launch variables set trains alone."""
    env = os.environ if env is None else env
    return f"unset {' '.join(key for key in LAUNCH_VARIABLES if key in env)}"


def from_environment(ident: Identity, timeout_s: float, env=None) -> str:
    """The line a process whose rank comes from the environment alone (launcher 'env') says before it waits."""
    where = f"{ident.master_addr}:{ident.master_port}"
    if ident.world_size == 1:
        wait = f"a process group of one at {where}"
    else:
        wait = f"waiting up to {timeout_s:g} s (--timeout-s) " + \
            (f"for {_others(ident)} at {where}" if ident.global_rank == 0 else f"to reach rank 0 at {where}")
    return (f"rank {ident.global_rank} of {ident.world_size} from the environment ({launch_variables(env)}; set by "
            f"neither torchrun nor --spawn): {wait}; to train alone, {alone_fix(env)}")


def _others(ident: Identity) -> str:
    """The ranks rank 0 waits for."""
    return "rank 1" if ident.world_size == 2 else f"ranks 1-{ident.world_size - 1}"


class PeersNeverCame(RuntimeError):
    """The start-up of a process whose rank and world size come from the environment alone (launcher 'env')
    failed to meet the other ranks: its line names the variables, not a dead worker."""


def first_line(error: BaseException) -> str:
    """An error's first line, without the C++ source location torch puts in front and gloo's advice behind."""
    first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
    return re.sub(r"\[[^\]]*\.(cc|cpp):\d+\]\s*", "", first).split(". This is typically")[0].strip()[:200]


def peers_never_came(ident: Identity, timeout_s: float, error: BaseException, env=None) -> PeersNeverCame:
    where = f"{ident.master_addr}:{ident.master_port}"
    if ident.global_rank == 0:
        what = f"{_others(ident)} did not join at {where} within {timeout_s:g} s"
    else:
        what = f"rank 0 could not be reached at {where} within {timeout_s:g} s"
    return PeersNeverCame(f"{what} ({first_line(error)}): {waiting_because(ident, env)}")


def waiting_because(ident: Identity, env=None) -> str:
    """Why a rank from the environment alone waited for others, and the fix: said by the error that ends its
    start-up, or by the watchdog where that start-up makes no progress first."""
    return (f"this process is rank {ident.global_rank} of {ident.world_size} because {launch_variables(env)} are set "
            f"in its environment (by neither torchrun nor --spawn); if they are left over from another job, "
            f"{alone_fix(env)} and run the same command to train alone, else start the other ranks with the same "
            f"MASTER_ADDR and MASTER_PORT")


def resolve_identity(env=None) -> Identity:
    """Turn the launcher's environment into an Identity from `env` (default os.environ) alone; a Slurm step
    without MASTER_ADDR names its first node (`expand_hostlist`: scontrol where it answers)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun always sets TORCHELASTIC_RUN_ID for its workers
        launcher = env.get("TRAINBOX_LAUNCHER") or ("torchrun" if "TORCHELASTIC_RUN_ID" in env else "env")
        return Identity(
            global_rank=_int(env, "RANK"), local_rank=_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            world_size=_int(env, "WORLD_SIZE"),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else _int(env, "WORLD_SIZE"),
            launcher=launcher, master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_port(env, 29500))
    # srun sets SLURM_STEP_ID; a batch script alone has SLURM_PROCID=0 too but is not a step of N tasks.
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env:
        tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "1"))
        return Identity(
            global_rank=_int(env, "SLURM_PROCID"), local_rank=_int(env, "SLURM_LOCALID"),
            world_size=_int(env, "SLURM_NTASKS"), local_world_size=int(re.match(r"\d+", tasks_per_node).group()),
            launcher="slurm", master_addr=env.get("MASTER_ADDR") or _first_node(env),
            master_port=_port(env, master_port(env["SLURM_JOB_ID"])))
    return Identity(0, 0, 1, 1, "single", "127.0.0.1", 0)


_identity: Identity | None = None


def identity() -> Identity:
    global _identity
    if _identity is None:
        _identity = resolve_identity()
    return _identity


def is_main() -> bool:
    """Global rank 0: the one process that writes shared files (checkpoints, logs, model.pt)."""
    return identity().global_rank == 0


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity: a cgroup or taskset may give it fewer)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def free_port() -> int:
    """A TCP port free on this machine now, for a launcher's MASTER_PORT."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_launch(spawn: int, dry_run: bool = False) -> Identity:
    """The launch environment of a command that trains or evaluates (python -m train, train.evaluate): --spawn inside
    another launcher's workers, or a rank from the environment without the variables of its rendezvous (left in a
    shell by another job?), is one line. Returns who this process is."""
    ident = resolve_identity()
    if spawn and ident.launcher == "env":
        raise ConfigError(f"--spawn with {launch_variables()} set in the environment would start workers twice: drop "
                          f"--spawn, or {alone_fix()} and let --spawn number its workers")
    if spawn and ident.launcher != "single":  # this process is already one of torchrun's or srun's workers
        raise ConfigError("--spawn inside torchrun or srun would start workers twice: drop --spawn")
    if ident.launcher == "env" and not dry_run:
        check_rendezvous_variables()
    return ident


def check_rendezvous_variables(env=None) -> None:
    """RANK and WORLD_SIZE set by something other than torchrun or --spawn: the env:// rendezvous needs
    MASTER_ADDR and MASTER_PORT as well."""
    env = os.environ if env is None else env
    missing = [key for key in ("MASTER_ADDR", "MASTER_PORT") if key not in env]
    fixes = {"MASTER_ADDR": "MASTER_ADDR to rank 0's host", "MASTER_PORT": "MASTER_PORT to a free port there"}
    if missing:
        raise ConfigError(f"{launch_variables(env)} are set in the environment (by neither torchrun nor --spawn) but "
                          f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: set "
                          f"{' and '.join(fixes[key] for key in missing)}, or {alone_fix(env)} to train alone")
