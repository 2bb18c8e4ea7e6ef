#!/usr/bin/env bash
# Run here, on the Debian build machine: packs what the GPU measurements need into DEST (default
# build/gpu-bundle) — the built programs, every shared library they load (ldd) except the GPU driver's,
# and the dynamic loader — so that a GPU machine with none of our Debian libraries can run them.
# Then carry DEST to the GPU machine and run bench/gpu/run.sh DEST there.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=${1:-build/gpu-bundle}
programs=(moesnap-bench moesnapd cuda_capture_test)
rm -rf "$dest"
mkdir -p "$dest/bin" "$dest/lib"
for program in "${programs[@]}"; do
  [ -x "build/bin/$program" ] || { echo "build/bin/$program is missing: build with CUDA first" >&2; exit 1; }
  strip --strip-debug -o "$dest/bin/$program" "build/bin/$program"
  # The driver (libcuda, libnvidia-*) must come from the GPU machine; everything else travels.
  ldd "build/bin/$program" | awk '/=> \// { print $3 }' | grep -vE 'libcuda\.so|libnvidia' |
    while read -r library; do
      [ -e "$dest/lib/$(basename "$library")" ] || strip --strip-debug -o "$dest/lib/$(basename "$library")" "$library"
    done
done
cp -L /lib64/ld-linux-x86-64.so.2 "$dest/lib/"
cp bench/gpu/run.sh "$dest/"
du -sh "$dest"
