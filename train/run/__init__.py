"""One training run: the worker, its parts (build), the Trainer, the checkpointer, health, memory, the plan, the checks
and the evaluation."""
