"""make evaluate and make export answer a bad command line, run folder or checkpoint name in one line before they import
torch (a process where torch cannot be imported refuses them all the same), and import it once everything holds."""

import json
import subprocess
import sys

from tests.helpers import env_for_tests
from train.config.settings import Config
from train.files.rundir import to_json

# Each command in the same process, torch made unimportable: its exit code and what it wrote to stderr, or the
# exception that ended it.
SCRIPT = """
import contextlib, io, json, os, sys
sys.modules["torch"] = None
from train import evaluate, export
said = []
for command, argv, env in json.loads(sys.argv[1]):
    os.environ.update(env)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            code = {"evaluate": evaluate, "export": export}[command].main(argv)
    except Exception as e:
        code, err = None, io.StringIO(f"{type(e).__name__}: {e}")
    for key in env:
        del os.environ[key]
    said.append([code, err.getvalue()])
print(json.dumps(said))
"""


def _finished_run(folder, model="resnet18", checkpoint=True, **settings):
    folder.mkdir()
    (folder / "config.json").write_text(to_json(Config().replace(model=model, **settings).to_dict()))
    (folder / "classes.json").write_text('["a", "b"]')
    if checkpoint:
        (folder / "model.pt").write_bytes(b"weights")
    return str(folder)


def test_refusals_come_before_torch_is_imported(tmp_path):
    run, unfinished = _finished_run(tmp_path / "run"), _finished_run(tmp_path / "unfinished", checkpoint=False)
    planted = _finished_run(tmp_path / "planted", model="planted:net")
    on_files = _finished_run(tmp_path / "on-files", dataset="imagefolder", data_dir="/nas/cifar")
    nowhere = str(tmp_path / "nowhere")
    cases = [
        (("evaluate", [nowhere], {}), f"{nowhere} is not a trainbox run directory"),
        (("evaluate", [run, "--chekpoint", "best"], {}),  # argparse's own mistakes: one line naming --help
         "unrecognized arguments: --chekpoint best (see python -m train.evaluate --help)"),
        (("export", [run, "--format"], {}), "argument --format: expected one argument (see python -m train.export "
                                            "--help)"),
        (("evaluate", [run, "--weights", "best"], {}), "--weights best: a finished run's weights are --checkpoint"),
        (("evaluate", [run, "--gpus", "-1"], {}), "GPUS=-1: a count of workers cannot be negative"),
        (("evaluate", [run, "--gpus", "two"], {}), "GPUS='two' is not a number"),
        (("evaluate", [run, "--spawn", "2"], {"RANK": "0", "WORLD_SIZE": "2"}), "would start workers twice"),
        (("evaluate", [unfinished], {}), "the run has not finished (no model.pt)"),
        (("evaluate", [run, "--checkpoint", "best"], {}), "no evaluation yet (no best.pt)"),
        (("evaluate", [planted], {}), "was trained with --model planted:net, code outside trainbox"),
        (("evaluate", [run, "--data-dir", "/nas/val2"], {}),  # shapes: another set's name on the seed's images
         f"--data-dir /nas/val2 has no effect on {run}: it trained on --dataset shapes, made from the seed"),
        (("export", [nowhere], {}), f"{nowhere} is not a trainbox run directory"),
        (("export", [run, "--format", "tflite"], {}), "--format tflite: pass pt2"),
        (("export", [run, "--out", str(tmp_path / "no" / "model.pt2")], {}), f"{tmp_path / 'no'} does not exist"),
        (("export", [planted, "--model", "other:net"], {}), "and --model other:net does not name it"),
    ]
    going_on = [("evaluate", [run], {}), ("evaluate", [run, "--gpus", "0"], {}), ("export", [run], {}),
                ("evaluate", [on_files, "--data-dir", "/nas/val2"], {})]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps([case for case, _ in cases] + going_on)],
                          env=env_for_tests(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    said = json.loads(proc.stdout)
    for (case, expected), (code, err) in zip(cases, said):
        assert code == 2 and err.startswith("error: ") and expected in err and len(err.splitlines()) == 1, (case, err)
    for case, (code, err) in zip(going_on, said[len(cases):]):  # a run folder that holds: on to torch
        assert code is None and err.startswith("ModuleNotFoundError: import of torch halted"), (case, err)
