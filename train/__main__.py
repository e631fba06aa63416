"""python -m train: check the config, then train in this process or in --spawn N local workers.

  python -m train                                      one process: the GPU if present, else the CPU
  python -m train --preset debug                       a tiny run that finishes in seconds
  python -m train --spawn 2                            two local workers (torch.multiprocessing)
  python -m train --spawn 8 --dry-run                  the plan of 8 workers, as JSON: nothing is trained
  torchrun --standalone --nproc-per-node=2 -m train    two local workers (torchrun)
  srun python -m train                                 one Slurm task per rank
  python -m train.launch --gpus 2 -- ARGS              what `make train GPUS=2 ARGS=...` runs

Exit codes (train/base/errors.py): 0 done, 1 failed, 2 bad input (one line on stderr), 75 stopped by a
signal after saving a checkpoint. Under torchrun a failed run fails torchrun too: after an error a restart
cannot mend, its restarts refuse at once and it exits non-zero; a stop leaves it with 0 (status.json says
"stopped"; make, compose and the templates exit 75).
"""

import os
import sys
from pathlib import Path

from train.base.errors import EXIT_BAD_INPUT, ConfigError, end_process, fail
from train.cli import parse_config
from train.cluster.forkserver import start_fork_server, stop_fork_server
from train.config.settings import Config
from train.files.rundir import default_run_dir, failed_in_this_launch, launch_run_dir

# What --spawn's fork server imports once, beside torch (forkserver.TORCH), before it forks: what its children run, the
# checks and the trainer (train.launch imports both)
PRELOAD = ["train.launch"]


def main(argv: list[str]) -> int:
    try:
        cfg = parse_config(argv)
    except ConfigError as e:
        return fail(e)
    # torchrun restarting what cannot mend
    if failed_in_this_launch(Path(launch_run_dir(cfg.run.run_dir)), os.environ):
        return EXIT_BAD_INPUT  # its line was said by the attempt that met it; torchrun ends non-zero
    if cfg.launch.spawn > 0 and not cfg.run.dry_run:
        # --spawn N: the fork server imports torch and the trainer, once; this launcher never does
        # (train/cluster/spawn.py)
        start_fork_server(PRELOAD)
        return spawn_run(cfg)
    # Everything that needs torch starts here, so that --help and a mistake in the flags or config file answer
    # at once.
    from train.launch import start  # noqa: PLC0415

    return start(cfg)


def spawn_run(cfg: Config) -> int:
    """python -m train --spawn N: the checks that need torch (train/run/preflight.py's preflight) in one child of the
    fork server, then the N workers from the same server (train/cluster/spawn.py). A mistake is the child's one line
    and exit code 2, before any worker starts."""
    from train.cluster.spawn import Job, run_check, spawn_workers  # noqa: PLC0415 - the --spawn launcher's alone

    code = run_check(Job("train.launch", "check", cfg))
    if code != 0:
        stop_fork_server()
        return code
    cfg = cfg.replace(run_dir=cfg.run.run_dir or default_run_dir())  # one run folder for them all
    return spawn_workers(cfg.launch.spawn, Job("train.run.worker", "run_worker", cfg))


if __name__ == "__main__":
    end_process(main(sys.argv[1:]))
