#!/usr/bin/env bash
# The main job: installs the dependencies, builds moesnap, and runs the demonstration with a report.
# Today it is the erasure demonstration (encode state into (k, m) stripes, lose m units of every
# stripe, rebuild, verify every byte); extra arguments go to moesnap-erasure-demo.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh
deploy/build.sh
build/bin/moesnap-erasure-demo "$@"
