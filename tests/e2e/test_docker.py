"""The image and compose services on a real Docker engine.

Without a reachable engine these tests skip, unless TRAINBOX_REQUIRE_DOCKER=1 (CI) makes that a
failure. With no registry, the image is built on a stand-in base (Debian bookworm from debootstrap,
imported once and kept in the engine) instead of the CUDA base; everything above the base is the
real docker/Dockerfile.
"""

import inspect
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, metrics, reached_step, run, status, wait_for, without_bytecode
from tests.standin import standin_base as build_standin


IMAGE = "trainbox:test"
USER = 1234  # a non-root "host user" that owns the NAS folders
COMPOSE = shutil.which("docker-compose") and ["docker-compose"]


def _buildkit_docker() -> str | None:
    """A docker client that can build with BuildKit: `docker` with buildx, else Debian's /usr/bin/docker."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "buildx", "version"], capture_output=True).returncode == 0:
        return docker
    return "/usr/bin/docker" if os.path.exists("/usr/bin/docker") else None


DOCKER = _buildkit_docker()


def _engine_ok() -> bool:
    return DOCKER is not None and subprocess.run([DOCKER, "info"], capture_output=True).returncode == 0


@pytest.fixture(scope="session")
def docker():
    if not _engine_ok():
        if os.environ.get("TRAINBOX_REQUIRE_DOCKER") == "1":
            pytest.fail("TRAINBOX_REQUIRE_DOCKER=1 but no Docker engine answers `docker info`")
        pytest.skip("no Docker engine reachable")
    global COMPOSE
    if not COMPOSE and subprocess.run([DOCKER, "compose", "version"], capture_output=True).returncode == 0:
        COMPOSE = [DOCKER, "compose"]
    return DOCKER


@pytest.fixture(scope="session")
def standin_base(docker):
    try:
        return build_standin(docker)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")  # module: the ~5 GB image and its build cache go as soon as these tests end
def image(docker, standin_base, tmp_path_factory):
    """`make build` on the stand-in base, with an extra CA bundle carrying a marker that must not leak."""
    marker = f"trainbox-secret-marker-{uuid.uuid4().hex}"
    ca = tmp_path_factory.mktemp("ca") / "extra-ca.pem"
    system = Path("/etc/ssl/certs/ca-certificates.crt")
    ca.write_text((system.read_text() if system.exists() else "") + f"\n# {marker}\n")
    # Every --no-cache build makes a new ~5 GB image and as much build cache; an earlier run's, left
    # behind, would pile up on the machine until a build runs out of disk. So: none before, none after.
    _remove_test_images(docker)
    _check_free_disk(docker)
    cache_before = set(_build_cache(docker))
    try:
        # --no-cache: the dependency step must really run with the secret mounted.
        build = run(["make", "--no-print-directory", "build", f"DOCKER={docker}", f"IMAGE={IMAGE}",
                     f"BASE_IMAGE={standin_base}", f"HOST_UID={USER}", f"HOST_GID={USER}", f"EXTRA_CA={ca}",
                     "BUILD_FLAGS=--no-cache --progress=plain"], cwd=REPO, timeout=1800)
        yield {"tag": IMAGE, "marker": marker, "log": build.stdout + build.stderr}
    finally:
        _remove_test_images(docker)
        _prune_build_cache(docker, keep=cache_before)


# The image test's build at its peak: the ~5.5 GB layer the locked CUDA wheels install into and the ~3 GB of
# them in pip's cache mount, 8.7 GB measured (torch 2.13.0 / CUDA 13.0 lock, sampling the free disk every 0.2 s).
BUILD_NEEDS_GB = 9


def _check_free_disk(docker: str) -> None:
    """Fail in one line, before building, where Docker's disk cannot hold the build (a local engine only)."""
    root = run([docker, "info", "--format", "{{.DockerRootDir}}"]).stdout.strip()
    if not os.path.isdir(root):
        return  # a remote engine: its disk is not ours to measure
    free = shutil.disk_usage(root).free / 1e9
    if free < BUILD_NEEDS_GB:
        pytest.fail(f"the image build needs about {BUILD_NEEDS_GB} GB free under {root}, which has {free:.1f} GB "
                    f"free: make room (`{docker} builder prune -a` drops Docker's build cache)", pytrace=False)


def _build_cache(docker: str) -> dict[str, str]:
    """The engine's build cache records: id -> parent id."""
    out = run([docker, "system", "df", "-v", "--format", "{{json .BuildCache}}"]).stdout
    return {r["ID"]: r.get("Parent") or "" for r in json.loads(out) or []}


def _prune_build_cache(docker: str, keep: set[str]) -> None:
    """Remove the build cache records not in keep (the ones the test's build made), children first: a
    record with a child is not removable, and docker 20.10 takes one id per prune. The records are listed once
    (`docker system df -v` sums every image's and volume's disk: seconds a call) and pruned in that order, then
    listed again, as long as a round removes something (a record in use by another build stays)."""
    while True:
        records = {i: p for i, p in _build_cache(docker).items() if i not in keep}
        remaining = dict(records)
        while remaining:
            leaves = set(remaining) - set(remaining.values())
            if not leaves:
                break
            for record in sorted(leaves):
                subprocess.run([docker, "builder", "prune", "-a", "-f", "--filter", f"id={record}"],
                               capture_output=True)
                del remaining[record]
        if not records or set(_build_cache(docker)) >= set(records):
            return  # nothing left, or nothing more removable (in use by another build)


def _remove_test_images(docker: str) -> None:
    """The test tag and untagged trainbox images (the label is the Dockerfile's); other images stay."""
    subprocess.run([docker, "image", "rm", "-f", IMAGE], capture_output=True)
    subprocess.run([docker, "image", "prune", "-f", "--filter", "label=org.opencontainers.image.title=trainbox"],
                   capture_output=True, check=True)


def test_the_build_cache_cleanup_removes_what_a_build_added_and_keeps_the_rest(docker, standin_base, tmp_path):
    # Two tiny builds on the stand-in base: the first one's cache stands for a user's own, to be kept.
    (tmp_path / "Dockerfile").write_text(f"FROM {standin_base}\nARG X\nRUN echo $X > /x\n")
    env = {**os.environ, "DOCKER_BUILDKIT": "1"}
    tags = [f"trainbox-cache-test:{uuid.uuid4().hex[:8]}" for _ in range(2)]
    engine_had = set(_build_cache(docker))
    try:
        run([docker, "build", "-q", "--build-arg", f"X={tags[0]}", "-t", tags[0], str(tmp_path)], env=env)
        before = set(_build_cache(docker))
        run([docker, "build", "-q", "--build-arg", f"X={tags[1]}", "-t", tags[1], str(tmp_path)], env=env)
        added = set(_build_cache(docker)) - before
        assert added, "the second build added no build cache record"
        subprocess.run([docker, "image", "rm", tags[1]], capture_output=True, check=True)
        _prune_build_cache(docker, keep=before)
        after = set(_build_cache(docker))
        assert before <= after and not after & added
    finally:
        subprocess.run([docker, "image", "rm", "-f", *tags], capture_output=True)
        _prune_build_cache(docker, keep=engine_had)


@pytest.fixture
def nas(tmp_path):
    """A NAS stand-in: a host folder with datasets and runs, owned by the host user, and a .env for it."""
    root = tmp_path / "nas"
    for sub in ("datasets", "runs"):
        (root / sub).mkdir(parents=True)
    for path in (root, root / "datasets", root / "runs"):
        os.chown(path, USER, USER)
    env_file = tmp_path / "compose.env"
    env_file.write_text(f"HOST_UID={USER}\nHOST_GID={USER}\nDATA_DIR={root / 'datasets'}\n"
                        f"RUNS_DIR={root / 'runs'}\nTRAINBOX_IMAGE={IMAGE}\n")
    return root, env_file


def _about_other_services(stderr: str) -> list[str]:
    """The lines of a trainer run's stderr about the services it does not use (compose v1 warned about the
    MLflow service's password file on every run)."""
    return [line for line in stderr.splitlines()
            if any(word in line.lower() for word in ('service "mlflow"', 'service "tensorboard"', "secret"))]


def compose(env_file, *args, expect=0, gpus="", timeout=600, unset=()):
    # The env file's settings are the test's: the shell's own (which compose would prefer) are dropped.
    env = {k: v for k, v in os.environ.items() if k not in ("TENSORBOARD_PORT", "MLFLOW_PORT", "MLFLOW_BIND",
                                                            "MLFLOW_EXPOSE", "MLFLOW_ADMIN_PASSWORD_FILE", *unset)}
    env.update(GPUS=gpus, TRAINBOX_IMAGE=IMAGE)
    return run([*COMPOSE, "--env-file", str(env_file), *args], expect=expect, timeout=timeout, cwd=REPO, env=env)


def test_compose_nfs_variant_replaces_the_host_folders(docker, tmp_path):
    # No NFS in this kernel: the variant is validated by compose, not mounted.
    env_file = tmp_path / "nfs.env"
    env_file.write_text(f"HOST_UID={USER}\nHOST_GID={USER}\nNFS_SERVER=nas.example.org\n"
                        "NFS_DATA_EXPORT=/export/datasets\nNFS_RUNS_EXPORT=/export/runs\n")
    config = compose(env_file, "-f", "docker-compose.yml", "-f", "docker/compose.nfs.yml", "config").stdout
    assert "nas-data:/opt/trainbox/data:ro" in config and "nas-runs:/opt/trainbox/runs" in config
    assert "type: nfs" in config and "addr=nas.example.org,ro" in config and "device: :/export/runs" in config
    assert str(REPO / "runs") not in config  # the host folder is gone
    missing = tmp_path / "missing.env"
    missing.write_text(f"HOST_UID={USER}\n")
    err = compose(missing, "-f", "docker-compose.yml", "-f", "docker/compose.nfs.yml", "config", expect=None)
    assert err.returncode != 0 and "set NFS_SERVER in .env" in err.stderr


def test_image_runs_as_the_build_user_not_root(docker, image):
    out = run([docker, "run", "--rm", "--entrypoint", "id", image["tag"]]).stdout
    assert f"uid={USER}" in out and f"gid={USER}" in out


def test_every_module_of_the_image_has_its_bytecode(docker, image):
    """The image compiles its environment's bytecode after pip (as make setup), and trainbox's own: its user cannot
    write it beside root's files, so a module without it would be compiled again at every start of every container."""
    probe = ("import importlib.util, json, sysconfig\nfrom pathlib import Path\n" +
             inspect.getsource(without_bytecode) +
             "print(json.dumps([*without_bytecode(Path(sysconfig.get_paths()['purelib'])), "
             "*without_bytecode(Path('/opt/trainbox/train'))]))")
    out = run([docker, "run", "--rm", "--entrypoint", "python", image["tag"], "-c", probe]).stdout
    assert json.loads(out) == [], out[:3000]


def test_image_labels_and_environment(docker, image):
    info = json.loads(run([docker, "image", "inspect", image["tag"]]).stdout)[0]
    labels = info["Config"]["Labels"]
    import hashlib

    assert labels["org.trainbox.lock.sha256"] == hashlib.sha256((REPO / "requirements.lock").read_bytes()).hexdigest()
    assert len(labels["org.opencontainers.image.revision"]) == 40
    env = dict(item.split("=", 1) for item in info["Config"]["Env"])
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and "compute" in env["NVIDIA_DRIVER_CAPABILITIES"]
    assert env["TRAINBOX_IMAGE"] == image["tag"]


def _layer_folders(docker: str, tag: str) -> list[str] | None:
    """The image's layers where this engine keeps them (overlay2's diff folders, every one of them), or None where
    they are not ours to read (another storage driver, a remote engine, a user who is not root)."""
    driver = json.loads(run([docker, "image", "inspect", "--format", "{{json .GraphDriver}}", tag]).stdout)
    data = driver.get("Data") or {}
    folders = [data.get("UpperDir", ""), *data.get("LowerDir", "").split(":")]
    folders = [f for f in folders if f]
    readable = all(os.path.isdir(f) and os.access(f, os.R_OK | os.X_OK) for f in folders)
    return folders if driver.get("Name") == "overlay2" and folders and readable else None


def test_the_ca_secret_is_in_no_layer(docker, image):
    """Nothing the image holds carries the extra CA bundle's marker: no layer's file (its contents or its name), nor
    the image's configuration and history. The layers are read where the engine keeps them (what `docker save`
    would stream, tens of seconds for this image), else from `docker save`."""
    marker, tag = image["marker"], image["tag"]
    folders = _layer_folders(docker, tag)
    if folders:
        contents = subprocess.run(["grep", "-r", "-a", "-l", "-F", marker, *folders], capture_output=True, text=True)
        assert contents.returncode == 1 and not contents.stdout, "the extra CA bundle was stored in a layer: " + \
            (contents.stdout or contents.stderr)[:2000]
        names = run(["find", *folders, "-name", f"*{marker}*"]).stdout
        assert not names, names[:2000]
        described = run([docker, "image", "inspect", tag]).stdout + \
            run([docker, "history", "--no-trunc", "--format", "{{.CreatedBy}}", tag]).stdout
        assert "trainbox" in described and marker not in described  # (the labels name trainbox: the right image)
    else:
        save = subprocess.Popen([docker, "save", tag], stdout=subprocess.PIPE)
        found = subprocess.run(["grep", "-a", "-c", "-F", marker], stdin=save.stdout, capture_output=True, text=True)
        save.wait()
        assert save.returncode == 0
        assert found.stdout.strip() == "0", "the extra CA bundle was stored in a layer"
    assert "pip: using the extra CA bundle (secret extra_ca)" in image["log"]  # it was used, though


@pytest.mark.parametrize("files, gpu", [(["docker-compose.yml"], False),
                                        (["docker-compose.yml", "docker/compose.gpu.yml"], True)],
                         ids=["cpu", "gpu"])
def test_compose_config_is_valid(docker, nas, files, gpu):
    _, env_file = nas
    args = [a for f in files for a in ("-f", f)]
    config = compose(env_file, *args, "config").stdout
    assert f"user: {USER}:{USER}" in config or f"user: '{USER}:{USER}'" in config
    assert ("driver: nvidia" in config) == gpu
    assert ":/opt/trainbox/data:ro" in config
    # OpenMP's wait policy reaches the trainer when the shell sets it (tests/__init__.py does), and only then
    assert "OMP_WAIT_POLICY: PASSIVE" in config
    assert "OMP_WAIT_POLICY: null" in compose(env_file, *args, "config", unset=["OMP_WAIT_POLICY"]).stdout


def test_compose_run_trainer_on_cpu_trains_resumes_and_files_belong_to_the_user(docker, image, nas):
    """GPUS=2: torchrun in the container, the two workers sharding the model (--parallel fsdp: FSDP2 over gloo),
    stopped and resumed; every file the host user's."""
    root, env_file = nas
    sharded = ["--preset", "debug", "--parallel", "fsdp", "--run-dir", "runs/c1"]
    first = compose(env_file, "run", "--rm", "trainer", *sharded, "--stop-at", "25", gpus="2", expect=75)
    assert "2 workers on CPU (gloo) via torchrun" in first.stderr
    assert not _about_other_services(first.stderr), first.stderr[:3000]
    run_dir = root / "runs" / "c1"
    assert json.loads((run_dir / "status.json").read_text())["state"] == "stopped"
    second = compose(env_file, "run", "--rm", "trainer", *sharded, gpus="2")
    assert "resumed from runs/c1/checkpoints/step_00000025.pt" in second.stderr
    assert json.loads((run_dir / "plan.json").read_text())["parallel"]["kind"] == "fsdp"
    for path in [run_dir, run_dir / "model.pt", *run_dir.joinpath("checkpoints").iterdir()]:
        assert (path.stat().st_uid, path.stat().st_gid) == (USER, USER), path
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert (manifest["world_size"], manifest["image"]) == (2, IMAGE)


def test_compose_run_with_no_arguments_starts_the_default_run(docker, image, nas, default_run):
    """No arguments: the default run, 1 worker, in runs/<timestamp> on the NAS, the same run as the local
    quickstart step for step (what it learns is checked on that one). Stopped, as a user would, once it
    is well under way: the container's own signal handling is part of what is tested."""
    root, env_file = nas
    project = f"trainbox-test-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "GPUS": "", "TRAINBOX_IMAGE": IMAGE}
    proc = subprocess.Popen([*COMPOSE, "--env-file", str(env_file), "-p", project, "run", "--rm", "trainer"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: any(reached_step(d, 60)() for d in (root / "runs").iterdir()), 300, "step 60", proc)
        container = run([docker, "ps", "-q", "--filter", f"label=com.docker.compose.project={project}"]).stdout.split()
        assert len(container) == 1
        inside = json.loads(run([docker, "inspect", "--format", "{{json .Config.Env}}", container[0]]).stdout)
        assert "OMP_WAIT_POLICY=PASSIVE" in inside  # the shell's (tests/__init__.py), passed through by compose
        run([docker, "kill", "--signal", "TERM", container[0]])
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        run([*COMPOSE, "-p", project, "down"], expect=None, env=env)
    assert proc.returncode == 75, err[-3000:]
    assert "1 worker on CPU (gloo)" in err
    (run_dir,) = (root / "runs").iterdir()  # runs/<timestamp> on the NAS
    assert status(run_dir)["state"] == "stopped"
    config, local = (json.loads((d / "config.json").read_text()) for d in (run_dir, default_run))
    where = ("run_dir", "data_dir")  # the paths differ inside the container; every other setting is the default's
    assert {k: v for k, v in config.items() if k not in where} == {k: v for k, v in local.items() if k not in where}
    ours = {m["step"]: m["loss"] for m in metrics(run_dir, "train")}
    theirs = {m["step"]: m["loss"] for m in metrics(default_run, "train") if m["step"] in ours}
    assert len(ours) >= 2 and ours == theirs  # the same losses, bit for bit, as the local default run


def test_make_train_and_doctor_in_the_container(docker, image, nas, tmp_path):
    root, env_file = nas
    common = [f"DOCKER={docker}", f"IMAGE={IMAGE}", f"ENV_FILE={env_file}"]
    trained = run(["make", "--no-print-directory", "train", *common, "GPUS=0",
                   "ARGS=--preset debug --max-steps 10 --run-dir runs/m1"], cwd=REPO, timeout=600)
    assert not _about_other_services(trained.stderr), trained.stderr[:3000]
    manifest = json.loads((root / "runs" / "m1" / "manifest.json").read_text())
    # it ran in the container: the image's digest as the engine has it, on the container's own host name
    digest = run([docker, "image", "inspect", "--format", "{{.Id}}", IMAGE]).stdout.strip()
    assert manifest["image"] == IMAGE and manifest["image_digest"] == digest
    assert manifest["hostnames"] != [socket.gethostname()] and manifest["python"].startswith("3.")
    doctor = run(["make", "--no-print-directory", "doctor", "RUNTIME=docker", *common], cwd=REPO, timeout=600)
    assert f"runs is writable as uid {USER}" in doctor.stdout
    assert "all-reduce     2 workers (gloo)" in doctor.stdout and "all checks passed" in doctor.stdout


@pytest.mark.skipif(os.getuid() != 0, reason="the root host user's case (rented cloud GPU machines)")
def test_a_root_user_alternates_local_and_container_runs_on_the_default_runs_folder(docker, image, tmp_path,
                                                                                     reference_run):
    """As root, with `make env`'s defaults: a local run makes runs/ (root's), the container resumes it,
    a local run finishes it, and the end is bit-identical to an uninterrupted run."""
    import shutil as _shutil

    from tests.helpers import assert_bit_identical

    env_file = tmp_path / "compose.env"
    common = [f"DOCKER={docker}", f"IMAGE={IMAGE}", f"ENV_FILE={env_file}", "GPUS=0"]
    run(["make", "--no-print-directory", "env", f"ENV_FILE={env_file}"], cwd=REPO)
    assert "HOST_UID=0\n" in env_file.read_text() and f"RUNS_DIR={REPO / 'runs'}\n" in env_file.read_text()
    name = f"root-alternates-{uuid.uuid4().hex[:8]}"
    try:
        # make reports a recipe's exit 75 (stopped at a checkpoint) as "Error 75" and exits 2 itself
        local = run(["make", "--no-print-directory", "train", "RUNTIME=local", *common,
                     f"ARGS=--preset debug --stop-at 15 --run-dir runs/{name}"], cwd=REPO, expect=2)
        assert "trainbox: local environment" in local.stderr and "Error 75" in local.stderr, local.stderr[-3000:]
        container = run(["make", "--no-print-directory", "train", "RUNTIME=docker", *common,
                         f"ARGS=--preset debug --stop-at 30 --run-dir runs/{name}"], cwd=REPO, expect=2, timeout=600)
        assert f"trainbox: container {IMAGE}" in container.stderr and "Error 75" in container.stderr
        assert f"resumed from runs/{name}/checkpoints/step_00000015.pt" in container.stderr, container.stderr[-3000:]
        local = run(["make", "--no-print-directory", "train", "RUNTIME=local", *common,
                     f"ARGS=--preset debug --run-dir runs/{name}"], cwd=REPO)
        assert f"resumed from runs/{name}/checkpoints/step_00000030.pt" in local.stderr, local.stderr[-3000:]
        run_dir = REPO / "runs" / name
        for path in [run_dir, *run_dir.rglob("*")]:
            assert (path.stat().st_uid, path.stat().st_gid) == (0, 0), path
        assert_bit_identical(run_dir, reference_run("--preset", "debug", workers=1))
    finally:
        _shutil.rmtree(REPO / "runs" / name, ignore_errors=True)


@pytest.mark.skipif(os.getuid() != 0, reason="the root host user's case")
def test_a_root_owned_nas_folder_works_as_root_and_is_named_for_another_container_user(docker, image, tmp_path):
    """RUNS_DIR on the NAS, root's: a root user's container writes it; a container user of another UID
    (an older .env, HOST_UID=1234) is stopped by make, before the container starts, with the fix."""
    runs = tmp_path / "nas" / "runs"
    runs.mkdir(parents=True)
    env_file = tmp_path / "compose.env"
    run(["make", "--no-print-directory", "env", f"ENV_FILE={env_file}", f"RUNS_DIR={runs}"], cwd=REPO)
    common = [f"DOCKER={docker}", f"IMAGE={IMAGE}", f"ENV_FILE={env_file}", "GPUS=0", "RUNTIME=docker"]
    run(["make", "--no-print-directory", "train", *common, "ARGS=--preset debug --max-steps 5 --run-dir runs/r1"],
        cwd=REPO, timeout=600)
    assert (runs / "r1" / "model.pt").stat().st_uid == 0
    env_file.write_text(env_file.read_text().replace("HOST_UID=0", f"HOST_UID={USER}").replace("HOST_GID=0",
                                                                                               f"HOST_GID={USER}"))
    refused = run(["make", "--no-print-directory", "train", *common,
                   "ARGS=--preset debug --max-steps 5 --run-dir runs/r2"], cwd=REPO, expect=2)
    assert (f"error: {runs} belongs to uid 0 (gid 0) and the container runs as uid {USER} (gid {USER}, "
            f"HOST_UID/HOST_GID in {env_file}), which cannot write it: run `make env`") in refused.stderr
    assert "1 worker on CPU" not in refused.stderr and not (runs / "r2").exists()  # no container started


def test_make_train_falls_back_to_the_local_environment_without_an_engine(tmp_path):
    proc = run(["make", "--no-print-directory", "train", "DOCKER=/nonexistent/docker",
                f"ARGS=--preset debug --max-steps 5 --run-dir {tmp_path / 'run'}"], cwd=REPO, timeout=600)
    assert "trainbox: local environment" in proc.stderr


def test_tensorboard_service_serves_the_runs_on_the_nas(docker, image, nas, cluster):
    """On the host's loopback only: node n1 of the test cluster, another host, cannot reach it."""
    import time
    import urllib.request

    from tests.e2e.test_services import from_n1
    from tests.helpers import CLUSTER_HOST, python_cmd
    from train.cluster.identity import free_port

    root, env_file = nas
    run(python_cmd("--preset", "debug", "--max-steps", 10, "--run-dir", root / "runs" / "tb1"))
    port = free_port()
    env_file.write_text(env_file.read_text() + f"TENSORBOARD_PORT={port}\n")
    project = ["-p", f"trainbox-test-{port}"]
    compose(env_file, *project, "up", "-d", "tensorboard")
    try:
        deadline, seen = time.monotonic() + 120, ""
        while time.monotonic() < deadline and "tb1/tensorboard" not in seen:
            try:
                seen = urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs", timeout=5).read().decode()
            except OSError:
                time.sleep(1)
        if "tb1/tensorboard" not in seen:
            logs = compose(env_file, *project, "logs", "tensorboard", expect=None)
            state = run([docker, "ps", "-a", "--filter", f"label=com.docker.compose.project=trainbox-test-{port}"])
            raise AssertionError(f"TensorBoard did not answer on 127.0.0.1:{port}\n{state.stdout}\n"
                                 f"{logs.stdout[-3000:]}{logs.stderr[-3000:]}")
        tags = urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/scalars/tags", timeout=5).read()
        assert b"train/loss" in tags and b"eval/accuracy" in tags
        assert from_n1(f"http://{CLUSTER_HOST}:{port}/data/runs") == "ConnectionRefusedError"
    finally:
        compose(env_file, *project, "down", expect=None)


@pytest.fixture(scope="module")
def mlflow_tag(docker):
    """The MLflow server image's tag for the module's tests: `make mlflow` builds it when missing; it and its
    build cache go when the module ends."""
    tag, cache_before = "trainbox-mlflow:test", set(_build_cache(docker))
    yield tag
    subprocess.run([docker, "image", "rm", "-f", tag], capture_output=True)
    _prune_build_cache(docker, keep=cache_before)


def test_make_mlflow_serves_the_compose_runs_with_its_store_on_the_nas(docker, standin_base, image, nas, cluster,
                                                                        tmp_path, mlflow_tag):
    """`make mlflow` builds the server image (docker/mlflow.Dockerfile) and starts the compose service; a
    compose run pointed at it (`make env MLFLOW_TRACKING_URI=http://mlflow:5000`) is tracked there, and
    the server keeps its store and the uploaded model on the NAS, as the host user. Published on the
    host's loopback only: node n1 of the test cluster, another host, cannot reach it; with MLFLOW_EXPOSE=1
    it can, with a login only (the admin password a secret file of the user's)."""
    from mlflow import MlflowClient

    from tests.e2e.test_services import SEARCH, from_n1
    from tests.helpers import CLUSTER_HOST

    from train.cluster.identity import free_port

    root, env_file = nas
    port, tag = free_port(), mlflow_tag
    run(["make", "--no-print-directory", "env", f"ENV_FILE={env_file}", f"HOST_UID={USER}", f"HOST_GID={USER}",
         "MLFLOW_TRACKING_URI=http://mlflow:5000"], cwd=REPO)
    assert "MLFLOW_TRACKING_URI=http://mlflow:5000\n" in env_file.read_text()
    common = [f"DOCKER={docker}", f"IMAGE={IMAGE}", f"ENV_FILE={env_file}", f"MLFLOW_IMAGE={tag}",
              f"MLFLOW_PORT={port}"]
    try:
        # The system CA bundle as the build's extra CA: here PyPI is reached through a TLS-intercepting proxy.
        up = run(["make", "--no-print-directory", "mlflow", "RUNTIME=docker", f"MLFLOW_BASE_IMAGE={standin_base}",
                  "EXTRA_CA=/etc/ssl/certs/ca-certificates.crt", *common], cwd=REPO, timeout=1200)
        assert f"MLflow on http://127.0.0.1:{port}" in up.stdout
        wait_for(lambda: _answers(f"http://127.0.0.1:{port}/health"), 120, "the MLflow service")
        assert from_n1(f"http://{CLUSTER_HOST}:{port}{SEARCH}") == "ConnectionRefusedError"
        client = MlflowClient(f"http://127.0.0.1:{port}")
        trained = compose(env_file, "run", "--rm", "trainer", "--preset", "debug", "--max-steps", "10",
                          "--run-dir", "runs/ml1")
        assert "mlflow: run" in trained.stderr and "is complete (FINISHED)" in trained.stderr, trained.stderr[-3000:]
        run_id = json.loads((root / "runs" / "ml1" / "mlflow.json").read_text())["run_id"]
        again = compose(env_file, "run", "--rm", "trainer", "--preset", "debug", "--max-steps", "20",
                        "--run-dir", "runs/ml1")  # `docker compose run` again: trains on, tracked in the same run
        assert f"mlflow: continuing run {run_id}" in again.stderr, again.stderr[-3000:]
        tracked = client.get_run(run_id)
        assert tracked.info.status == "FINISHED"
        assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [10, 20]
        assert tracked.data.tags["image"] == IMAGE
        stored = list((root / "runs" / "mlflow" / "artifacts").rglob("model.pt"))
        assert len(stored) == 1 and stored[0].read_bytes() == (root / "runs" / "ml1" / "model.pt").read_bytes()
        for path in (root / "runs" / "mlflow" / "mlflow.db", stored[0]):
            assert (path.stat().st_uid, path.stat().st_gid) == (USER, USER), path
        compose(env_file, "down")
        # A team server: on every interface, a login for every request
        password = tmp_path / "mlflow-admin"
        password.write_text("Zq8-vT3r_Lm2Wx9K\n")
        os.chown(password, USER, USER)  # the host user's file, readable in the container as that user
        password.chmod(0o600)
        weak = run(["make", "--no-print-directory", "mlflow", "RUNTIME=docker", "MLFLOW_EXPOSE=1", *common],
                   cwd=REPO, expect=2)
        assert "error: MLFLOW_EXPOSE=1 opens the server to the network only with a login" in weak.stderr
        run(["make", "--no-print-directory", "mlflow", "RUNTIME=docker", "MLFLOW_EXPOSE=1",
             f"MLFLOW_ADMIN_PASSWORD_FILE={password}", *common], cwd=REPO, timeout=600)
        try:
            wait_for(lambda: from_n1(f"http://{CLUSTER_HOST}:{port}/health") == "200", 120, "the exposed service")
        except AssertionError as e:
            logs = compose(env_file, "logs", "mlflow", expect=None)
            here = _answers(f"http://127.0.0.1:{port}/health")
            raise AssertionError(f"{e}; on this host it answers: {here}; from n1: "
                                 f"{from_n1(f'http://{CLUSTER_HOST}:{port}/health')}\n"
                                 f"{run(['iptables', '-S', 'FORWARD']).stdout}\n{logs.stdout[-3000:]}") from None
        assert from_n1(f"http://{CLUSTER_HOST}:{port}{SEARCH}") == "401"
        assert from_n1(f"http://{CLUSTER_HOST}:{port}{SEARCH}", "admin", "Zq8-vT3r_Lm2Wx9X") == "401"
        assert from_n1(f"http://{CLUSTER_HOST}:{port}{SEARCH}", "admin", "Zq8-vT3r_Lm2Wx9K") == "200"
        config = run([docker, "inspect", "--format", "{{json .Config}}",
                      run([*COMPOSE, "--env-file", str(env_file), "ps", "-q", "mlflow"], cwd=REPO).stdout.strip()])
        assert "Zq8-vT3r_Lm2Wx9K" not in config.stdout  # not in the container's command line or environment
    finally:
        compose(env_file, "down", expect=None)


def _answers(url: str) -> bool:
    import urllib.request

    try:
        return urllib.request.urlopen(url, timeout=5).read() == b"OK"
    except OSError:
        return False


@pytest.mark.skipif(os.getuid() != 0, reason="the root host user's case")
def test_the_services_of_a_root_user_run_as_another_user_with_the_password_of_its_file(docker, standin_base,
                                                                                       mlflow_tag, tmp_path):
    """As root, with `make env`'s defaults: the trainer runs as root, the services never (1000); the MLflow
    store on the NAS is their user's alone, the store URI is in no command line, MLFLOW_AUTH=1 asks for the
    login on loopback, and `make mlflow` after the password file changed starts it with the new password."""
    from tests.e2e.test_services import SEARCH
    from train.cluster.identity import free_port

    runs, env_file, port = tmp_path / "nas" / "runs", tmp_path / "compose.env", free_port()
    runs.mkdir(parents=True)
    run(["make", "--no-print-directory", "env", f"ENV_FILE={env_file}", f"RUNS_DIR={runs}"], cwd=REPO)
    assert "HOST_UID=0\n" in env_file.read_text() and "SERVICE_UID=1000\nSERVICE_GID=1000\n" in env_file.read_text()
    services = yaml.safe_load(compose(env_file, "config").stdout)["services"]
    assert {name: str(service["user"]) for name, service in services.items()} == {
        "trainer": "0:0", "tensorboard": "1000:1000", "mlflow": "1000:1000"}

    password = tmp_path / "mlflow-admin"
    password.write_text("Hk5-rN2w_Bq8Zt3M\n")
    password.chmod(0o600)
    marker = f"store-{uuid.uuid4().hex[:12]}"
    common = [f"DOCKER={docker}", f"ENV_FILE={env_file}", f"MLFLOW_IMAGE={mlflow_tag}", f"MLFLOW_PORT={port}",
              f"MLFLOW_BASE_IMAGE={standin_base}", "EXTRA_CA=/etc/ssl/certs/ca-certificates.crt", "RUNTIME=docker",
              "MLFLOW_AUTH=1", f"MLFLOW_ADMIN_PASSWORD_FILE={password}"]
    env = {**os.environ, "MLFLOW_BACKEND_STORE_URI": f"sqlite:////opt/trainbox/runs/mlflow/{marker}.db"}
    try:
        refused = run(["make", "--no-print-directory", "mlflow", *common], cwd=REPO, env=env, expect=2, timeout=1200)
        assert (f"error: MLFLOW_ADMIN_PASSWORD_FILE={password} belongs to uid 0 and the MLflow container runs as uid "
                f"1000 (SERVICE_UID in {env_file}), which cannot read it: run `chown 1000:1000 {password}`") \
            in refused.stderr, refused.stderr[-3000:]
        os.chown(password, 1000, 1000)
        run(["make", "--no-print-directory", "mlflow", *common], cwd=REPO, env=env, timeout=1200)
        assert "uid=1000 gid=1000" in run([docker, "run", "--rm", "--entrypoint", "id", mlflow_tag]).stdout
        search = f"http://127.0.0.1:{port}{SEARCH}"
        wait_for(lambda: _status(search) == 401, 120, "the MLflow service with a login")
        assert _status(search, ("admin", "Hk5-rN2w_Bq8Zt3M")) == 200
        container = run([*COMPOSE, "--env-file", str(env_file), "ps", "-q", "mlflow"], cwd=REPO).stdout.strip()
        assert run([docker, "inspect", "--format", "{{.Config.User}}", container]).stdout.strip() == "1000:1000"
        processes = run([docker, "top", container, "-eo", "pid,uid,args"]).stdout.splitlines()[1:]
        assert len(processes) >= 2 and all(line.split()[1] == "1000" for line in processes), processes
        assert not [line for line in processes if marker in line], processes  # the store URI: no command line's
        store = runs / "mlflow"
        for path in (store, store / f"{marker}.db", store / "basic_auth.db", store / "artifacts"):
            assert (path.stat().st_uid, path.stat().st_gid) == (1000, 1000), path
            assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, f"{path} is readable by others"

        password.write_text("Vc7-jL4p_Xs9Dk2N\n")  # a new admin password: `make mlflow` again starts with it
        up = run(["make", "--no-print-directory", "mlflow", *common], cwd=REPO, env=env, timeout=600)
        assert f"MLflow on http://127.0.0.1:{port}" in up.stdout
        wait_for(lambda: _status(search, ("admin", "Vc7-jL4p_Xs9Dk2N")) == 200, 120, "the new admin password")
        assert _status(search, ("admin", "Hk5-rN2w_Bq8Zt3M")) == 401
        logs = compose(env_file, "logs", "mlflow").stdout
        assert "admin's password is now the one in MLFLOW_ADMIN_PASSWORD_FILE" in logs
    finally:
        compose(env_file, "down", expect=None)


def _image_exists(docker: str, tag: str) -> bool:
    return subprocess.run([docker, "image", "inspect", tag], capture_output=True).returncode == 0


def _status(url: str, login: tuple[str, str] | None = None) -> int | None:
    import base64
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url)
    if login:
        request.add_header("Authorization", "Basic " + base64.b64encode(":".join(login).encode()).decode())
    try:  # the first request with a login takes seconds on a busy machine (the password hash is slow on purpose)
        return urllib.request.urlopen(request, timeout=60).status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def test_a_base_image_that_cannot_be_fetched_is_one_line_with_the_choices(docker, tmp_path):
    """An air-gapped cluster: the engine answers, the base image's registry does not. `make train`, `make
    build` and `make mlflow` say so in one line with the choices, before any build starts."""
    base, tag = "registry.invalid/nothing:1", f"trainbox:no-base-{uuid.uuid4().hex[:8]}"
    env_file = tmp_path / "compose.env"
    for target, knobs, image, knob in (
            ("train", ["RUNTIME=docker", f"BASE_IMAGE={base}", f"IMAGE={tag}"], tag, "BASE_IMAGE"),
            ("build", [f"BASE_IMAGE={base}", f"IMAGE={tag}"], tag, "BASE_IMAGE"),
            ("mlflow", ["RUNTIME=docker", f"MLFLOW_BASE_IMAGE={base}", f"MLFLOW_IMAGE={tag}"], tag,
             "MLFLOW_BASE_IMAGE")):
        proc = run(["make", "--no-print-directory", target, f"DOCKER={docker}", f"ENV_FILE={env_file}", *knobs],
                   cwd=REPO, expect=None, timeout=300)
        assert proc.returncode != 0 and proc.stdout == "", (target, proc.stdout, proc.stderr)
        lines = [line for line in proc.stderr.splitlines() if not re.match(r"make(\[\d+\])?: \*\*\* ", line)]
        assert len(lines) == 1, (target, proc.stderr)
        assert lines[0].startswith(f"error: the base image {base} of {image} cannot be fetched (") and \
            lines[0].endswith(f"): run without the image (RUNTIME=local), build on a base your site mirrors "
                              f"({knob}=...), or `docker load` an image {image} built elsewhere (`docker save "
                              f"{image}` there)"), (target, lines[0])
        assert "registry.invalid" in lines[0].split("cannot be fetched (")[1]  # the engine's own reason
        assert not _image_exists(docker, tag) and not env_file.exists()
