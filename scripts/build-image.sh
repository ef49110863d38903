#!/usr/bin/env bash
# Builds the CPU runtime image (docker/Dockerfile.cpu) with podman, from what this checkout built:
#   scripts/build-image.sh [TAG]          (default localhost/recsys-triton-cpu:<workspace version>)
# 1. a Debian 12 base image, made once by mmdebstrap (minbase: no image registry is needed) and
#    kept as localhost/recsys-debian-base:bookworm; BASE=IMAGE uses another (debian:bookworm-slim);
# 2. the release backend and CLI (scripts/build-release.sh, unless already built);
# 3. the build context staged in build/image-context: the tritonserver of the .venv's
#    nvidia-pytriton wheel with its bundled libraries, the backend, the CLI and the library that
#    reads secret arguments from files (secret-args/);
# 4. podman build (with --runtime runc, as podman runs on these machines).
# Prints the tag. Needs podman, runc and (for the base) mmdebstrap: Debian's packages.
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)
tag=${1:-localhost/recsys-triton-cpu:$version}
base=${BASE:-localhost/recsys-debian-base:bookworm}
for tool in podman runc; do
  command -v "$tool" >/dev/null || { echo "error: $tool is needed: sudo apt-get install podman runc mmdebstrap" >&2; exit 1; }
done
podman=(podman --runtime runc)

if [[ $base == localhost/recsys-debian-base:bookworm ]] && ! "${podman[@]}" image exists "$base"; then
  command -v mmdebstrap >/dev/null || { echo "error: mmdebstrap is needed for the base image: sudo apt-get install mmdebstrap" >&2; exit 1; }
  echo "==> $base: Debian 12 minbase by mmdebstrap (once)" >&2
  tarball=$(mktemp --suffix=.tar)
  trap 'rm -f "$tarball"' EXIT
  mmdebstrap --quiet --variant=minbase --include=ca-certificates bookworm "$tarball" >&2
  "${podman[@]}" import --quiet "$tarball" "$base" >/dev/null
fi

if [[ ! -f target/release/libtriton_recsys.so || ! -x target/release/recsys || ! -f target/release/librecsys_secret_args.so ]]; then
  echo "==> release build" >&2
  ./scripts/build-release.sh >&2
fi
site=$(.venv/bin/python -c 'import pytriton, os; print(os.path.dirname(os.path.dirname(pytriton.__file__)))')
context=build/image-context
rm -rf "$context"
mkdir -p "$context/tritonserver/pytriton" "$context/recsys"
cp -a "$site/pytriton/tritonserver" "$context/tritonserver/pytriton/"
cp -a "$site/nvidia_pytriton.libs" "$context/tritonserver/"
cp target/release/libtriton_recsys.so target/release/recsys target/release/librecsys_secret_args.so "$context/recsys/"
cp docker/Dockerfile.cpu "$context/Dockerfile"
echo "==> podman build $tag" >&2
"${podman[@]}" build --quiet --format docker --build-arg "BASE=$base" --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 \
  -t "$tag" "$context" >&2
echo "$tag"
