#!/usr/bin/env bash
# Install everything (idempotently) and start the server; with no arguments it serves the built-in demo
# model on 127.0.0.1:8000. Arguments go to `ktserve serve` (a config file, --engine, --port, ...).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/install.sh"
exec "${KTSERVE_VENV:-$root/.venv}/bin/ktserve" serve "$@"
