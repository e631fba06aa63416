"""`make env`: write .env for docker compose (host UID/GID, NAS paths, GPU or CPU compose files, the MLflow
server the trainer tracks to).
`make doctor` also asks it, on the host, whether the driver can run the image's CUDA (--check-driver):
inside the container that question cannot be asked, because the NVIDIA Container Toolkit refuses to
start an image whose CUDA the driver is too old for.

Standard library only: it runs with the system python3, before any environment exists. Keys it does
not own are kept, so a hand-edited .env loses nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

# The oldest Linux driver for each CUDA major version (NVIDIA's CUDA compatibility table).
MIN_DRIVER = {13: 580, 12: 525, 11: 450}
GPU_COMPOSE = "docker-compose.yml:docker/compose.gpu.yml"
CPU_COMPOSE = "docker-compose.yml"


def host_has_gpus() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU " in out.stdout


def host_driver() -> str | None:
    """The host's NVIDIA driver version from nvidia-smi, or None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split()
    return lines[0] if out.returncode == 0 and lines else None


def driver_problem(driver: str, cuda: str) -> str | None:
    """Why a driver cannot run a CUDA version's torch, or None."""
    need = MIN_DRIVER.get(int(cuda.split(".")[0]))
    if need and int(driver.split(".")[0]) < need:
        return (f"driver {driver} is too old for CUDA {cuda} (needs >= {need}): upgrade the driver, or build "
                f"the image with an older CUDA flavour (make build TORCH_FLAVOUR=cu128 or cu126)")
    return None


def check_driver(cuda: str) -> int:
    driver = host_driver()
    if driver is None:
        print("[info] host driver   no NVIDIA driver on this host: CPU only (gloo)")
        return 0
    problem = driver_problem(driver, cuda)
    if problem:
        print(f"[FAIL] host driver   {problem}")
        return 1
    print(f"[ok  ] host driver   {driver} runs the image's CUDA {cuda}")
    return 0


def container_ids() -> tuple[int, int, str]:
    """The host user's UID/GID; root maps to 1000 because the image never runs as root."""
    uid, gid = os.getuid(), os.getgid()
    if uid == 0:
        return 1000, 1000, "running as root: the container user gets UID/GID 1000 (set HOST_UID/HOST_GID to change)"
    return uid, gid, ""


def read_env(path: Path) -> dict[str, str]:
    values = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip() and not line.lstrip().startswith("#") and "=" in line:
                key, _, value = line.partition("=")
                values[key.strip()] = value.strip()
    return values


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="make env", description=__doc__)
    parser.add_argument("--data-dir", default="", help="datasets on the NAS (mounted read-only)")
    parser.add_argument("--runs-dir", default="", help="runs and checkpoints on the NAS (read-write)")
    parser.add_argument("--image", default="", help="image tag the services run")
    parser.add_argument("--mlflow-uri", default=None, help="the MLflow server the trainer tracks to "
                        "(http://mlflow:5000: the compose service); empty: no tracking")
    parser.add_argument("--file", default=".env")
    parser.add_argument("--check-driver", metavar="CUDA", help="only check the host driver against CUDA (13.0, ...)")
    parser.add_argument("--ids", action="store_true", help="only print the container user's UID and GID (make build)")
    args = parser.parse_args(argv)
    if args.check_driver:
        return check_driver(args.check_driver)
    if args.ids:
        print(*container_ids()[:2])
        return 0

    path = Path(args.file)
    values = read_env(path)
    uid, gid, note = container_ids()
    values["HOST_UID"] = os.environ.get("HOST_UID") or str(uid)
    values["HOST_GID"] = os.environ.get("HOST_GID") or str(gid)
    for key, given, default in (("DATA_DIR", args.data_dir, "./data"), ("RUNS_DIR", args.runs_dir, "./runs")):
        # Named on the command line or in .env (not the default an earlier `make env` wrote there): it must
        # exist, the NAS mounted.
        named = given or (values.get(key) if values.get(key) != str(Path(default).resolve()) else None)
        folder = Path(named or default)
        if not folder.is_dir():
            if named:
                print(f"error: {key}={folder} does not exist: mount the NAS there or pass an existing folder",
                      file=sys.stderr)
                return 2
            folder.mkdir(parents=True, exist_ok=True)
            if os.getuid() == 0:  # made by root for a container user: hand it over
                os.chown(folder, int(values["HOST_UID"]), int(values["HOST_GID"]))
        values[key] = str(folder.resolve())
    if args.image:
        values["TRAINBOX_IMAGE"] = args.image
    if args.mlflow_uri is not None:
        values["MLFLOW_TRACKING_URI"] = args.mlflow_uri
    values["COMPOSE_FILE"] = GPU_COMPOSE if host_has_gpus() else CPU_COMPOSE
    path.write_text("# written by `make env`; keys other than these are kept\n"
                    + "".join(f"{k}={v}\n" for k, v in values.items()))
    print(f"wrote {path}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    if note:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
