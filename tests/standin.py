"""The image tests' stand-in base: Debian bookworm with Python, from debootstrap, imported into the engine, where no
registry serves the CUDA base the Dockerfile names. tests/e2e/test_docker.py's fixture builds it when the engine has
none; .ci/run builds it beside `make setup`, where a fresh machine's engine has none and one core waits on pip.

  python3 -m tests.standin DOCKER      the image in DOCKER's engine, built if missing (standard library only)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

STANDIN = "trainbox-standin-base:bookworm"


def standin_base(docker: str) -> str:
    """STANDIN in docker's engine, built from a debootstrap root (kept under ~/.cache/trainbox for the next build)
    where the engine lacks it; RuntimeError, saying why, where it cannot be built."""
    if subprocess.run([docker, "image", "inspect", STANDIN], capture_output=True).returncode == 0:
        return STANDIN
    if shutil.which("debootstrap") is None or os.getuid() != 0:
        raise RuntimeError("building the stand-in base needs root and debootstrap (apt-get install debootstrap)")
    rootfs = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trainbox" / "standin-rootfs"
    if not (rootfs / "usr" / "bin" / "python3").exists():
        shutil.rmtree(rootfs, ignore_errors=True)
        rootfs.parent.mkdir(parents=True, exist_ok=True)
        boot = subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
                               "bookworm", str(rootfs), "http://deb.debian.org/debian"],
                              capture_output=True, text=True, timeout=900)
        if boot.returncode:
            raise RuntimeError(f"debootstrap exited {boot.returncode}:\n{(boot.stdout + boot.stderr)[-3000:]}")
    # --one-file-system: without the /proc that debootstrap can leave mounted in the folder
    tar = subprocess.Popen(["tar", "--one-file-system", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    importing = subprocess.Popen([docker, "import", "-", STANDIN], stdin=tar.stdout, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
    tar.stdout.close()  # only the import reads it: an import that ends early ends tar too, not blocks it
    _, err = importing.communicate()
    if tar.wait() or importing.returncode:
        raise RuntimeError(f"importing {rootfs} as {STANDIN} failed: {err[-3000:]}")
    return STANDIN


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python3 -m tests.standin DOCKER (a docker client that reaches the engine)")
    try:
        print(f"standin: {standin_base(sys.argv[1])} in the engine")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        sys.exit(f"standin: {e}")
