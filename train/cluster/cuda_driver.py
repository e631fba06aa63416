"""Which NVIDIA driver runs which CUDA: the table `make doctor` (in the container) and train/hostenv.py (on
the host, before a container starts) both read. Standard library only."""

from __future__ import annotations

# The oldest Linux driver for each CUDA major version (NVIDIA's CUDA compatibility table).
MIN_DRIVER = {13: 580, 12: 525, 11: 450}


def driver_problem(driver: str, cuda: str) -> str | None:
    """Why a driver cannot run a CUDA version's torch, or None."""
    need = MIN_DRIVER.get(int(cuda.split(".")[0]))
    if need and int(driver.split(".")[0]) < need:
        return (f"driver {driver} is too old for CUDA {cuda} (needs >= {need}): upgrade the driver, or build "
                f"the image with an older CUDA flavour (make build TORCH_FLAVOUR=cu128 or cu126)")
    return None
