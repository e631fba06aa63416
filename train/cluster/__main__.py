"""python3 -m train.cluster: a cluster job's settings: nodes, ports, torchrun's flags, the requeue decision
(train/cluster/jobs.py)."""

import sys

from train.cluster.jobs import main

sys.exit(main(sys.argv[1:]))
