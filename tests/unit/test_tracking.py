"""train/report/mlflow_tracking.py's pure parts: which URIs it takes, when a run counts as continuing, what a failure
is reported as. (Against a real server: tests/e2e/test_tracking.py.)"""

import pytest

from train.base.errors import ConfigError
from train.config.settings import Config
from train.report.mlflow_tracking import (RECORD, check_uri, continues_a_tracked_run, experiment_name, failure_reason,
                                          tracking_uri)


@pytest.mark.parametrize("uri", ["http://mlflow:5000", "https://mlflow.example.org", "http://10.0.0.5:5000/"])
def test_a_server_address_is_taken(uri):
    check_uri(uri)


@pytest.mark.parametrize("uri, message", [
    ("mlflow:5000", "is not an MLflow server's address"),
    ("file:///nas/mlruns", "is not an MLflow server's address"),
    ("http://", "is not an MLflow server's address"),
    ("https://me:secret@mlflow.example.org", "carries a password"),
])
def test_other_uris_are_refused_in_one_line(uri, message):
    with pytest.raises(ConfigError) as e:
        check_uri(uri)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_flag_wins_over_the_environment_and_neither_means_off(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    assert tracking_uri(Config().tracking) == "" and experiment_name(Config().tracking) == "trainbox"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://a:5000")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "resnets")
    assert tracking_uri(Config().tracking) == "http://a:5000" and experiment_name(Config().tracking) == "resnets"
    assert tracking_uri(Config().replace(mlflow_uri="http://b:5000").tracking) == "http://b:5000"
    assert experiment_name(Config().replace(mlflow_experiment="mine").tracking) == "mine"


def test_a_restart_a_requeue_or_a_tracked_run_directory_continues(tmp_path):
    assert not continues_a_tracked_run("", {})
    assert not continues_a_tracked_run(str(tmp_path), {"TORCHELASTIC_RESTART_COUNT": "0"})
    assert continues_a_tracked_run("", {"TORCHELASTIC_RESTART_COUNT": "1"})
    assert continues_a_tracked_run("", {"SLURM_RESTART_COUNT": "2"})
    (tmp_path / RECORD).write_text("{}")
    assert continues_a_tracked_run(str(tmp_path), {})


def test_a_failure_is_reported_by_its_cause():
    long = ("API request to http://h:5000/api/2.0/mlflow/runs/log-batch failed with exception HTTPConnectionPool("
            "host='h', port=5000): Max retries exceeded with url: ... [Errno 111] Connection refused'))")
    assert failure_reason(RuntimeError(long)) == "Connection refused"
    assert failure_reason(RuntimeError("x" * 300)) == "x" * 160 + "..."
