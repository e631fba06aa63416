"""Every file format in one place: the run directory's files, the checkpoint file, shared downloads."""
