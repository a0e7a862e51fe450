#!/usr/bin/env bash
# Build the trims runtime image without pulling from any registry:
#   1. `pip wheel` the project and its dependency wheels on the host (into a reusable folder),
#   2. `docker build --network none --build-arg BASE_IMAGE=...` from a context holding them.
# The image is labelled with a digest of the sources; when an image with the same tag and the
# same digest exists, nothing is rebuilt.
#
#   bash dockerfiles/build-image.sh                    # trims-runtime:latest on trims-base:bookworm
#   TRIMS_IMAGE=trims-runtime:bare TRIMS_EXTRAS= bash dockerfiles/build-image.sh
#
# Environment: TRIMS_IMAGE (tag), TRIMS_BASE_IMAGE (base tag; built by build-base.sh when
# missing), TRIMS_EXTRAS (comma-separated extras, e.g. "onnx,kubernetes"; default "onnx", so
# the image serves ONNX models and the evaluation's gateway functions; set but empty: none),
# TRIMS_WHEEL_DIR (wheel cache, default /var/tmp/trims-wheels), PYTHON (host interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${TRIMS_IMAGE:-trims-runtime:latest}
BASE=${TRIMS_BASE_IMAGE:-trims-base:bookworm}
# ONNX Runtime and onnx by default (about +150 MB, +20 s once; torch is not in: about 1 GB):
# evaluations deployed with --executor docker run the ONNX handler in this image.
EXTRAS=${TRIMS_EXTRAS-onnx}
WHEELS=${TRIMS_WHEEL_DIR:-/var/tmp/trims-wheels}
PY=${PYTHON:-python3}

# What goes into the image: the package folders, the build files and this Dockerfile.
digest=$(
  {
    find trims daemon runtime operators kernels evaluation -type f -name '*.py' -print0 2>/dev/null |
      sort -z | xargs -0 sha256sum
    sha256sum pyproject.toml setup.py dockerfiles/runtime.Dockerfile
    echo "base=$(docker image inspect -f '{{.Id}}' "$BASE" 2>/dev/null || true) extras=$EXTRAS"
  } | sha256sum | cut -c1-16
)
have=$(docker image inspect -f '{{index .Config.Labels "org.trims.source-digest"}}' "$IMAGE" \
  2>/dev/null || true)
if [ "$have" = "$digest" ]; then
  echo "image $IMAGE is up to date (sources $digest)"
  exit 0
fi

docker image inspect "$BASE" >/dev/null 2>&1 || TRIMS_BASE_IMAGE="$BASE" bash dockerfiles/build-base.sh

ctx=$(mktemp -d /var/tmp/trims-image.XXXXXX)
trap 'rm -rf "$ctx"' EXIT
mkdir -p "$WHEELS" "$ctx/wheels"
# Build from a copy of the sources so the working tree gets no build/ or egg-info droppings.
mkdir -p "$ctx/src"
tar -c --exclude=__pycache__ --exclude='*.egg-info' pyproject.toml setup.py README.md \
  $(ls -d trims daemon runtime operators kernels evaluation 2>/dev/null) | tar -x -C "$ctx/src"
spec="$ctx/src"
[ -n "$EXTRAS" ] && spec="$ctx/src[$EXTRAS]"
echo "building wheels for trims${EXTRAS:+[$EXTRAS]} and its dependencies (cache $WHEELS)"
# pip wheel puts every wheel this build resolves into the context, taking those already in the
# cache from there; the cache then keeps them for the next build.
# The build backend too, so later builds can run from the cache alone.
if ! ls "$WHEELS"/setuptools-*.whl "$WHEELS"/wheel-*.whl >/dev/null 2>&1; then
  "$PY" -m pip download -q --only-binary=:all: -d "$WHEELS" "setuptools>=68" wheel \
    >"$ctx/pip.log" 2>&1 || echo "could not cache setuptools/wheel; using the index" >&2
fi
# The cache alone first (offline, fast); the package index only for what it lacks.
"$PY" -m pip wheel -q --no-index --find-links "$WHEELS" -w "$ctx/wheels" "$spec" \
  >"$ctx/pip.log" 2>&1 ||
  "$PY" -m pip wheel -q --find-links "$WHEELS" -w "$ctx/wheels" "$spec" \
    >>"$ctx/pip.log" 2>&1 || {
  tail -n 30 "$ctx/pip.log" >&2
  exit 1
}
find "$ctx/wheels" -name '*.whl' ! -name 'trims-*' -exec cp -n {} "$WHEELS/" \;
rm -rf "$ctx/src"
mkdir "$ctx/project"
mv "$ctx/wheels"/trims-*.whl "$ctx/project/"
mv "$ctx/wheels" "$ctx/deps"
cp dockerfiles/runtime.Dockerfile "$ctx/Dockerfile"
echo "docker build $IMAGE on $BASE (--network none, $(ls "$ctx/deps" | wc -l) dependency wheels)"
docker build -q --network none --build-arg BASE_IMAGE="$BASE" \
  --build-arg SOURCE_DIGEST="$digest" -t "$IMAGE" "$ctx" >/dev/null
# Earlier builds of this tag are now dangling: drop them.
docker image prune -f --filter "label=org.trims.image=runtime" >/dev/null
echo "image $IMAGE built (sources $digest)"
