#!/usr/bin/env bash
# Checks deploy/moesnapd.service with systemd-analyze verify. The unit names the installed binary;
# the copy checked here points at the one just built, so that every other line is verified as is.
# Any message from systemd-analyze fails the check. With --expect-failure, a deliberately broken
# copy must fail it, proving the check can fail.
set -euo pipefail
unit=$1 moesnapd=$2 mode=${3:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sed "s|/usr/local/bin/moesnapd|$moesnapd|" "$unit" > "$work/moesnapd.service"
if [ "$mode" = "--expect-failure" ]; then
  sed -i 's/^Restart=always/Restrat=always/' "$work/moesnapd.service"
fi
output=$(systemd-analyze verify "$work/moesnapd.service" 2>&1) || true
if [ "$mode" = "--expect-failure" ]; then
  [ -n "$output" ] || { echo "a misspelled directive went unnoticed"; exit 1; }
  echo "broken unit rejected: $output"
  exit 0
fi
if [ -n "$output" ]; then
  echo "$output"
  exit 1
fi
echo "deploy/moesnapd.service verified"
