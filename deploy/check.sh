#!/usr/bin/env bash
# Installs the dependencies, builds moesnap and runs every test. This is the README's test command
# and exactly what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh
deploy/build.sh
ctest --test-dir build --output-on-failure -j2 --no-tests=error
