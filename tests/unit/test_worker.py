"""How a worker ends (train/run/worker.py), in this process: each error as its exit code and at most one line, said by
the rank that should say it; what counts as an error a restart cannot mend."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from train.base.errors import EXIT_BAD_INPUT, EXIT_FAILED, ConfigError, DataError, OutOfMemory, PeerGaveUp
from train.base.watchdog import watchdog
from train.cli import parse_config
from train.cluster.identity import PeersNeverCame
from train.run.memory import advice, lower_precision, out_of_memory
from train.run.worker import exit_code, unrecoverable
from train.tasks.factory import build_task


def _interrupted_while_saving() -> RuntimeError:
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("torch.save was interrupted") from None
    except RuntimeError as e:
        return e


def _first_is_false(error):
    error.first = False
    return error


@pytest.mark.parametrize("error, code, line", [
    (ConfigError("--lr must be positive: give --lr 0.1"), EXIT_BAD_INPUT,
     "error: --lr must be positive: give --lr 0.1"),
    (DataError("images/a.jpg cannot be read: delete it"), EXIT_BAD_INPUT,
     "error: [rank 0] images/a.jpg cannot be read: delete it"),
    (_first_is_false(OutOfMemory("out of memory")), EXIT_BAD_INPUT, None),  # another rank said it first
    (PeerGaveUp("a peer's line"), EXIT_BAD_INPUT, None),  # the peer said it
    (PeersNeverCame("rank 1 did not join"), EXIT_FAILED, "error: [rank 0] rank 1 did not join"),
    (dist.DistNetworkError("Connection reset by peer"), EXIT_FAILED,
     "error: [rank 0] lost contact with the other workers during training (Connection reset by peer)"),
    (KeyboardInterrupt(), 130, "error: [rank 0] interrupted by a second Ctrl-C during training"),
    (_interrupted_while_saving(), 130, "error: [rank 0] interrupted by a second Ctrl-C during training"),
    (RuntimeError("a bug"), None, None),  # a crash: it goes on as itself, with its traceback
])
def test_each_error_ends_the_worker_with_its_code_and_at_most_one_line(capsys, error, code, line):
    watchdog.begin("rank 0")
    watchdog.enter("training", 60)
    try:
        assert exit_code(error, 0) == code
    finally:
        watchdog.pause()
    errors = [text for text in capsys.readouterr().err.splitlines() if text.startswith("error:")]
    assert errors == ([] if line is None else [errors[0]]) and (line is None or errors[0].startswith(line)), errors


def test_once_the_watchdog_said_its_line_the_worker_says_none():
    watchdog.begin("rank 0")
    assert watchdog.claim_report()  # the watchdog's line is out: it ends the process
    assert exit_code(ConfigError("x"), 0) == EXIT_FAILED


def test_what_a_restart_cannot_mend():
    cfg, cpu = parse_config(["--preset", "debug"]), torch.device("cpu")
    assert str(unrecoverable(ConfigError("bad\nOriginal Traceback (most recent call last):\nValueError: why"), None,
                             cpu, cfg, "fp32", None)) == "why"
    watchdog.enter("training", 60)
    try:
        trainer = SimpleNamespace(step=4, parts=SimpleNamespace(cfg=cfg, task=build_task(cfg)))
        oom = unrecoverable(torch.OutOfMemoryError("Tried to allocate 2.00 GiB"), trainer, cpu, cfg, "fp32", None)
    finally:
        watchdog.pause()
    assert isinstance(oom, OutOfMemory) and "training step 5" in str(oom)
    assert unrecoverable(RuntimeError("a crash"), None, cpu, cfg, "fp32", None) is None  # a restart may mend it


def test_out_of_memory_in_a_run_with_a_checkpoint_advises_what_its_next_start_takes(tmp_path):
    """A run laid out for 2 workers (--grad-accum 1), resumed on 1 (accumulation 2), out of memory at step 5: its
    checkpoint fixes the batch, the sizes and the precision (a resume with others is refused), so the line does not
    send it back with other flags, nor name the accumulation the command gave."""
    given = parse_config(["--preset", "debug", "--run-dir", str(tmp_path)])
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step_00000004.pt").write_bytes(b"")
    # the Trainer's parts hold the config as train/config/resume.py continued it
    trainer = SimpleNamespace(step=4, parts=SimpleNamespace(cfg=given.replace(grad_accum=2), task=build_task(given)))
    watchdog.enter("training", 60)
    try:
        oom = str(unrecoverable(torch.OutOfMemoryError("Tried to allocate 2.00 GiB"), trainer, torch.device("cpu"),
                                given, "fp32", tmp_path))
    finally:
        watchdog.pause()
    assert oom.endswith(f"the run's checkpoint fixes its --batch-size, --image-size and --precision: run the same "
                        f"command on a device with more memory, or start a new --run-dir from its weights (--weights "
                        f"{tmp_path}/checkpoints/step_00000004.pt) with a smaller --batch-size (now 16; a larger "
                        f"--grad-accum keeps the global batch) or a smaller --image-size (now 16)"), oom
    assert "--grad-accum, now" not in oom and "then run the same command" not in oom


@pytest.mark.parametrize("flags, where, lower, fixes", [
    ([], "training step 1", "bf16", "a smaller --image-size (now 16) or --precision bf16, then"),
    ([], "training step 1", None, "or a smaller --image-size (now 16), then"),  # bf16 chosen by auto, or a CPU
    (["--dataset", "imagefolder", "--train-crop-size", "176", "--val-crop-size", "224", "--image-size", "224"],
     "training step 1", "fp16", "a smaller --train-crop-size (now 176) or --precision fp16, then"),
    (["--dataset", "imagefolder", "--train-crop-size", "176", "--val-crop-size", "224", "--image-size", "224"],
     "evaluation at step 10", None, "or a smaller --val-crop-size (now 224), then"),
    (["--task", "lm"], "training step 1", None, "or a smaller --task-settings context (now 64), then"),
    (["--task", "lm", "--task-settings", "context=32"], "evaluation at step 10", "bf16",
     "a smaller --task-settings context (now 32) or --precision bf16, then"),
])
def test_out_of_memory_names_the_flags_that_size_what_ran_out(flags, where, lower, fixes):
    """The size a step trains at (the recipe's training crop, a language model's context) or an evaluation scores at,
    as the task says (Task.sizes); a lower precision only where the run trains in fp32 on a GPU (lower: bf16 where the
    GPU has it, else fp16), never the one auto already chose."""
    cfg = parse_config(["--preset", "debug", *flags])
    sizes = build_task(cfg).sizes(where)
    assert advice(cfg.optimisation, sizes, None, lower).endswith(f"{fixes} run the same command")
    assert ("--precision" in advice(cfg.optimisation, sizes, None, lower)) == (lower is not None)


def test_out_of_memory_of_a_task_that_names_no_size_advises_the_batch_alone(tmp_path):
    """A task of one's own names no size by default (Task.sizes): the batch, and the precision where there is one."""
    opt = parse_config(["--preset", "debug"]).optimisation
    assert advice(opt, [], None, None) == ("use a smaller --batch-size (now 16; a larger --grad-accum, now 1, keeps "
                                           "the global batch), then run the same command")
    assert advice(opt, [], tmp_path / "step_4.pt", "fp16").startswith(
        "the run's checkpoint fixes its --batch-size and --precision: run the same command on a device with more "
        "memory, or start a new --run-dir from its weights")


def test_out_of_memory_names_a_lower_precision_only_below_the_one_the_run_trains_in():
    """--precision auto resolves to bf16 on a GPU that has it: the advice then names none, as for fp16 or a CPU."""
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert lower_precision(gpu, "bf16") is lower_precision(gpu, "fp16") is lower_precision(cpu, "fp32") is None
    if torch.cuda.is_available():
        assert lower_precision(gpu, "fp32") == ("bf16" if torch.cuda.is_bf16_supported() else "fp16")
    cfg = parse_config(["--preset", "debug"])
    error = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1024 bytes")
    assert "--precision" not in str(out_of_memory(error, "training step 1", cpu, cfg.optimisation, [], "fp32", None))


def test_out_of_memory_of_a_model_whole_on_several_workers_advises_sharding_it(tmp_path):
    """A new run whose workers each hold the whole model (--parallel ddp on 2 or more) is told it can shard it; one
    worker has nothing to shard over, and a run with a checkpoint keeps its --parallel."""
    opt = parse_config(["--preset", "debug"]).optimisation
    assert advice(opt, [], None, None, replicas=4).endswith(
        "keeps the global batch) or --parallel fsdp (each of the 4 workers then holds 1/4 of the model's parameters, "
        "gradients and optimizer state), then run the same command")
    assert "--parallel" not in advice(opt, [], None, None, replicas=1)
    assert "--parallel" not in advice(opt, [], tmp_path / "step_4.pt", None, replicas=4)
