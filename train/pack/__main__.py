"""python3 -m train.pack: `make pack` (train/pack/command.py)."""

import sys

from train.pack.command import main

sys.exit(main(sys.argv[1:]))
