#!/usr/bin/env bash
# Build the trims base image from Debian packages alone, without pulling from any registry:
# a bookworm rootfs made by `debootstrap --variant=minbase` (python3 + python3-venv included)
# and loaded with `docker import`. Reuses the image when the tag exists with the same package
# list (label org.trims.base-packages).
#
#   bash dockerfiles/build-base.sh            # builds trims-base:bookworm once
#   TRIMS_BASE_IMAGE=my-base:tag bash ...     # another tag
#   FORCE=1 bash dockerfiles/build-base.sh    # rebuild even if the tag exists
#   DEBIAN_MIRROR=URL bash dockerfiles/build-base.sh   # another mirror than the host's apt source
set -euo pipefail

TAG=${TRIMS_BASE_IMAGE:-trims-base:bookworm}
SUITE=${DEBIAN_SUITE:-bookworm}
# The Debian mirror: DEBIAN_MIRROR, else the host's own apt source for the main archive (its
# deb822 .sources files or sources.list), so nothing here names a package host.
host_mirror() {
  local deb822 legacy
  deb822=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  legacy=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true)
  {
    awk '/^URIs:/ { uri = $2 } /^Suites:/ { suites = $0 }
      /^$/ { if (uri != "" && suites !~ /-security/) print uri; uri = ""; suites = "" }
      END { if (uri != "" && suites !~ /-security/) print uri }' <<<"$deb822"
    awk '$1 == "deb" && $0 !~ /-security/ {
      for (i = 2; i <= NF; i++) if ($i ~ /:\/\//) { print $i; break } }' <<<"$legacy"
  } | sed -n 1p
}
MIRROR=${DEBIAN_MIRROR:-$(host_mirror)}
# libgomp1, libquadmath0: the OpenMP and quad-precision runtimes the mxnet wheel's libraries
# link against (torch and scikit-learn bundle their own OpenMP).
PACKAGES=python3,python3-venv,ca-certificates,tini,libgomp1,libquadmath0

have=$(docker image inspect -f '{{index .Config.Labels "org.trims.base-packages"}}' "$TAG" \
  2>/dev/null || true)
if [ -z "${FORCE:-}" ] && [ "$have" = "$PACKAGES" ]; then
  echo "base image $TAG exists; reusing it (FORCE=1 rebuilds)"
  exit 0
fi
[ -n "$MIRROR" ] || {
  echo "no Debian mirror: the host has no apt source to read one from; set DEBIAN_MIRROR" >&2
  exit 1
}
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
    --change "LABEL org.trims.base-packages=$PACKAGES" \
    - "$TAG" >/dev/null
echo "base image $TAG built ($(docker image inspect -f '{{.Size}}' "$TAG") bytes)"
