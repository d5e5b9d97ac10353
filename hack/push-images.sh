#!/usr/bin/env bash
# Build the runtime images without Docker (hack/build-image.sh) and push them to your registry with skopeo.
#   hack/push-images.sh REGISTRY/PATH            # both flavours: REGISTRY/PATH/zerolayer:<version>-cpu and -gpu
#   hack/push-images.sh REGISTRY/PATH gpu        # one flavour
# Then: helm install ... --set operator.image.repository=REGISTRY/PATH/zerolayer \
#                        --set runtime.image.repository=REGISTRY/PATH/zerolayer   (the chart defaults to -gpu)
# Credentials and TLS are skopeo's: log in first (skopeo login REGISTRY) or pass flags in SKOPEO_FLAGS,
# e.g. SKOPEO_FLAGS="--dest-creds user:token". DEST_TRANSPORT (default docker://) is skopeo's destination
# transport: oci: writes an OCI layout directory at REGISTRY/PATH/zerolayer instead (what the test uses).
# Needs what hack/build-image.sh needs (root, mmdebstrap) and skopeo (apt-get install -y skopeo); docs/image.md.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:?usage: hack/push-images.sh REGISTRY/PATH [cpu|gpu ...]}
shift
flavours=("$@")
[ ${#flavours[@]} -gt 0 ] || flavours=(cpu gpu)
command -v skopeo >/dev/null || { echo "error: skopeo is not on PATH (apt-get install -y skopeo)" >&2; exit 1; }
for flavour in "${flavours[@]}"; do
  read -r tag archive < <(hack/build-image.sh --flavour "$flavour" | tail -n 1)
  target="${DEST_TRANSPORT:-docker://}${dest%/}/${tag#*/}"
  echo "push ${tag} -> ${target}" >&2
  # shellcheck disable=SC2086  # SKOPEO_FLAGS is a list of flags
  skopeo copy ${SKOPEO_FLAGS:-} "docker-archive:${archive}" "${target}"
done
