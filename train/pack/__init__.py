"""`make pack` (python -m train.pack): any source as WebDataset tar shards with an index."""
