"""Rank 0's Tracker: the run's one MLflow run, fed by the training loop and sent by a thread of its own.

One MLflow run per run directory, whatever happens to the run: a resume, a torchrun restart, a Slurm requeue or
`docker compose run` again all find its id in RUN_DIR/mlflow.json and continue it, whatever name the server is
reached by (a server without that run gets one of its own). What it sends: the resolved config (config.json) as
params, the manifest (manifest.json, the latest start's) as tags, every metric of metrics.jsonl by step (each step
once: the steps a restart replays are not sent again, and what an attempt killed before sending had written is sent
by the next), model.pt and manifest.json as artifacts at the end, and the checkpoints when --mlflow-checkpoints asks.

The training loop only appends to a list (`Tracker.log`); a thread of its own sends in batches. When the
server is down, slow or refuses, training goes on at full speed, one warning says so, and what was kept
is sent once it answers; the end of the run says what never got there (metrics.jsonl has it all, and
running the same command again once the server is back sends the rest). Where a run is tracked, and the checks
before it starts: train/report/mlflow_tracking.py.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from pathlib import Path

from train.cluster.identity import is_main
from train.config.settings import Tracking
from train.files.checkpoint_io import list_checkpoints, sidecar_of
from train.files.rundir import atomic_write, file_digest, read_config, read_json, read_metrics, read_status, to_json
from train.report.metrics import setup_logging
from train.report.mlflow_tracking import KEY_TAG, RECORD, experiment_name, failure_reason, import_mlflow, tracking_uri

log = logging.getLogger("train")

BATCH_EVERY_S = 2.0  # how often the thread sends what the loop logged
MAX_BACKOFF_S = 30.0  # the longest wait between tries while the server does not answer


def _tag(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _chunks(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start:start + size]


class Tracker:
    """Rank 0's link to one MLflow run. `log` and `upload` only queue; `close` waits (bounded) for the
    queue to empty, marks the run FINISHED / KILLED / FAILED and says what could not be sent."""

    def __init__(self, uri: str, experiment: str, run_dir: Path, resume_step: int):
        self.uri, self.experiment, self.run_dir, self.resume_step = uri, experiment, run_dir, resume_step
        # Imported here, in the main thread, before any DataLoader worker is forked: a fork while another
        # thread imports could leave the child with an import lock held.
        self.mlflow = import_mlflow()
        self._tracked_at: str | None = None  # the address the record named, where this start's differs
        self._record()
        self.run_id: str | None = None
        self._points: list[tuple[str, float, int, int]] = []  # (key, value, time in ms, step)
        self._files: list[tuple[Path, str | None]] = []  # (file, artifact folder)
        self._sent: dict[str, set[int]] = {}  # key -> steps the run already has
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._final_status: str | None = None
        self._problem: BaseException | None = None  # the failure while the server does not answer
        self._thread = threading.Thread(target=self._send_loop, name="trainbox-mlflow", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the loop's side: queue only

    def log(self, step: int, kind: str, values: dict, when: float) -> None:
        points = [(f"{kind}/{key}", float(value), int(when * 1000), step) for key, value in values.items()
                  if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)]
        with self._lock:
            self._points.extend(points)

    def upload(self, path: Path, folder: str | None = None) -> None:
        with self._lock:
            self._files.append((Path(path), folder))
        self._wake.set()

    def close(self, status: str, timeout_s: float) -> None:
        """status: FINISHED, KILLED (stopped) or FAILED. Waits at most timeout_s."""
        self._final_status, self._closing = status, True
        self._wake.set()
        self._thread.join(timeout_s)
        with self._lock:
            points, files = list(self._points), [path.name for path, _ in self._files]
        if self._thread.is_alive() or points or files or self._final_status:
            steps = sorted({step for *_, step in points})
            what = ", ".join(filter(None, [
                f"{len(points)} metric values (steps {steps[0]}-{steps[-1]})" if points else "",
                ", ".join(files), f"the run's status ({status})" if self._final_status else ""]))
            why = failure_reason(self._problem) if self._problem else f"still sending after {timeout_s:.0f} s"
            log.warning("mlflow: could not send %s to %s (%s): metrics.jsonl and %s have everything; run the "
                        "same command once the server answers to send the rest", what or "everything", self.uri,
                        why, self.run_dir)
        else:
            log.info("mlflow: run %s at %s is complete (%s)", self.run_id, self.uri, status)

    # ------------------------------------------------------------ the thread's side: send

    def _send_loop(self) -> None:
        backoff = 1.0
        while True:
            closing = self._closing
            try:
                self._send(closing)
            except Exception as e:  # noqa: BLE001 - any failure of the server or the network: keep, retry
                if self._problem is None:
                    log.warning("mlflow: the server at %s does not take the run's data (%s): training goes on, "
                                "and what is kept is sent once it answers", self.uri, failure_reason(e))
                self._problem = e
                if closing:
                    return
                self._wake.wait(backoff)
                self._wake.clear()
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            if self._problem is not None:
                log.warning("mlflow: the server at %s answers again: sent what was kept", self.uri)
                self._problem = None
            backoff = 1.0
            if closing:
                return
            self._wake.wait(BATCH_EVERY_S)
            self._wake.clear()

    def _send(self, closing: bool) -> None:
        """One pass: the kept points, then the files. closing: close() had been called when this pass
        began, so nothing is queued after what this pass sends, and the run's status may go last."""
        if self.run_id is None:
            self._open()
        client, Metric = self.client, self.mlflow.entities.Metric
        with self._lock:
            points = list(self._points)
        fresh, seen = [], set()
        for key, value, ms, step in points:
            if step not in self._sent.get(key, ()) and (key, step) not in seen:
                seen.add((key, step))
                fresh.append((key, value, ms, step))
        for chunk in _chunks(fresh, 1000):  # MLflow's limit per request
            client.log_batch(self.run_id, metrics=[Metric(k, v, ms, s) for k, v, ms, s in chunk], synchronous=True)
            for key, _, _, step in chunk:
                self._sent.setdefault(key, set()).add(step)
        with self._lock:
            del self._points[:len(points)]
        while self._files:
            path, folder = self._files[0]
            self._upload(path, folder)
            with self._lock:
                self._files.pop(0)
        if closing and self._final_status:
            client.set_terminated(self.run_id, self._final_status)
            self._final_status = None

    def _upload(self, path: Path, folder: str | None) -> None:
        """One artifact, unless the run has these very bytes already (mlflow.json notes each one's SHA-256:
        a run trained on to a larger --max-steps sends its new model.pt, a finished run started again does
        not send it twice). A checkpoint pruned meanwhile is skipped."""
        name = f"{folder}/{path.name}" if folder else path.name
        try:
            digest = file_digest(path)
        except FileNotFoundError:
            return
        record = self._record()
        if record.get("artifacts", {}).get(name) == digest:
            return
        self.client.log_artifact(self.run_id, str(path), folder)
        record.setdefault("artifacts", {})[name] = digest
        atomic_write(self.run_dir / RECORD, (to_json(record, indent=2) + "\n").encode())

    def _open(self) -> None:
        """The run this run directory is tracked in (created on its first start), its params and tags, the
        steps it already has, and what earlier attempts wrote to metrics.jsonl but may not have sent."""
        self.client = client = self.mlflow.MlflowClient(self.uri)
        run = self._find_or_create_run()
        run_id = run.info.run_id
        self._log_params(run_id, run.data.params)
        manifest = read_json(self.run_dir / "manifest.json")
        tags = {k: _tag(v) for k, v in manifest.items() if k != "previous"}
        if manifest.get("git_commit"):
            tags["mlflow.source.git.commit"] = manifest["git_commit"]
        for chunk in _chunks([self.mlflow.entities.RunTag(k, v) for k, v in tags.items()], 100):
            client.log_batch(run_id, tags=chunk, synchronous=True)
        self._sent = {key: {m.step for m in client.get_metric_history(run_id, key)} for key in run.data.metrics}
        earlier = []
        for record in read_metrics(self.run_dir):
            if record.get("step", math.inf) <= self.resume_step:
                values = {k: v for k, v in record.items() if k not in ("step", "kind", "time")}
                earlier.append((record["step"], record["kind"], values, record.get("time", time.time())))
        with self._lock:
            kept, self._points = self._points, []
        for step, kind, values, when in earlier:
            self.log(step, kind, values, when)
        with self._lock:
            self._points.extend(kept)
        self.run_id = run_id

    def _record(self) -> dict:
        """RUN_DIR/mlflow.json, made on the first start before anything is sent: its key names the MLflow run
        (a tag) before the run exists, so that an attempt killed between creating the run and noting its id
        leaves a run the next attempt finds, not a second one. A start at another address keeps both."""
        path = self.run_dir / RECORD
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            record = {}
        if not record.get("key"):
            record = {"tracking_uri": self.uri, "experiment": self.experiment, "key": uuid.uuid4().hex}
        elif record.get("tracking_uri") != self.uri:
            # Another address: the same server by another name (localhost on the host, mlflow in compose),
            # or another server. The run's id and key stay: the run is looked up there and made anew only
            # where that server does not have it.
            self._tracked_at = record.get("tracking_uri")
            record = {**record, "tracking_uri": self.uri}
        else:
            return record
        atomic_write(path, (to_json(record, indent=2) + "\n").encode())
        return record

    def _find_or_create_run(self):
        client, record = self.client, self._record()
        run = None
        if record.get("run_id"):
            try:
                run = client.get_run(record["run_id"])
            except self.mlflow.exceptions.MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
            if run is None and self._tracked_at:
                log.warning("mlflow: run %s is not on the server at %s (it was tracked at %s): this run is "
                            "tracked in a run of its own there", record["run_id"], self.uri, self._tracked_at)
            elif run is None or run.info.lifecycle_stage == "deleted":
                log.warning("mlflow: run %s is gone from the server: this run continues in a new one",
                            record["run_id"])
                run = None
        if run is not None:
            client.update_run(run.info.run_id, status="RUNNING")
            log.info("mlflow: continuing run %s at %s", run.info.run_id, self.uri)
            return run
        experiment_id = self._experiment_id()
        found = client.search_runs([experiment_id], filter_string=f"tags.{KEY_TAG} = '{record['key']}'",
                                   max_results=1)
        if found:  # made by an attempt that ended before it could note the id
            run = found[0]
            client.update_run(run.info.run_id, status="RUNNING")
        else:
            run = client.create_run(experiment_id, run_name=self.run_dir.name,
                                    tags={"run_dir": str(self.run_dir.resolve()), KEY_TAG: record["key"]})
        # A new MLflow run (the noted one deleted, or the server's store made anew) has none of the artifacts
        # the record says were sent: they go again.
        kept = {k: v for k, v in record.items() if k != "artifacts" or record.get("run_id") == run.info.run_id}
        atomic_write(self.run_dir / RECORD, (to_json({**kept, "run_id": run.info.run_id}, indent=2) + "\n")
                     .encode())
        log.info("mlflow: tracking in run %s of experiment %r at %s", run.info.run_id, self.experiment, self.uri)
        return run

    def _log_params(self, run_id: str, logged: dict) -> None:
        """The config as params. MLflow keeps a param's first value: a resume with another value (a larger
        --max-steps, say) is named once, and config.json keeps the new one."""
        config = {k: str(v) for k, v in read_config(self.run_dir).items()}
        changed = sorted(k for k, v in config.items() if k in logged and logged[k] != v)
        if changed:
            log.warning("mlflow: params keep the run's first values; changed since: %s",
                        ", ".join(f"{k} ({logged[k]} -> {config[k]})" for k in changed))
        new = [self.mlflow.entities.Param(k, v) for k, v in config.items() if k not in logged]
        for chunk in _chunks(new, 100):
            self.client.log_batch(run_id, params=chunk, synchronous=True)

    def _experiment_id(self) -> str:
        client = self.client
        experiment = client.get_experiment_by_name(self.experiment)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return client.create_experiment(self.experiment)
        except self.mlflow.exceptions.MlflowException:  # created meanwhile by another run
            return client.get_experiment_by_name(self.experiment).experiment_id


def start_tracking(tracking: Tracking, run_dir: Path, resume_step: int) -> Tracker | None:
    """Rank 0's Tracker, or None when tracking is off."""
    uri = tracking_uri(tracking)
    if not uri:
        return None
    # The checkpoints an earlier attempt saved but died before sending (sent ones are skipped), listed before the
    # Tracker starts its MLflow run: after that, only queueing, which cannot fail.
    saved = [p for p in list_checkpoints(run_dir) if p.is_file()] if tracking.mlflow_checkpoints else []  # files:
    # a sharded folder of an earlier attempt is not sent (--checkpoint-format sharded refuses --mlflow-checkpoints)
    tracker = Tracker(uri, experiment_name(tracking), run_dir, resume_step)
    for path in saved:
        for file in (path, sidecar_of(path)):
            tracker.upload(file, "checkpoints")
    return tracker


def catch_up_tracking(tracking: Tracking, run_dir: Path, max_steps: int) -> Tracker | None:
    """A finished run started again: rank 0 sends what its tracking may still lack (metrics an attempt
    could not send, model.pt, manifest.json) and marks the MLflow run finished."""
    if not is_main() or not tracking_uri(tracking):
        return None
    setup_logging(run_dir)
    tracker = start_tracking(tracking, run_dir, read_status(run_dir).get("step", max_steps))
    for name in ("model.pt", "manifest.json"):
        tracker.upload(run_dir / name)
    return tracker
