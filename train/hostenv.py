"""`make env`: write .env for docker compose (host UID/GID, NAS paths, GPU or CPU compose files, the MLflow
server the trainer tracks to). The trainer's containers run as the host user, root included
(`container_ids`), so a local run and a container run share runs/ and the NAS in any order; `make train`
and `make shell` check before a container starts that its user can write there (--check-writable). The
services (TensorBoard, MLflow) answer the network, so they never run as root (`service_ids`); `make
tensorboard` and `make mlflow` prepare for them (--service). `make build` fetches the image's base first,
and says what to do where it cannot be fetched (--fetch-base).
`make doctor` also asks it, on the host, whether the driver can run the image's CUDA (--check-driver):
inside the container that question cannot be asked, because the NVIDIA Container Toolkit refuses to
start an image whose CUDA the driver is too old for.

Standard library only: it runs with the system python3 (`python3 -m train.hostenv`, from the checkout), before
any environment exists. Keys it does not own are kept, so a hand-edited .env loses nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from train.cluster.cuda_driver import driver_problem
from train.cluster.jobs import split_run_dir

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


def container_ids() -> tuple[int, int]:
    """The UID/GID the containers run as (compose `user:`): the host user's own, root's too, as cresset does.
    Files in runs/ and on the NAS then belong to whoever trains, in the container or not, in any order; a
    container run as root has no more power than the root user who starts it."""
    return os.getuid(), os.getgid()


def image_ids() -> tuple[int, int]:
    """The image's own user (`make build`), for a `docker run` without compose: the host user, but never
    root (1000 for root), so that the image's default user is not root."""
    return service_ids(os.getuid(), os.getgid())


def service_ids(uid: int, gid: int) -> tuple[int, int]:
    """The user of the services (TensorBoard, MLflow; compose `user:`, SERVICE_UID/SERVICE_GID) for a
    container user uid:gid: the same, but never root (1000 for root). A server that answers the network
    needs no power over the host's files; what the MLflow server writes (RUNS_DIR/mlflow) becomes its own."""
    return (1000, 1000) if uid == 0 else (uid, gid)


def prepare_service(env_file: Path, service: str, password_file: str) -> int:
    """Before `compose up SERVICE`: .env names the services' user (an older one does not: `make env`); for
    mlflow, its store folder RUNS_DIR/mlflow is that user's (handed over when root made it) and the admin's
    password file (mounted into the container) readable by it. One error line with the fix otherwise."""
    values = read_env(env_file)
    if not (values.get("SERVICE_UID") and values.get("SERVICE_GID")):
        return _error(f"{env_file} names no SERVICE_UID/SERVICE_GID, the user {service} runs as (never root): run "
                      f"`make env`")
    uid, gid = int(values["SERVICE_UID"]), int(values["SERVICE_GID"])
    if uid == 0:
        return _error(f"SERVICE_UID=0 in {env_file} runs {service} as root: run `make env` (your UID, or 1000 for "
                      f"root) or set another SERVICE_UID")
    if service != "mlflow":
        return 0
    runs = Path(values.get("RUNS_DIR") or "runs")
    if not runs.is_dir():
        return _error(f"RUNS_DIR={runs} does not exist: mount the NAS there or run `make env`")
    store = runs / "mlflow"
    try:
        if not store.exists():
            store.mkdir(mode=0o700)
        if os.getuid() == 0 and store.stat().st_uid != uid:  # made by root, or by an older root container
            for path in (store, *store.rglob("*")):
                os.lchown(path, uid, gid)
    except OSError as e:
        return _error(f"{store} cannot be made ({e.strerror}): run `make mlflow` as the owner of RUNS_DIR={runs}")
    if not writable_by(store, uid, gid):
        owner = store.stat().st_uid
        return _error(f"{store} belongs to uid {owner} and the MLflow container runs as uid {uid} (SERVICE_UID in "
                      f"{env_file}), which cannot write it: run `sudo chown -R {uid}:{gid} {store}`")
    if password_file:
        path = Path(password_file).expanduser()
        if path.is_file() and path.stat().st_uid != uid:
            return _error(f"MLFLOW_ADMIN_PASSWORD_FILE={password_file} belongs to uid {path.stat().st_uid} and the "
                          f"MLflow container runs as uid {uid} (SERVICE_UID in {env_file}), which cannot read it: run "
                          f"`chown {uid}:{gid} {password_file}`, or name the container's user: SERVICE_UID=... "
                          f"SERVICE_GID=... make env")
    return 0


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def fetch_base(base: str, image: str, knob: str, docker: str) -> int:
    """Before a build: the base image is in the engine, or pulled now (its progress shown). Where it cannot
    be (an air-gapped cluster, no such image, no login), one line with the choices instead of the build's
    own error, which comes only after the whole BuildKit log."""
    try:
        if subprocess.run([docker, "image", "inspect", base], capture_output=True).returncode == 0:
            return 0
        pulled = subprocess.run([docker, "pull", base], stderr=subprocess.PIPE, text=True)
        if pulled.returncode == 0:
            return 0
        reason = " ".join(pulled.stderr.split()).removeprefix("Error response from daemon: ")
    except OSError as e:
        reason = f"{docker}: {e.strerror}"
    return _error(base_unreachable(base, image, knob, reason or f"docker pull exited {pulled.returncode}"))


def base_unreachable(base: str, image: str, knob: str, reason: str) -> str:
    return (f"the base image {base} of {image} cannot be fetched ({reason}): run without the image (RUNTIME=local), "
            f"build on a base your site mirrors ({knob}=...), or `docker load` an image {image} built elsewhere "
            f"(`docker save {image}` there)")


def writable_by(path: Path, uid: int, gid: int) -> bool:
    """Whether a process of uid:gid (no supplementary groups, as a compose `user:`) may create files in the
    folder `path` (or write the file `path`), by its owner, group and mode."""
    if uid == 0:
        return True
    st = path.stat()
    need = 0o3 if path.is_dir() else 0o2  # a folder: write and search
    shift = 6 if st.st_uid == uid else 3 if st.st_gid == gid else 0
    return (st.st_mode >> shift) & need == need


def run_folder(runs_dir: Path, trainer_args: list[str]) -> Path | None:
    """The host folder of the run that trainer_args name with --run-dir (or their --config file's run_dir) under the
    runs volume, if any: the trainer's own reading of them (train/cluster/jobs.py)."""
    run_dir = split_run_dir(trainer_args)[0]
    if not run_dir:
        return None
    for inside in ("runs/", "/opt/trainbox/runs/", "./runs/"):
        if run_dir.startswith(inside):
            return runs_dir / run_dir[len(inside):]
    return None


def check_writable(env_file: Path, trainer_args: list[str]) -> int:
    """Before a container starts: can the container user write RUNS_DIR (and the run that --run-dir names,
    its files and folders)? If not, one line with the folder, its owner, the container's UID and the fix."""
    values = read_env(env_file)
    uid, gid = int(values.get("HOST_UID") or 1000), int(values.get("HOST_GID") or 1000)
    runs_dir = Path(values.get("RUNS_DIR") or "runs")
    if not runs_dir.is_dir():
        return 0  # compose makes it (as root); the trainer's own check names the folder
    paths = [runs_dir]
    run = run_folder(runs_dir, trainer_args)
    if run is not None and run.is_dir():
        paths += [run, *sorted(p for p in run.iterdir() if p.is_file() or p.name in ("checkpoints", "tensorboard"))]
    for path in paths:
        if writable_by(path, uid, gid):
            continue
        st = path.stat()
        mine = (os.getuid(), os.getgid()) == (uid, gid)
        fix = (f"`sudo chown -R {uid}:{gid} {runs_dir}`" if mine else
               f"`make env` (the container then runs as you, uid {os.getuid()}) or `chown -R {uid}:{gid} {runs_dir}`")
        print(f"error: {path} belongs to uid {st.st_uid} (gid {st.st_gid}) and the container runs as uid {uid} (gid "
              f"{gid}, HOST_UID/HOST_GID in {env_file}), which cannot write it: run {fix}", file=sys.stderr)
        return 2
    return 0


def read_env(path: Path) -> dict[str, str]:
    values = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip() and not line.lstrip().startswith("#") and "=" in line:
                key, _, value = line.partition("=")
                values[key.strip()] = value.strip()
    return values


def stale_image(image: str, built: str, head: str, dirty: bool) -> str | None:
    """The warning when IMAGE was built from another commit than this checkout's HEAD (or the checkout has
    changes in what the image holds), else None; no git (head empty): nothing to compare."""
    if not head or (built == head and not dirty):
        return None
    return (f"warning: {image} was built from {built[:12] or 'an unknown commit'}, this checkout is {head[:12]}"
            f"{' with changes' if dirty else ''}: run 'make build' to train this code")


def _output(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return ""


def warn_if_stale(image: str, docker: str) -> int:
    """make image: say so when the image was built from other code than this checkout's (exit 0 either way)."""
    built = _output([docker, "image", "inspect", "--format",
                     '{{index .Config.Labels "org.opencontainers.image.revision"}}', image])
    head = _output(["git", "rev-parse", "HEAD"])
    dirty = bool(_output(["git", "status", "--porcelain", "--", "train", "docker", "requirements.lock"]))
    warning = stale_image(image, built, head, dirty)
    if warning:
        print(warning, file=sys.stderr)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="make env", description=__doc__)
    parser.add_argument("--data-dir", default="", help="datasets on the NAS (mounted read-only)")
    parser.add_argument("--runs-dir", default="", help="runs and checkpoints on the NAS (read-write)")
    parser.add_argument("--image", default="", help="image tag the services run")
    parser.add_argument("--mlflow-uri", default=None, help="the MLflow server the trainer tracks to "
                        "(http://mlflow:5000: the compose service); empty: no tracking")
    parser.add_argument("--file", default=".env")
    parser.add_argument("--check-driver", metavar="CUDA", help="only check the host driver against CUDA (13.0, ...)")
    parser.add_argument("--ids", action="store_true", help="only print the image user's UID and GID (make build)")
    parser.add_argument("--check-writable", action="store_true", help="only check that the container user can "
                        "write RUNS_DIR of --file (and the run that trainer arguments after -- name)")
    parser.add_argument("--warn-stale", metavar="IMAGE", help="only warn when IMAGE was built from other code "
                        "than this checkout (make image)")
    parser.add_argument("--docker", default="docker", help="the docker client (--warn-stale, --fetch-base)")
    parser.add_argument("--service", choices=("tensorboard", "mlflow"), help="only check .env for the service's "
                        "user (and make RUNS_DIR/mlflow that user's), before compose starts it")
    parser.add_argument("--fetch-base", metavar="BASE", help="only make sure the base image BASE is in the engine "
                        "(pull it), or say what to do")
    parser.add_argument("--for", dest="for_image", default="the image", help="the image built on BASE (--fetch-base)")
    parser.add_argument("--knob", default="BASE_IMAGE", help="the make knob that names BASE (--fetch-base)")
    parser.add_argument("trainer_args", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.warn_stale:
        return warn_if_stale(args.warn_stale, args.docker)
    if args.fetch_base:
        return fetch_base(args.fetch_base, args.for_image, args.knob, args.docker)
    if args.service:
        return prepare_service(Path(args.file), args.service, os.environ.get("MLFLOW_ADMIN_PASSWORD_FILE", ""))
    if args.check_driver:
        return check_driver(args.check_driver)
    if args.ids:
        print(*image_ids())
        return 0
    if args.check_writable:
        trainer_args = args.trainer_args[1:] if args.trainer_args[:1] == ["--"] else args.trainer_args
        return check_writable(Path(args.file), trainer_args)
    return write_env(Path(args.file), args)


def write_env(path: Path, args: argparse.Namespace) -> int:
    """make env: .env with the container user's ids, the NAS folders (which must exist when named), the image, the
    tracking server and the compose file of this host (GPU or CPU); keys other than these are kept."""
    values = read_env(path)
    uid, gid = container_ids()
    values["HOST_UID"] = os.environ.get("HOST_UID") or str(uid)
    values["HOST_GID"] = os.environ.get("HOST_GID") or str(gid)
    service_uid, service_gid = service_ids(int(values["HOST_UID"]), int(values["HOST_GID"]))
    values["SERVICE_UID"] = os.environ.get("SERVICE_UID") or str(service_uid)
    values["SERVICE_GID"] = os.environ.get("SERVICE_GID") or str(service_gid)
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
            if os.getuid() == 0:  # made by root for a container user of another UID (HOST_UID=...): hand it over
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
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
