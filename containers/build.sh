#!/usr/bin/env bash
# Build the serving image: bash containers/build.sh OUT.sif   (run from anywhere; needs apptainer)
# OUT.sif on the shared file system every node sees: configs/example.yaml names /shared/images/vllm-0.32.sif
# Unprivileged users need --fakeroot (set APPTAINER_BUILD_FLAGS=--fakeroot) or a remote builder.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
[ $# -ge 1 ] || { echo "usage: bash containers/build.sh OUT.sif (e.g. /shared/images/vllm-0.32.sif)" >&2; exit 2; }
case "$1" in /*) out="$1" ;; *) out="$PWD/$1" ;; esac   # (before the cd below: where it was asked for)
command -v apptainer >/dev/null || { echo "apptainer is not installed" >&2; exit 1; }
cd "$root"   # %files paths are relative to the repository root
# shellcheck disable=SC2086  # flags are meant to split
apptainer build ${APPTAINER_BUILD_FLAGS:-} "$out" containers/vllm.def
apptainer test "$out" || echo "note: '%test' needs a GPU node for the NVML part" >&2
echo "built $out: set container.image to it in the fleet YAML"
