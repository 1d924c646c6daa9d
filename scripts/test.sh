#!/usr/bin/env bash
# Install what the tests need (when missing), build, run the Rust tests and
# the integration suite that drives bulwark through real NBD clients.
#
#   ./scripts/test.sh                 everything
#   ./scripts/test.sh -k mirror       extra arguments go to pytest
#
# Environment: BULWARK_BIN (binary under test; default target/release/bulwark),
# BULWARK_TEST_SEED (replay a randomised test), TEST_TIMEOUT (seconds per test, default 300),
# BULWARK_TEST_KEEP_TMP=1 (keep the tmp_path of passed tests too; by default only failed ones stay).
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD

# shellcheck source=scripts/lib.sh
. "$ROOT/scripts/lib.sh"
install_test_packages

# --- pytest --------------------------------------------------------------------
PY=${PYTHON:-python3}
have "$PY" || PY=/usr/bin/python3
if ! "$PY" -c 'import pytest, pytest_timeout' >/dev/null 2>&1; then
    log "installing pytest and pytest-timeout for $PY"
    if "$PY" -m pip --version >/dev/null 2>&1; then
        "$PY" -m pip install -q pytest pytest-timeout 2>/dev/null \
            || "$PY" -m pip install -q --break-system-packages pytest pytest-timeout
    else
        PY=/usr/bin/python3
        $SUDO apt-get update -q
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends python3-pytest python3-pytest-timeout
    fi
fi

# the S3 servers of the object-store tests (scripts/lib.sh)
install_object_store_test_deps "$PY"
# csi-sanity and a gRPC client for the CSI driver's tests (scripts/lib.sh)
install_csi_test_deps "$PY"

# --- build and test ------------------------------------------------------------
log "cargo build --release"
cargo build --release --workspace
cargo_rc=0
# clippy is part of the test: a warning fails it like a failing test.
if ! cargo clippy --version >/dev/null 2>&1; then
    log "installing clippy"
    if have rustup; then
        rustup component add clippy
    else
        $SUDO apt-get update -q
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends rust-clippy
    fi
fi
log "cargo clippy --release --workspace --all-targets -- -D warnings"
cargo clippy --release --workspace --all-targets -- -D warnings || cargo_rc=$?
log "cargo test --release --workspace"
cargo test --release --workspace || cargo_rc=$?
[ "$cargo_rc" -eq 0 ] || log "cargo test FAILED (exit $cargo_rc); running the integration suite anyway"

export BULWARK_BIN=${BULWARK_BIN:-$ROOT/target/release/bulwark}
# A test keeps its pool files only while it runs (tests/conftest.py), but the
# largest ones still need a few GB at once: say what the disk had, for a CI log.
log "free disk for the suite: $(df -h "${TMPDIR:-/tmp}" | awk 'NR == 2 {print $4 " of " $2 " on " $6}')"
log "integration tests against $BULWARK_BIN"
pytest_rc=0
"$PY" -m pytest -q -rfEs --durations=5 --timeout="${TEST_TIMEOUT:-300}" tests/ "$@" || pytest_rc=$?

if [ "$cargo_rc" -ne 0 ] || [ "$pytest_rc" -ne 0 ]; then
    log "FAILED: cargo clippy/test exit $cargo_rc, pytest exit $pytest_rc"
    exit 1
fi
