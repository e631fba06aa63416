"""`python -m train.doctor` (what `make doctor` runs locally): a real all-reduce, and a failing one that
must be reported, not hang the report."""

from tests.helpers import PY, env_for_tests, run


def doctor(tmp_path, **env):
    for sub in ("data", "runs"):
        (tmp_path / sub).mkdir(exist_ok=True)
    return run([PY, "-m", "train.doctor", "--workers", "2", "--data-dir", str(tmp_path / "data"),
                "--runs-dir", str(tmp_path / "runs")], expect=None, timeout=200, env=env_for_tests(**env))


def test_doctor_reduces_across_two_workers(tmp_path):
    proc = doctor(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all-reduce     2 workers (gloo), 16 MiB" in proc.stdout and "all checks passed" in proc.stdout
    assert "[ok  ] fsdp           2 workers (gloo): a sharded step gathers the parameters and sums the gradients" \
        in proc.stdout, proc.stdout


def test_doctor_reports_workers_that_cannot_form_a_group(tmp_path):
    # The workers die in init_process_group: the check fails with gloo's reason instead of waiting forever.
    proc = doctor(tmp_path, GLOO_SOCKET_IFNAME="trainbox-no-such-if0")
    assert proc.returncode == 1
    line = next(line for line in proc.stdout.splitlines() if "all-reduce" in line)
    assert line.startswith("[FAIL]") and "trainbox-no-such-if0" in line and "GLOO_SOCKET_IFNAME" in line
    assert "1 check(s) failed: all-reduce" in proc.stdout


def test_doctor_on_a_fresh_checkout_without_nas_folders(tmp_path):
    proc = run([PY, "-m", "train.doctor", "--workers", "1"], cwd=tmp_path, timeout=120)  # every check passes
    lines = {line[7:].split()[0]: line for line in proc.stdout.splitlines() if line.startswith("[")}
    assert lines["data"].startswith("[info]") and "only CIFAR-10 and ImageFolder runs need one" in lines["data"]
    assert lines["runs"].startswith("[ok  ]") and ". is writable" in lines["runs"]


def test_doctor_fails_a_named_folder_that_is_missing(tmp_path):
    proc = run([PY, "-m", "train.doctor", "--workers", "1", "--data-dir", str(tmp_path / "nas" / "datasets")],
               expect=1, cwd=tmp_path, timeout=120)
    assert f"[FAIL] data           {tmp_path / 'nas' / 'datasets'} does not exist: mount the NAS" in proc.stdout
