#!/usr/bin/env bash
# Install everything (idempotently, with the test tools) and run the test suite.
# Arguments go to pytest (e.g. `scripts/test.sh -k chat`, `scripts/test.sh -m gpu`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/install.sh" test
cd "$root"
exec "${KTSERVE_VENV:-$root/.venv}/bin/python" -m pytest "$@"
