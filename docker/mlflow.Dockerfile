# The MLflow tracking server image (compose service `mlflow`; `make mlflow` builds it when missing):
# mlflow from docker/mlflow.lock (hash-checked), the same version as the trainer's client. It runs as
# the services' user (compose `user:`: the host user, never root), its store on the runs volume of the
# NAS (docker/mlflow_server.py); the image's own default user is not root either.
ARG BASE_IMAGE=python:3.12-slim
FROM ${BASE_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/mlflow \
    PATH=/opt/mlflow/bin:$PATH \
    HOME=/tmp

RUN --mount=type=cache,target=/var/cache/apt,sharing=locked \
    --mount=type=cache,target=/var/lib/apt/lists,sharing=locked \
    if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then \
        rm -f /etc/apt/apt.conf.d/docker-clean && apt-get update && \
        apt-get install -y --no-install-recommends python3 python3-venv ca-certificates; \
    fi

# As in docker/Dockerfile: an extra CA bundle (BuildKit secret extra_ca) for TLS-intercepting proxies.
COPY docker/mlflow.lock /tmp/mlflow.lock
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=extra_ca \
    set -e; python3 -m venv "$VIRTUAL_ENV"; cert=""; \
    if [ -s /run/secrets/extra_ca ]; then \
        cat /etc/ssl/certs/ca-certificates.crt /run/secrets/extra_ca > /tmp/ca.pem 2>/dev/null || \
            cp /run/secrets/extra_ca /tmp/ca.pem; \
        cert="--cert /tmp/ca.pem"; \
    fi; \
    pip install $cert --require-hashes --no-deps -r /tmp/mlflow.lock; \
    rm -f /tmp/ca.pem /tmp/mlflow.lock

COPY docker/mlflow_server.py /usr/local/lib/trainbox/mlflow_server.py
LABEL org.opencontainers.image.title="trainbox-mlflow"
ENV TRAINBOX_MLFLOW_IN_CONTAINER=1
EXPOSE 5000
USER 1000:1000
ENTRYPOINT ["python", "/usr/local/lib/trainbox/mlflow_server.py", "/opt/trainbox/runs"]
