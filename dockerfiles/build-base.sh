#!/usr/bin/env bash
# Build the trims base image from Debian packages alone, without pulling from any registry:
# a bookworm rootfs made by `debootstrap --variant=minbase` (python3 + python3-venv included)
# and loaded with `docker import`. Reuses the image when the tag already exists.
#
#   bash dockerfiles/build-base.sh            # builds trims-base:bookworm once
#   TRIMS_BASE_IMAGE=my-base:tag bash ...     # another tag
#   FORCE=1 bash dockerfiles/build-base.sh    # rebuild even if the tag exists
set -euo pipefail

TAG=${TRIMS_BASE_IMAGE:-trims-base:bookworm}
SUITE=${DEBIAN_SUITE:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PACKAGES=python3,python3-venv,ca-certificates,tini

if [ -z "${FORCE:-}" ] && docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "base image $TAG exists; reusing it (FORCE=1 rebuilds)"
  exit 0
fi
command -v debootstrap >/dev/null || {
  echo "debootstrap is missing: apt-get install -y debootstrap" >&2
  exit 1
}

work=$(mktemp -d /var/tmp/trims-rootfs.XXXXXX)
trap 'rm -rf "$work"' EXIT
echo "debootstrap $SUITE ($PACKAGES) into $work from $MIRROR"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$work/rootfs" "$MIRROR" \
  >"$work/debootstrap.log" 2>&1 || {
  tail -n 40 "$work/debootstrap.log" >&2
  exit 1
}
# Slim the rootfs: apt lists, caches and docs are not needed at run time.
rm -rf "$work/rootfs/var/lib/apt/lists/"* "$work/rootfs/var/cache/apt/"*.bin \
  "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/usr/share/doc/"* \
  "$work/rootfs/usr/share/man/"* "$work/rootfs/usr/share/locale/"*
tar -C "$work/rootfs" --numeric-owner -c . |
  docker import \
    --change 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    - "$TAG" >/dev/null
echo "base image $TAG built ($(docker image inspect -f '{{.Size}}' "$TAG") bytes)"
