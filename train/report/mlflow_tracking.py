"""MLflow tracking, opt-in: MLFLOW_TRACKING_URI (or --mlflow-uri) turns it on. Where a run is tracked:

  tracking_uri, experiment_name   the server and the experiment a run tracks to ('' : tracking is off)
  check_uri, probe_server         a bad URI or refused credentials stop a new run before it starts (train/run/preflight.py)
  RECORD                          RUN_DIR/mlflow.json: which MLflow run tracks the run directory
  log_evaluation                  `python -m train.evaluate`'s scores and files, to the run's MLflow run
  import_mlflow                   the one place mlflow is imported: only runs that track pay for it (about 1 s)

What a training run sends, and how, is rank 0's Tracker (train/report/tracker.py).
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from urllib.parse import urlsplit

from train.base.errors import ConfigError
from train.config.settings import Tracking
from train.files.rundir import read_json

log = logging.getLogger("train")

RECORD = "mlflow.json"  # in the run directory: which MLflow run tracks it
KEY_TAG = "trainbox_run_key"  # the MLflow run's tag that RECORD's key matches


def tracking_uri(tracking: Tracking) -> str:
    """The tracking server, or '' when tracking is off."""
    return tracking.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI", "")


def experiment_name(tracking: Tracking) -> str:
    return tracking.mlflow_experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME", "") or "trainbox"


def check_uri(uri: str) -> None:
    """A URI trainbox can track to: an MLflow server over http(s), credentials not inside it."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"MLflow tracking URI {uri!r} is not an MLflow server's address: use "
                          f"http(s)://HOST:PORT (`make mlflow` starts one), or unset MLFLOW_TRACKING_URI to train "
                          f"without tracking")
    if parts.password:
        raise ConfigError("the MLflow tracking URI carries a password (it would be saved in config.json): "
                          "pass it in MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD instead")


def continues_a_tracked_run(run_dir: str, env=os.environ) -> bool:
    """A restart, a requeue or a resume of a run already tracked: a server that is down then must not
    stop the training (it is told when it is back), unlike for a new run."""
    restarted = any(env.get(k, "0").strip() not in ("", "0") for k in ("TORCHELASTIC_RESTART_COUNT",
                                                                       "SLURM_RESTART_COUNT"))
    return restarted or bool(run_dir) and (Path(run_dir) / RECORD).is_file()


def probe_server(uri: str) -> None:
    """Fail in one line, before anything starts, when the server does not answer or refuses us."""
    mlflow = import_mlflow()
    try:
        mlflow.MlflowClient(uri).search_experiments(max_results=1)
    except Exception as e:  # noqa: BLE001 - requests' and MLflow's errors alike: the reason is all we need
        if "Invalid Host header" in str(e):
            what, fix = "refuses this address as its name", "add it to the server's MLFLOW_SERVER_ALLOWED_HOSTS"
        elif (getattr(e, "error_code", None) in ("UNAUTHENTICATED", "PERMISSION_DENIED", "CUSTOMER_UNAUTHORIZED")
              or re.search(r"error code 40[13]\b", str(e))):
            what, fix = "refused the credentials", "check MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD"
        else:
            what, fix = "does not answer", "start it (make mlflow) or fix MLFLOW_TRACKING_URI"
        raise ConfigError(f"the MLflow server at {uri} {what} ({failure_reason(e)}): {fix}, or unset "
                          f"MLFLOW_TRACKING_URI to train without tracking") from None


def import_mlflow():
    """The MLflow client library, imported on first use (in the main thread: see Tracker)."""
    # One try per request, and never minutes on one: the Tracker's thread keeps what failed and tries again.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    # The client's own usage telemetry (on by default since MLflow 3) stays off unless the user turns it on.
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import mlflow.entities  # noqa: PLC0415 - see the module docstring (binds the package, `mlflow`)

    return mlflow


# What the usual failures come down to, found in the client's long chain of messages.
_CAUSES = ("Connection refused", "Name or service not known", "Temporary failure in name resolution",
           "No route to host", "timed out", "Connection reset", "Remote end closed connection")


def failure_reason(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    cause = next((c for c in _CAUSES if c.lower() in text.lower()), None)
    return cause or text[:160] + ("..." if len(text) > 160 else "")


def log_evaluation(run_dir: Path, name: str, scores: dict, files: list[Path]) -> str:
    """`python -m train.evaluate` of a tracked run (RUN_DIR/mlflow.json names its MLflow run): the scores as
    metrics NAME/<score>, the files as artifacts in NAME/, on the server MLFLOW_TRACKING_URI names, else the one the
    run was tracked at. A server that does not take them is one warning: the files are there all the same. Returns
    the MLflow run's id, or '' when nothing was sent."""
    record = read_json(run_dir / RECORD)
    uri = os.environ.get("MLFLOW_TRACKING_URI") or record.get("tracking_uri", "")
    if not record.get("run_id") or not uri:
        return ""
    mlflow = import_mlflow()
    try:
        client = mlflow.MlflowClient(uri)
        now = int(time.time() * 1000)
        client.log_batch(record["run_id"], metrics=[mlflow.entities.Metric(f"{name}/{key}", float(value), now, 0)
                                                    for key, value in scores.items()], synchronous=True)
        for file in files:
            client.log_artifact(record["run_id"], str(file), name)
    except Exception as e:  # noqa: BLE001 - the server's and the network's errors alike: the files are here
        log.warning("mlflow: run %s at %s did not take the evaluation (%s): %s have it", record["run_id"], uri,
                    failure_reason(e), ", ".join(str(f) for f in files))
        return ""
    return record["run_id"]
