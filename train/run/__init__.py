"""One training run: the worker, its parts (build), the Trainer, the checkpointer, health, memory, the plan, the checks,
the evaluation, and a finished run's model scored again (make evaluate's ranks)."""
