"""python -m train: check the config, then train in this process or in --spawn N local workers.

  python -m train                                      one process: the GPU if present, else the CPU
  python -m train --preset debug                       a tiny run that finishes in seconds
  python -m train --spawn 2                            two local workers (torch.multiprocessing)
  torchrun --standalone --nproc-per-node=2 -m train    two local workers (torchrun)
  srun python -m train                                 one Slurm task per rank
  python -m train.launch --gpus 2 -- ARGS              what `make train GPUS=2 ARGS=...` runs

Exit codes: 0 done, 2 bad input (one line on stderr), 75 stopped by a signal after saving a checkpoint.
"""

import sys

from train.launch import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
