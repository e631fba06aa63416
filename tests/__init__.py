"""trainbox's tests (tests/conftest.py: the fixtures; tests/helpers.py: the helpers).

Every process a test run starts (pytest's workers, the trainers, torchrun, srun's tasks) inherits OMP_WAIT_POLICY
below: an OpenMP thread that waits for work sleeps instead of spinning. make test runs several multi-threaded
trainers at once on a few cores, where a spinning thread burns the core another process is waiting for: three
default runs at once on 2 cores took 655 s of wall time and 430 s of CPU each with the default policy, 195 s and
128 s with this one (docs/development.md). It changes when a thread waits, never what a run computes. Set here,
before any test module imports torch: OpenMP reads it once, when torch loads it.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
