"""--dry-run as a user runs it: python -m train and make train print the plan as JSON and exit 0, with no run
folder, no download and no training; and the plan is what a run then trains from (its plan.json, its learning
rates)."""

import json
from pathlib import Path

from tests.helpers import DEBUG, PY, REPO, env_for_tests, make, metrics, python_cmd, run, without_bytecode

KEYS = {"max_steps", "steps_per_epoch", "world_size", "global_batch", "param_groups", "normalize", "train_transform",
        "eval_transform", "lr", "ema", "sampler", "precision", "weights"}


def test_a_dry_run_prints_the_plan_and_leaves_nothing_behind(tmp_path):
    """Named weights, image files, 4 workers: the plan names them all, nothing is fetched into TORCH_HOME and no
    run folder appears where the run would have written."""
    data = tmp_path / "data"
    for split in ("train", "val"):
        for label in ("cat", "dog"):
            (data / split / label).mkdir(parents=True)
            for i in range(160):
                (data / split / label / f"{i}.jpg").touch()  # a plan lists the files and opens none
    home, here = tmp_path / "torch-home", tmp_path / "cwd"
    home.mkdir()
    here.mkdir()
    args = ["--dataset", "imagefolder", "--data-dir", data, "--model", "efficientnet_v2_l", "--weights", "DEFAULT",
            "--batch-size", 4, "--epochs", 2, "--model-ema", "--ra-reps", 2, "--spawn", 4, "--dry-run"]
    out = run(python_cmd(*args), cwd=here, env=env_for_tests(TORCH_HOME=str(home)))
    plan = json.loads(out.stdout)
    assert KEYS <= plan.keys()
    # 320 images, cut to 256 by the repeated-augmentation sampler: 64 per worker, 16 steps of 4 an epoch
    assert (plan["world_size"], plan["global_batch"], plan["steps_per_epoch"], plan["max_steps"]) == (4, 16, 16, 32)
    assert plan["normalize"] == {"mean": [0.5] * 3, "std": [0.5] * 3}  # EfficientNet-V2-L's own statistics
    assert "Resize(size=[480], interpolation=InterpolationMode.BICUBIC" in plan["eval_transform"]
    assert plan["weights"]["torchvision"] == "EfficientNet_V2_L_Weights.IMAGENET1K_V1"
    assert "RASampler" in plan["sampler"] and plan["ema"]["every_steps"] == 32
    assert list(home.iterdir()) == [] and list(here.iterdir()) == []  # nothing fetched, no runs/ folder
    assert "Traceback" not in out.stderr


def test_make_train_dry_run_plans_for_the_workers_it_would_start(tmp_path):
    out = make("train", "RUNTIME=local", "GPUS=3", f"ARGS=--preset debug --run-dir {tmp_path / 'run'} --dry-run")
    plan = json.loads(out.stdout)
    assert (plan["world_size"], plan["global_batch"], plan["steps_per_epoch"]) == (3, 48, 10)
    assert not (tmp_path / "run").exists()


def test_the_plan_is_what_the_run_trains_from(tmp_path):
    """The dry run's plan equals the plan.json a run of the same command writes, and the learning rate the run
    logs after each step is the plan's for the next step."""
    run_dir = tmp_path / "run"
    args = [*DEBUG, "--run-dir", run_dir, "--spawn", 2, "--log-every", 1, "--model-ema", "--label-smoothing", "0.1",
            "--norm-weight-decay", "0", "--mixup-alpha", "0.2"]
    planned = json.loads(run(python_cmd(*args, "--dry-run")).stdout)
    assert not run_dir.exists()
    run(python_cmd(*args))
    assert json.loads((run_dir / "plan.json").read_text()) == planned
    logged = [(m["step"], m["lr"]) for m in metrics(run_dir, "train")]
    assert planned["lr"]["per"] == "step" and len(logged) == planned["max_steps"] == 40
    assert all(lr == planned["lr"]["values"][step] for step, lr in logged[:-1])
    assert [len(g["params"]) for g in planned["param_groups"]] == [8, 12]  # convolutions and head; 6 BatchNorms


def test_a_dry_run_refuses_what_the_run_would_refuse(tmp_path):
    refused = run([PY, "-m", "train", "--dataset", "imagefolder", "--data-dir", tmp_path / "none", "--dry-run"],
                  expect=2)
    assert refused.stderr.startswith("error: ") and len(refused.stderr.strip().splitlines()) == 1
    cifar = run(python_cmd("--dataset", "cifar10", "--data-dir", tmp_path / "none", "--download", "--dry-run"),
                expect=2)
    assert "--dry-run downloads nothing" in cifar.stderr and not (tmp_path / "none").exists()


def test_repeated_augmentation_on_one_worker_says_it_samples_plainly(tmp_path):
    out = run(python_cmd(*DEBUG, "--ra-reps", 3, "--max-steps", 2, "--eval-every", 0, "--run-dir", tmp_path / "run"))
    lines = [line for line in out.stderr.splitlines() if "--ra-reps 3 on one worker samples plainly" in line]
    assert len(lines) == 1 and "sampler: one shuffled pass" in lines[0]


def test_the_installed_package_runs_from_any_folder(tmp_path):
    """make setup installs the project into .venv (editable, from pyproject.toml): no PYTHONPATH, no checkout
    as the working directory."""
    env = {k: v for k, v in env_for_tests().items() if k != "PYTHONPATH"}
    out = run([PY, "-m", "train", "--preset", "debug", "--dry-run"], cwd=tmp_path, env=env)
    assert json.loads(out.stdout)["max_steps"] == 40 and list(tmp_path.iterdir()) == []
    where = run([PY, "-c", "import train; print(train.__file__)"], cwd=tmp_path, env=env).stdout.strip()
    assert where == str(REPO / "train" / "__init__.py")
    site = run([PY, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env=env).stdout.strip()
    assert without_bytecode(Path(site)) == []  # torch's modules too: compiled by make setup, not at each start
    # trainbox's own too: compiled by make setup, and again by make test for what was edited since
    assert without_bytecode(REPO / "train") == [], "run the suite with make test: it compiles them first"
