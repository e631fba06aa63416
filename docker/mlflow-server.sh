#!/bin/sh
# The MLflow tracking server of trainbox's runs, its store on the NAS beside them: `make mlflow` (local)
# and the compose service `mlflow` (the image docker/mlflow.Dockerfile) both start it here.
#   docker/mlflow-server.sh RUNS_DIR
# Knobs: MLFLOW_PORT (5000); MLFLOW_BACKEND_STORE_URI (default: SQLite in RUNS_DIR/mlflow; a team server
# on many nodes wants PostgreSQL or MySQL, e.g. postgresql://user@db/mlflow); MLFLOW_SERVER_ALLOWED_HOSTS
# (the Host headers it answers, MLflow's guard against DNS rebinding: by default MLflow's own list,
# localhost and private addresses, plus the compose service's name and this machine's; add the name a
# team reaches it by). Artifacts (model.pt, checkpoints) go to RUNS_DIR/mlflow/artifacts; clients
# upload them through the server.
set -eu
runs=$(cd "${1:?usage: docker/mlflow-server.sh RUNS_DIR}" && pwd)
mkdir -p "$runs/mlflow/artifacts"
host=$(hostname)
private="10.*,192.168.*,172.1[6-9].*,172.2[0-9].*,172.3[01].*,fc00:*,fd00:*"
export MLFLOW_SERVER_ALLOWED_HOSTS="${MLFLOW_SERVER_ALLOWED_HOSTS:-localhost,localhost:*,127.0.0.1,127.0.0.1:*,mlflow,mlflow:*,$host,$host:*,$private}"
exec mlflow server --host 0.0.0.0 --port "${MLFLOW_PORT:-5000}" --workers 1 \
  --backend-store-uri "${MLFLOW_BACKEND_STORE_URI:-sqlite:///$runs/mlflow/mlflow.db}" \
  --artifacts-destination "$runs/mlflow/artifacts"
