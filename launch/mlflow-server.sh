#!/usr/bin/env bash
# A team's MLflow server (docs/mlflow-server.md): one `mlflow server` that every node reaches, its runs and
# registry in a database (PostgreSQL for a team; SQLite for one person), artifacts streamed by the server to a
# destination (s3://... or a directory), so clients need no storage credentials; users and permissions (MLflow's
# basic-auth app) in their own database when MLFLOW_AUTH_DATABASE_URI is set. The tests start every MLflow
# server through this file (tests/helpers.py, MlflowServer), the PostgreSQL + S3 + auth one included.
#
#   MLFLOW_BACKEND_STORE_URI      required: postgresql://USER:PASSWORD@HOST:5432/mlflow (or sqlite:////PATH.db)
#   MLFLOW_ARTIFACTS_DESTINATION  required: s3://BUCKET/PREFIX (or a directory)
#   MLFLOW_HOST, MLFLOW_PORT      where it listens (127.0.0.1, 5000): behind a TLS proxy, keep 127.0.0.1
#   MLFLOW_WORKERS                uvicorn worker processes (4); each holds its own database connections
#   MLFLOW_ALLOWED_HOSTS          the Host headers it answers, e.g. 'mlflow.internal,10.*' (default: local ones)
#   MLFLOW_AUTH_DATABASE_URI      set: the basic-auth app, its users in this database (postgresql://.../mlflow_auth)
#   MLFLOW_ADMIN_PASSWORD         required with auth: the password of user admin, made at the first start
#   MLFLOW_AUTH_DEFAULT_PERMISSION  with auth: what a user may do on others' models (READ)
#   MLFLOW_SERVER_DIR             with auth: where basic_auth.ini is written, mode 600 (the current directory)
#   MLFLOW_FLASK_SERVER_SECRET_KEY  with auth: the CSRF key, the same for every worker (generated when unset)
#   S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, and MLFLOW_S3_ENDPOINT_URL for MinIO or another S3-compatible store
set -euo pipefail

die() { echo "error: mlflow-server.sh: $*" >&2; exit 2; }
: "${MLFLOW_BACKEND_STORE_URI:?set MLFLOW_BACKEND_STORE_URI (postgresql://USER:PASSWORD@HOST:5432/mlflow)}"
: "${MLFLOW_ARTIFACTS_DESTINATION:?set MLFLOW_ARTIFACTS_DESTINATION (s3://BUCKET/PREFIX)}"
PYTHON=${PYTHON:-python3}  # the environment with mlflow (and psycopg2, boto3 for these stores)

needs() {  # a URI's driver, checked here so that a missing one is one line, not a traceback per worker
    "$PYTHON" -c "import $2" 2>/dev/null || die "$1 needs the Python package $2: pip install $3"
}
case "$MLFLOW_BACKEND_STORE_URI${MLFLOW_AUTH_DATABASE_URI:-}" in *postgresql*) needs postgresql psycopg2 psycopg2-binary ;; esac
case "$MLFLOW_ARTIFACTS_DESTINATION" in s3://*) needs "$MLFLOW_ARTIFACTS_DESTINATION" boto3 boto3 ;; esac

args=(server --backend-store-uri "$MLFLOW_BACKEND_STORE_URI" --artifacts-destination "$MLFLOW_ARTIFACTS_DESTINATION"
      --host "${MLFLOW_HOST:-127.0.0.1}" --port "${MLFLOW_PORT:-5000}" --workers "${MLFLOW_WORKERS:-4}")
if [ -n "${MLFLOW_ALLOWED_HOSTS:-}" ]; then
    args+=(--allowed-hosts "$MLFLOW_ALLOWED_HOSTS")
fi
if [ -n "${MLFLOW_AUTH_DATABASE_URI:-}" ]; then
    : "${MLFLOW_ADMIN_PASSWORD:?set MLFLOW_ADMIN_PASSWORD (the basic-auth admin password, made at the first start)}"
    ini="${MLFLOW_SERVER_DIR:-.}/basic_auth.ini"
    (umask 077 && cat > "$ini.tmp" <<INI
[mlflow]
default_permission = ${MLFLOW_AUTH_DEFAULT_PERMISSION:-READ}
database_uri = $MLFLOW_AUTH_DATABASE_URI
admin_username = admin
admin_password = $MLFLOW_ADMIN_PASSWORD
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
INI
    ) && mv "$ini.tmp" "$ini"
    export MLFLOW_AUTH_CONFIG_PATH="$ini"
    # Every worker must check CSRF tokens with the same key: one made here, before they fork.
    MLFLOW_FLASK_SERVER_SECRET_KEY=${MLFLOW_FLASK_SERVER_SECRET_KEY:-$("$PYTHON" -c 'import secrets; print(secrets.token_hex(32))')}
    export MLFLOW_FLASK_SERVER_SECRET_KEY
    args+=(--app-name basic-auth)
fi
exec "$PYTHON" -m mlflow "${args[@]}"
