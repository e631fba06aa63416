"""The checkpointer (train/run/checkpointer.py) on a real small model, optimizer, schedule and EMA, in this process:
what it saves comes back whole, the Trainer's position and the random stream included, and it alone writes the weights
files."""

import pytest
import torch

from train.cli import parse_config
from train.components.ema import ModelEma
from train.components.models import build_model
from train.components.optim import build_optimizer, build_scheduler, schedule_lengths
from train.config.resume import Layout
from train.files import checkpoint_io as ckpt
from train.files import rundir
from train.run.checkpointer import Checkpointer, Keeping, capture_rng, newest_checkpoint, restore_rng
from train.run.plan import dry_run
from train.tasks.factory import build_task

CPU = torch.device("cpu")
# A checkpoint's layout, in order: what trainbox's checkpoints hold (a change here is a change of the file format).
LAYOUT = ["model", "optimizer", "scheduler", "scaler", "step", "epoch", "step_in_epoch", "world_size", "batch_size",
          "grad_accum", "layout", "max_steps", "rng", "config", "eval_owed", "best", "ema", "best_ema", "task"]


def _position(step: int, step_in_epoch: int = 0, epoch: int = 0, eval_owed: bool = False) -> dict:
    """What the Trainer gives the checkpointer (Trainer.state_dict)."""
    return {"step": step, "epoch": epoch, "step_in_epoch": step_in_epoch, "eval_owed": eval_owed}


def _checkpointer(tmp_path, seed: int, *flags: str) -> Checkpointer:
    """A checkpointer over a freshly made model (its weights drawn from `seed`), optimizer, schedule and EMA."""
    cfg = parse_config(["--preset", "debug", "--model-ema", "--run-dir", str(tmp_path), *flags])
    plan = dry_run(cfg, 1)
    torch.manual_seed(seed)
    model = build_model(cfg.model, plan.num_classes)
    optimizer = build_optimizer(cfg.optimisation, model, plan.param_groups)
    scheduler = build_scheduler(cfg.schedule, optimizer, *schedule_lengths(cfg.schedule, cfg.run.epochs, plan.max_steps,
                                                                         plan.warmup_steps))
    return Checkpointer(tmp_path, CPU, Keeping.of(cfg), plan, Layout(1, cfg.optimisation.batch_size, 1), model=model,
                        optimizer=optimizer, scheduler=scheduler, scaler=torch.amp.GradScaler("cpu", enabled=False),
                        ema=ModelEma(model, plan.ema["decay"], CPU), task=build_task(cfg))


def _train(checkpointer, steps: int) -> None:
    """A few real optimizer steps: state in the optimizer, the schedule and the EMA."""
    model = checkpointer.model
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(torch.randn(4, 3, 16, 16)), torch.randint(0, 4, (4,)))
        loss.backward()
        checkpointer.optimizer.step()
        checkpointer.optimizer.zero_grad()
        checkpointer.scheduler.step()
        checkpointer.ema.update_parameters(model)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_a_checkpoint_comes_back_whole_into_parts_made_afresh(tmp_path):
    saver = _checkpointer(tmp_path, seed=0)
    _train(saver, 7)
    saver.keep_best(7, {"loss": 1.5, "accuracy": 0.25, "samples": 256})
    saver.save(_position(7, step_in_epoch=7), "a test")
    next_draws = torch.rand(5)  # the stream the run goes on with after the save
    saved = {name: getattr(saver, name).state_dict() for name in ("model", "optimizer", "scheduler", "ema")}

    loader = _checkpointer(tmp_path, seed=1)  # other weights, no state, another stream
    torch.rand(3)
    state, source = newest_checkpoint(tmp_path, CPU)
    assert list(state) == LAYOUT and source.name == "step_00000007.pt"
    resumed = loader.restore(state, source)

    assert (resumed.step, resumed.max_steps, resumed.world_size) == (7, loader.plan.max_steps, 1)
    assert resumed.position == _position(7, step_in_epoch=7)
    for name, before in saved.items():
        assert _same(getattr(loader, name).state_dict(), before), name
    assert loader.best == saver.best and loader.best["step"] == 7 and loader.saved_step == 7
    assert torch.equal(torch.rand(5), next_draws)  # this rank's random stream, where the save left it


def test_a_checkpoint_saved_at_an_epoch_s_end_resumes_at_the_next_one_s_start(tmp_path):
    saver = _checkpointer(tmp_path, seed=0)
    per_epoch = saver.plan.steps_per_epoch
    saver.save(_position(per_epoch, step_in_epoch=per_epoch, eval_owed=True), "a test")
    resumed = _checkpointer(tmp_path, seed=0).restore(*newest_checkpoint(tmp_path, CPU))
    assert resumed.position == _position(per_epoch, epoch=1, step_in_epoch=0, eval_owed=True)


def test_a_fresh_start_takes_its_rank_s_own_stream(tmp_path):
    checkpointer = _checkpointer(tmp_path, 0, "--seed", "3")
    assert checkpointer.restore(None, None) is None
    drawn = torch.rand(3)
    torch.manual_seed(3 * 7919 + 0)
    assert torch.equal(drawn, torch.rand(3))


def test_the_rng_capture_and_restore_go_round():
    rng = capture_rng(CPU)
    first = torch.rand(4)
    restore_rng(rng, CPU)
    assert torch.equal(torch.rand(4), first)


def test_every_weights_file_comes_from_the_checkpointer(tmp_path):
    """best.pt and best_ema.pt keep the better evaluation (a tie keeps the earlier); model.pt and model_ema.pt are
    the weights as torch.save writes them; status.json names the best files."""
    checkpointer = _checkpointer(tmp_path, seed=0)
    checkpointer.keep_best(10, {"accuracy": 0.5, "loss": 1.0})
    checkpointer.keep_best(10, {"accuracy": 0.4, "loss": 1.0}, ema=True)
    checkpointer.keep_best(20, {"accuracy": 0.5, "loss": 0.9})  # a tie: the earlier stays
    checkpointer.keep_best(20, {"accuracy": 0.6, "loss": 0.9}, ema=True)
    best = ckpt.load_checkpoint(tmp_path / "best.pt", CPU)
    best_ema = ckpt.load_checkpoint(tmp_path / "best_ema.pt", CPU)
    assert (best["step"], best["val_accuracy"], best_ema["step"], best_ema["val_accuracy"]) == (10, 0.5, 20, 0.6)
    assert _same(best["model"], checkpointer.model.state_dict())
    checkpointer.save_final()
    assert (tmp_path / "model.pt").read_bytes() == ckpt.serialise(checkpointer.model.state_dict())
    assert (tmp_path / "model_ema.pt").read_bytes() == ckpt.serialise(checkpointer.ema.module.state_dict())
    checkpointer.record("done", 20)
    status = rundir.read_status(tmp_path)
    assert (status["state"], status["step"], status["max_steps"]) == ("done", 20, checkpointer.plan.max_steps)
    assert (status["best"]["path"], status["best"]["step"], status["best_ema"]["step"]) == ("best.pt", 10, 20)


def test_a_checkpoint_past_the_run_or_of_another_model_is_one_line(tmp_path):
    saver = _checkpointer(tmp_path, seed=0)
    saver.save(_position(saver.plan.max_steps + 1), "a test")
    state, source = newest_checkpoint(tmp_path, CPU)
    with pytest.raises(ValueError, match=r"past this run's 40 steps: give --max-steps of 41 or more"):
        _checkpointer(tmp_path, seed=1).restore(state, source)
    with pytest.raises(ValueError, match=r"does not fit this model .*: use a new --run-dir"):
        _checkpointer(tmp_path, 1, "--width", "16").restore(state, source)
