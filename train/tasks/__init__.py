"""What a run trains for: the task seam (task), the built-in tasks, and the task a run names (factory)."""
