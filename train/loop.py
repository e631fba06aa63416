"""The training loop: set up, resume, train, evaluate, checkpoint, stop on a signal."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from train import checkpoint as ckpt
from train.config import MODEL_KEYS, Config, ConfigError
from train.data import build_datasets, build_train_loader, build_val_loader
from train.launch import EXIT_STOPPED
from train.distributed import (control_group, gather, identity, init, is_main, pick_device, teardown,
                               watch_limit)
from train.metrics import GpuTelemetry, MetricsWriter, build_manifest, process_start_time, write_manifest
from train.models import build_model
from train.watchdog import watchdog

log = logging.getLogger("train")



# ---------------------------------------------------------------- agreement between ranks

def broadcast_from_main(value):
    """Rank 0's value on every rank (plain Python objects)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=control_group())
    return box[0]


def raise_if_main_failed(error: str | None) -> None:
    """Rank 0 did something alone (mkdir, save); every rank raises the same error so none waits forever."""
    error = broadcast_from_main(error)
    if error:
        raise ConfigError(error)


class StopSignal:
    """SIGTERM, SIGUSR2 or a first Ctrl-C on any rank stops every rank after the same step.

    Each step starts an async all-reduce (MAX, on the gloo control group, so no device sync) of the
    local flag and reads the previous step's result: all ranks see the same answer on the same step."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)

    def __init__(self):
        self.received: str | None = None
        self._work = None
        self._buffer = None
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        if self.received and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the checkpoint
        self.received = signal.Signals(signum).name

    def agreed(self) -> bool:
        if not dist.is_initialized():
            return self.received is not None
        stop = False
        if self._work is not None:
            self._work.wait()
            stop = self._buffer.item() > 0
        self._buffer = torch.tensor([1.0 if self.received else 0.0])
        self._work = dist.all_reduce(self._buffer, op=dist.ReduceOp.MAX, group=control_group(), async_op=True)
        return stop

    def close(self, wait: bool) -> None:
        if self._work is not None and wait:  # after an error the peers may be gone: do not wait
            self._work.wait()
        self._work = None
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_DFL)


# ---------------------------------------------------------------- set-up pieces

def configure_runtime(cfg: Config) -> None:
    """Threads and determinism, before any tensor work."""
    ident = identity()
    threads = cfg.threads
    if threads == 0:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = 1 if cfg.deterministic else max(1, cores // ident.local_world_size)
    torch.set_num_threads(threads)
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    else:
        torch.backends.cudnn.benchmark = True


def ordered_allreduce_hook(group, bucket):
    """Gradient averaging whose summation order is rank 0 + rank 1 + ... for every element, whatever
    DDP's bucket layout: results stay bit-identical when buckets are rebuilt after a restart."""
    tensor = bucket.buffer()
    world = dist.get_world_size(group)
    parts = [torch.empty_like(tensor) for _ in range(world)]
    future = dist.all_gather(parts, tensor, group=group, async_op=True).get_future()

    def combine(_):
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total.div_(world)

    return future.then(combine)


def resolve_precision(cfg: Config, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for fp32."""
    if cfg.precision == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    if cfg.precision in ("fp16", "bf16") and device.type != "cuda":
        raise ConfigError(f"--precision {cfg.precision} needs a CUDA GPU: use --precision fp32 (or auto) on CPU")
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.precision]


def _fusable(p: torch.Tensor) -> bool:
    """Fused optimizer kernels take real tensors stored densely: a strided view would be updated wrongly."""
    layouts = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)
    return p.is_floating_point() and any(p.is_contiguous(memory_format=f) for f in layouts)


def _keep_this_runs_kernels(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """A saved optimizer's param groups carry the kernels it ran with; a resume keeps this run's choice."""
    for saved, current in zip(state_dict["param_groups"], optimizer.param_groups, strict=False):
        saved["fused"], saved["foreach"] = current.get("fused"), current.get("foreach")
    return state_dict


def build_optimizer(cfg: Config, model: torch.nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]  # norms and biases
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # Fused kernels update every parameter in one pass, on CUDA and on CPU alike (make bench: AdamW's
    # step alone is several times faster on CPU than torch's default there); torch's default otherwise.
    fused = all(_fusable(p) for p in decay + no_decay) or None
    if cfg.optimizer == "sgd":
        optimizer = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0, fused=fused)
    else:
        optimizer = torch.optim.AdamW(groups, lr=cfg.lr, fused=fused)
    optimizer.register_load_state_dict_pre_hook(_keep_this_runs_kernels)
    return optimizer


def lr_factor(cfg: Config, step: int) -> float:
    """Linear warm-up to 1, then cosine decay to min_lr_ratio at max_steps."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def prepare_inputs(x: torch.Tensor, device: torch.device, channels_last: bool) -> torch.Tensor:
    x = x.to(device, non_blocking=True).float().div_(255).sub_(0.5).div_(0.25)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def resolve_run_dir(cfg: Config) -> Path:
    """--run-dir, else runs/<start time>. Under torchrun that is the start of torchrun itself (the parent),
    so the attempts it restarts after a failure resume the same run instead of starting new ones."""
    run_dir = cfg.run_dir
    if not run_dir and is_main():
        started = process_start_time(os.getppid()) if "TORCHELASTIC_RUN_ID" in os.environ else time.time()
        run_dir = time.strftime("runs/%Y%m%d-%H%M%S", time.localtime(started))
    return Path(broadcast_from_main(run_dir))


def setup_logging(run_dir: Path | None) -> None:
    log.handlers.clear()
    log.propagate = False
    log.setLevel(logging.INFO if is_main() else logging.WARNING)
    console = logging.StreamHandler()
    prefix = "" if is_main() else f"[rank {identity().global_rank}] "
    console.setFormatter(logging.Formatter(f"{prefix}%(asctime)s %(message)s", "%H:%M:%S"))
    log.addHandler(console)
    if run_dir is not None:
        handler = logging.FileHandler(run_dir / "train.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)


# ---------------------------------------------------------------- evaluation

@torch.inference_mode()
def evaluate(model, loader, device, autocast_dtype, channels_last: bool, progress=lambda: None) -> dict:
    """Loss and accuracy over the whole validation set, each sample counted once across ranks.

    Every rank evaluates with rank 0's buffers (BatchNorm statistics), those the checkpoint and model.pt
    hold: a rank's own differ after its last training batch, and the figures would then depend on
    whether the run was resumed. The next training step broadcasts rank 0's buffers anyway (DDP)."""
    if dist.is_initialized():
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for x, y in loader:
        x, y = prepare_inputs(x, device, channels_last), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(x)
        totals[0] += F.cross_entropy(logits.float(), y, reduction="sum")
        totals[1] += (logits.argmax(1) == y).sum()
        totals[2] += y.numel()
        progress()
    if dist.is_initialized():
        dist.all_reduce(totals)
    loss, correct, count = totals.tolist()
    model.train()
    return {"loss": loss / count, "accuracy": correct / count, "samples": int(count)}


# ---------------------------------------------------------------- the run

def main(cfg: Config) -> int:
    """Train according to cfg in this process (one rank). Returns the exit code."""
    ident = identity()
    watchdog.label = f"rank {ident.global_rank}"
    configure_runtime(cfg)
    device = pick_device(cfg.device, ident)
    autocast_dtype = resolve_precision(cfg, device)
    init(device, cfg.timeout_s)
    stop = StopSignal()
    clean = False
    try:
        code = _run(cfg, device, autocast_dtype, stop)
        clean = True
        return code
    finally:
        try:
            stop.close(wait=clean)
            teardown(clean, cfg.timeout_s)
        finally:
            watchdog.pause()


def _run(cfg: Config, device: torch.device, autocast_dtype, stop: StopSignal) -> int:
    ident = identity()
    rank, world = ident.global_rank, ident.world_size
    run_dir = resolve_run_dir(cfg)
    finished = broadcast_from_main(ckpt.finished(run_dir, cfg.max_steps) if is_main() else None)
    if finished:
        # A restart after the run ended (a worker lost during shutdown), or the same command again: the
        # run's figures stand; nothing is evaluated or written again.
        if is_main():
            print(f"trainbox: {run_dir} already finished at step {finished['step']} (model.pt written): nothing "
                  f"to do; pass a larger --max-steps to train on, or a new --run-dir", file=sys.stderr)
        return 0
    error = None
    if is_main():
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            probe = run_dir / f".write-test-{os.getpid()}"
            probe.write_text("ok")
            probe.unlink()
            ckpt.write_status(run_dir, "starting", -1)  # a crash before training must not look "stopped"
            freed = ckpt.remove_partial(run_dir)
            if freed:
                print(f"removed {freed / 2**20:.1f} MiB of unfinished checkpoint files", file=sys.stderr)
        except OSError as e:
            error = f"run directory {run_dir} is not writable ({e.strerror}): pass a writable --run-dir"
    raise_if_main_failed(error)
    setup_logging(run_dir if is_main() else None)

    # Data and model: identical on every rank (the seed drives both); DDP also broadcasts rank 0's weights.
    torch.manual_seed(cfg.seed)
    train_set, val_set, num_classes = build_datasets(cfg)
    pin = device.type == "cuda"
    train_loader, sampler = build_train_loader(cfg, train_set, rank, world, pin, device)
    val_loader = build_val_loader(cfg, val_set, rank, world, pin, device)
    batches_per_epoch = (len(train_set) // world) // cfg.batch_size
    steps_per_epoch = batches_per_epoch // cfg.grad_accum
    if steps_per_epoch == 0:
        raise ConfigError(f"{len(train_set)} training samples are fewer than one step needs "
                          f"({world} workers x {cfg.batch_size} x {cfg.grad_accum}): "
                          f"lower --batch-size or --grad-accum")

    raw_model = build_model(cfg, num_classes)
    if cfg.sync_bn and world > 1:
        raw_model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(raw_model)
    raw_model.to(device)
    if cfg.channels_last:
        raw_model.to(memory_format=torch.channels_last)
    optimizer = build_optimizer(cfg, raw_model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg, s))
    scaler = torch.amp.GradScaler(device.type, enabled=autocast_dtype == torch.float16)

    # Resume: rank 0 picks the newest checkpoint that verifies; every rank loads it.
    step, epoch, step_in_epoch, eval_owed = 0, 0, 0, False
    latest, error = None, None
    if is_main():
        try:
            latest = ckpt.newest_valid(run_dir)
        except OSError as e:
            error = f"cannot read the checkpoints in {run_dir} ({e.strerror or e}): check the disk and permissions"
    raise_if_main_failed(error)
    latest = broadcast_from_main(str(latest) if latest else None)
    if latest:
        state = ckpt.load_checkpoint(Path(latest), device)
        if not isinstance(state, dict) or not {"model", "optimizer", "step", "config"} <= state.keys():
            raise ConfigError(f"{latest} is not a trainbox checkpoint (no model/optimizer/step/config): "
                              f"move it out of the run directory")
        for key in MODEL_KEYS:
            if state["config"].get(key) != getattr(cfg, key):
                raise ConfigError(f"{latest} was made with {key}={state['config'].get(key)!r}, this run has "
                                  f"{key}={getattr(cfg, key)!r}: use a new --run-dir or the same {key}")
        try:
            raw_model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise ConfigError(f"{latest} does not fit this model ({str(e).splitlines()[0][:160]}): "
                              f"use a new --run-dir, or the code that made the checkpoint") from None
        scheduler.load_state_dict(state["scheduler"])
        if state["scaler"] and scaler.is_enabled():  # empty unless the checkpoint was made with fp16
            scaler.load_state_dict(state["scaler"])
        step, epoch, step_in_epoch = state["step"], state["epoch"], state["step_in_epoch"]
        # A stop at an evaluation step saves before evaluating: the evaluation is owed (older checkpoints: none).
        eval_owed = state.get("eval_owed", False) and step < cfg.max_steps
        saved_layout = (state["world_size"], state["batch_size"], state["grad_accum"])
        if saved_layout != (world, cfg.batch_size, cfg.grad_accum):
            # Keep the epoch position as samples seen, rounded down to a whole step of the new layout.
            seen = step_in_epoch * saved_layout[0] * saved_layout[1] * saved_layout[2]
            step_in_epoch = seen // (world * cfg.batch_size * cfg.grad_accum)
            log.warning("resuming a checkpoint of %d workers x batch %d x accumulation %d with %d x %d x %d: "
                        "same data order, but results will differ from an uninterrupted run",
                        *saved_layout, world, cfg.batch_size, cfg.grad_accum)
        if state["world_size"] != world:  # per-rank RNG streams cannot carry over
            torch.manual_seed(cfg.seed * 7919 + rank + step)
        else:
            torch.set_rng_state(state["rng"][rank]["cpu"].cpu())
            if device.type == "cuda" and state["rng"][rank]["cuda"] is not None:
                torch.cuda.set_rng_state(state["rng"][rank]["cuda"].cpu(), device)
        log.info("resumed from %s (step %d of %d)", latest, step, cfg.max_steps)
        del state
    else:
        torch.manual_seed(cfg.seed * 7919 + rank)  # per-rank stream for dropout and the like

    model = raw_model
    if cfg.compile:
        model = torch.compile(model)
    if dist.is_initialized():
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    gradient_as_bucket_view=True, bucket_cap_mb=cfg.bucket_cap_mb, static_graph=cfg.static_graph)
        if cfg.deterministic and world > 1:
            model.register_comm_hook(None, ordered_allreduce_hook)

    hostnames = gather(socket.gethostname())
    error = None
    if is_main():
        try:
            (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
            write_manifest(run_dir, build_manifest(cfg, ident, device, hostnames, step if latest else None))
            ckpt.write_status(run_dir, "running", step, max_steps=cfg.max_steps)
        except OSError as e:
            error = f"could not write to {run_dir} ({e.strerror or e}): check the disk and its permissions"
    raise_if_main_failed(error)
    if is_main():
        log.info("run %s: %d worker(s) via %s on %s, %d steps (%d per epoch), global batch %d, precision %s",
                 run_dir, world, ident.launcher, device.type, cfg.max_steps, steps_per_epoch,
                 world * cfg.batch_size * cfg.grad_accum, str(autocast_dtype or "fp32").replace("torch.", ""))
    metrics = MetricsWriter(run_dir if is_main() else None, cfg.tensorboard, resume_step=step if latest else 0)
    telemetry = GpuTelemetry(device)

    last_eval = -1

    def is_eval_step(at: int) -> bool:
        return bool(cfg.eval_every) and at % cfg.eval_every == 0 and at < cfg.max_steps

    def save(reason: str) -> None:
        watchdog.enter(f"the checkpoint save of step {step}", watch_limit(cfg.timeout_s))
        rng = gather({"cpu": torch.get_rng_state(),
                      "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None})
        error = None
        if is_main():
            state = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                     "step": step, "epoch": epoch, "step_in_epoch": step_in_epoch, "world_size": world,
                     "batch_size": cfg.batch_size, "grad_accum": cfg.grad_accum, "rng": rng,
                     "config": cfg.to_dict(), "eval_owed": is_eval_step(step) and last_eval != step}
            try:
                path = ckpt.save_checkpoint(run_dir, step, state, cfg.keep_checkpoints)
                log.info("saved %s (%s)", path, reason)
            except OSError as e:
                previous = ckpt.list_checkpoints(run_dir)[-1:]
                error = (f"could not save the checkpoint of step {step} in {run_dir} ({e.strerror or e}); "
                         f"{'kept ' + previous[0].name if previous else 'no earlier checkpoint'}: "
                         f"free space or fix permissions, then run the same command to resume")
                with contextlib.suppress(OSError):  # best effort: the disk may be full
                    ckpt.write_status(run_dir, "failed", step, error=error,
                                      needed_bytes=getattr(e, "needed", 0))
        raise_if_main_failed(error)
        watchdog.enter("training", watch_limit(cfg.timeout_s))

    def run_eval() -> dict:
        nonlocal last_eval
        last_eval = step
        watchdog.enter(f"evaluation at step {step}", watch_limit(cfg.timeout_s))
        result = evaluate(raw_model, val_loader, device, autocast_dtype, cfg.channels_last, watchdog.progress)
        watchdog.enter("training", watch_limit(cfg.timeout_s))
        log.info("eval step %d: loss %.4f, accuracy %.2f%% over %d samples",
                 step, result["loss"], 100 * result["accuracy"], result["samples"])
        metrics.write(step, "eval", result)
        return result

    criterion = torch.nn.CrossEntropyLoss()
    model.train()
    exit_code = 0
    last_saved = step if latest else -1
    window_loss = torch.zeros(1, device=device)
    window_steps, window_wait, window_start = 0, 0.0, time.perf_counter()
    first_step = True
    watchdog.enter("training", watch_limit(cfg.timeout_s))
    if eval_owed:
        run_eval()
    if cfg.stop_at and latest and cfg.stop_at <= step < cfg.max_steps:
        log.info("--stop-at %d: already at step %d, nothing to train (exit %d)", cfg.stop_at, step, EXIT_STOPPED)
        exit_code = EXIT_STOPPED
        if is_main():
            ckpt.write_status(run_dir, "stopped", step, max_steps=cfg.max_steps, exit_code=EXIT_STOPPED)
    while step < cfg.max_steps and not exit_code:
        sampler.set_epoch(epoch, start=step_in_epoch * cfg.grad_accum * cfg.batch_size)
        batches = iter(train_loader)
        while step_in_epoch < steps_per_epoch and step < cfg.max_steps:
            for micro in range(cfg.grad_accum):
                wait_start = time.perf_counter()
                x, y = next(batches)
                window_wait += time.perf_counter() - wait_start
                x, y = prepare_inputs(x, device, cfg.channels_last), y.to(device, non_blocking=True)
                last_micro = micro == cfg.grad_accum - 1
                sync = contextlib.nullcontext() if last_micro or not isinstance(model, DDP) else model.no_sync()
                with sync:
                    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                        loss = criterion(model(x), y) / cfg.grad_accum
                    scaler.scale(loss).backward()
                window_loss += loss.detach()
            if cfg.grad_clip > 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            step_in_epoch += 1
            window_steps += 1
            watchdog.progress()
            if first_step:  # launch to first optimizer step, start-up cost included (no sync: logged once)
                first_step = False
                metrics.write(step, "first_step", {"since_start_s": time.time() - process_start_time()})

            if step % cfg.log_every == 0 or step == cfg.max_steps:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                elapsed = time.perf_counter() - window_start
                totals = torch.cat([window_loss, torch.tensor([window_wait], device=device)])
                if dist.is_initialized():
                    dist.all_reduce(totals)
                loss_mean, wait_mean = (totals / world).tolist()
                values = {"loss": loss_mean / window_steps, "lr": scheduler.get_last_lr()[0],
                          "samples_per_s": window_steps * world * cfg.batch_size * cfg.grad_accum / elapsed,
                          "step_time_s": elapsed / window_steps, "data_wait_frac": wait_mean / elapsed,
                          "epoch": epoch}
                for r, reading in enumerate(gather(telemetry.read()) if device.type == "cuda" else []):
                    # A rank without NVML reads []: it adds nothing.
                    names = ("util", "mem_mib", "power_w")
                    values.update({f"gpu{r}_{k}": v for k, v in zip(names, reading, strict=False)})
                log.info("step %d/%d  loss %.4f  lr %.2e  %.0f samples/s  data wait %.1f%%", step, cfg.max_steps,
                         values["loss"], values["lr"], values["samples_per_s"], 100 * values["data_wait_frac"])
                metrics.write(step, "train", values)
                window_loss.zero_()
                window_steps, window_wait, window_start = 0, 0.0, time.perf_counter()

            if stop.agreed() or step == cfg.stop_at:
                reason = "--stop-at" if step == cfg.stop_at else stop.received or "a stop signal on another rank"
                log.info("%s: saving at step %d and exiting with code %d (run again to resume)",
                            reason, step, EXIT_STOPPED)
                save(reason)
                last_saved, exit_code = step, EXIT_STOPPED
                if is_main():
                    ckpt.write_status(run_dir, "stopped", step, max_steps=cfg.max_steps, exit_code=EXIT_STOPPED)
                break
            if is_eval_step(step):
                run_eval()
            if step % cfg.save_every == 0 and step < cfg.max_steps:
                save("every %d steps" % cfg.save_every)
                last_saved = step
        if step_in_epoch >= steps_per_epoch:
            epoch, step_in_epoch = epoch + 1, 0

    if not exit_code:
        if last_saved != step:
            save("end of run")
        final = run_eval()
        if is_main():
            ckpt.atomic_write(run_dir / "model.pt", _serialise(raw_model.state_dict()))
            ckpt.write_status(run_dir, "done", step, max_steps=cfg.max_steps,
                              **{f"val_{k}": v for k, v in final.items()})
            log.info("done: %s", run_dir / "model.pt")
    metrics.close()
    return exit_code


def _serialise(state_dict: dict) -> bytes:
    import io  # noqa: PLC0415

    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    return buffer.getvalue()
