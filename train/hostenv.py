"""`make env`: write .env for docker compose (host UID/GID, NAS paths, GPU or CPU compose files).

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
    parser.add_argument("--file", default=".env")
    args = parser.parse_args(argv)

    path = Path(args.file)
    values = read_env(path)
    uid, gid, note = container_ids()
    values["HOST_UID"] = os.environ.get("HOST_UID") or str(uid)
    values["HOST_GID"] = os.environ.get("HOST_GID") or str(gid)
    for key, given, default in (("DATA_DIR", args.data_dir, "./data"), ("RUNS_DIR", args.runs_dir, "./runs")):
        folder = Path(given or values.get(key) or default)
        if not folder.is_dir():
            if given and key == "DATA_DIR":
                print(f"error: {key}={folder} does not exist: mount the NAS there or pass an existing folder",
                      file=sys.stderr)
                return 2
            folder.mkdir(parents=True, exist_ok=True)
            if os.getuid() == 0:  # made by root for a container user: hand it over
                os.chown(folder, int(values["HOST_UID"]), int(values["HOST_GID"]))
        values[key] = str(folder.resolve())
    if args.image:
        values["TRAINBOX_IMAGE"] = args.image
    values["COMPOSE_FILE"] = GPU_COMPOSE if host_has_gpus() else CPU_COMPOSE
    path.write_text("# written by `make env`; keys other than these are kept\n"
                    + "".join(f"{k}={v}\n" for k, v in values.items()))
    print(f"wrote {path}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    if note:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
