#!/usr/bin/env bash
# Run here, on the Debian build machine: packs what the GPU checks need into DEST (default
# build/gpu-bundle) — the built programs, every shared library they load (ldd) except the GPU driver's,
# the dynamic loader, and the Python package (build/python, which carries its own libraries) — and
# DEST.tar.gz of it all, so that a GPU machine with none of our Debian libraries can run them.
# Then carry DEST.tar.gz to the GPU machine with the repository, unpack it and run
# bench/gpu/run.sh DEST there from the repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=${1:-build/gpu-bundle}
programs=(moesnap-bench moesnapd moesnapctl cuda_capture_test device_regions_test)
rm -rf "$dest" "$dest.tar.gz"
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
[ -d build/python/moesnap ] || { echo "build/python/moesnap is missing: build first" >&2; exit 1; }
mkdir -p "$dest/python"
cp -r build/python/moesnap "$dest/python/"
find "$dest/python" -name __pycache__ -prune -exec rm -rf {} +
tar -czf "$dest.tar.gz" -C "$(dirname "$dest")" "$(basename "$dest")"
du -sh "$dest" "$dest.tar.gz"
