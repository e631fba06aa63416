#!/bin/sh
# The MLflow tracking server of trainbox's runs, its store on the NAS beside them: `make mlflow` (local)
# and the compose service `mlflow` (the image docker/mlflow.Dockerfile) both start it here.
#   docker/mlflow-server.sh RUNS_DIR
# Knobs: MLFLOW_PORT (5000); MLFLOW_BACKEND_STORE_URI (default: SQLite in RUNS_DIR/mlflow; a team server
# on many nodes wants PostgreSQL or MySQL, e.g. postgresql://user@db/mlflow). Artifacts (model.pt,
# checkpoints) go to RUNS_DIR/mlflow/artifacts; clients upload them through the server.
set -eu
runs=$(cd "${1:?usage: docker/mlflow-server.sh RUNS_DIR}" && pwd)
mkdir -p "$runs/mlflow/artifacts"
exec mlflow server --host 0.0.0.0 --port "${MLFLOW_PORT:-5000}" --workers 1 \
  --backend-store-uri "${MLFLOW_BACKEND_STORE_URI:-sqlite:///$runs/mlflow/mlflow.db}" \
  --artifacts-destination "$runs/mlflow/artifacts"
