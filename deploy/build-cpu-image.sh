#!/usr/bin/env bash
# Build the CPU image with podman (no Docker daemon), then prove it serves: start `ktserve serve` from the
# image's root filesystem and ask it one chat question. Run as root on a Debian/Ubuntu host:
#
#   apt-get install podman debootstrap
#   deploy/build-cpu-image.sh                                  base made here with debootstrap
#   BASE_IMAGE=python:3.11-slim-bookworm deploy/build-cpu-image.sh   base pulled from a registry
#   deploy/build-cpu-image.sh --no-cache                       arguments go on to `podman build`
#
# Without BASE_IMAGE the base is Debian bookworm with python3 made by debootstrap and `podman import`ed as
# localhost/ktserve-base:bookworm (kept for the next run), for hosts that reach Debian's archive but no
# image registry. The host's pip settings (`pip config list`: a local index, find-links, a CA bundle) go
# into the build as the `pip.conf` secret, and the files and folders they name are mounted read-only at
# the same paths, so the image installs from exactly where this host does; none of it lands in a layer.
#
# Environment: IMAGE (default localhost/ktserve:cpu), WORK (default /var/tmp/ktserve-image), DEBIAN_MIRROR,
# SMOKE_PORT (default 18990), SMOKE_ARGS (added to `ktserve serve` for the smoke test, e.g. `--kt-method BF16`
# on a CPU without AMX, whose kt-kernel build lacks the default INT8 experts). The last line printed is a JSON summary with the build time and image size.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
image="${IMAGE:-localhost/ktserve:cpu}"
work="${WORK:-/var/tmp/ktserve-image}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
port="${SMOKE_PORT:-18990}"
# vfs and cgroupfs: no overlay filesystem and no systemd needed, so this also runs inside a container.
podman=(podman --storage-driver=vfs --cgroup-manager=cgroupfs)
mkdir -p "$work"

base="${BASE_IMAGE:-localhost/ktserve-base:bookworm}"
if [ -z "${BASE_IMAGE:-}" ] && ! "${podman[@]}" image exists "$base"; then
  echo "== making the base image $base with debootstrap"
  rm -rf "$work/rootfs"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,passwd \
    bookworm "$work/rootfs" "$mirror" > "$work/debootstrap.log"
  tar -C "$work/rootfs" -c . | "${podman[@]}" import --change 'CMD ["/bin/bash"]' - "$base"
  rm -rf "$work/rootfs"
fi

echo "== the host's pip settings, as a build secret"
pip_conf="$work/pip.conf"
mounts=()
python3 - "$pip_conf" <<'EOF' > "$work/pip-paths"
# `pip config list` prints `scope.key='value'`; keep the last value of each key (env beats files) in one
# [global] section, and print every local path a value names so it can be mounted into the build.
import re, subprocess, sys
listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         check=True).stdout
settings = {}
for line in listing.splitlines():
    m = re.fullmatch(r"[^.]*\.([\w-]+)='(.*)'", line.strip())
    if m:
        settings[m.group(1)] = m.group(2)
with open(sys.argv[1], "w") as f:
    f.write("[global]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
for value in settings.values():
    for word in value.split():
        path = word.removeprefix("file://").rstrip("/")
        if path.startswith("/"):
            # A local index's pages link to its files beside them: mount the index's whole folder.
            print(path.removesuffix("/simple") if word.startswith("file://") else path)
EOF
while read -r path; do
  [ -e "$path" ] && mounts+=(--volume "$path:$path:ro")
done < "$work/pip-paths"
extra_index="$(sed -n 's/^extra-index-url = //p' "$pip_conf")"

echo "== building $image from $base"
start=$(date +%s)
# The torch index: CPU_TORCH_INDEX's default is PyTorch's own, which only reaches the internet; here the
# host's extra index (or none, when torch comes from its find-links) takes its place.
"${podman[@]}" build --isolation=chroot --build-arg VARIANT=cpu --build-arg BASE_IMAGE="$base" \
  --build-arg CPU_TORCH_INDEX="$extra_index" --secret id=pip.conf,src="$pip_conf" "${mounts[@]}" \
  --tag "$image" "$@" "$root"
build_seconds=$(( $(date +%s) - start ))
size_bytes=$("${podman[@]}" image inspect --format '{{.Size}}' "$image")
echo "== built in ${build_seconds}s; image size $(( size_bytes / 1024 / 1024 )) MiB"

echo "== serving from the image's root filesystem (chroot; podman run needs what this host refuses)"
container=$("${podman[@]}" create "$image")
rootfs=$("${podman[@]}" mount "$container")
cleanup() {
  [ -n "${server_pid:-}" ] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
  for m in dev/pts dev proc sys; do umount "$rootfs/$m" 2>/dev/null || true; done
  "${podman[@]}" umount "$container" > /dev/null || true
  "${podman[@]}" rm "$container" > /dev/null || true
}
trap cleanup EXIT
mount -t proc proc "$rootfs/proc"
mount --rbind /sys "$rootfs/sys"
mount --rbind /dev "$rootfs/dev"
# The image's own environment, working directory and user, as `podman run` would set them.
mapfile -t env < <("${podman[@]}" image inspect --format '{{range .Config.Env}}{{println .}}{{end}}' "$image" | sed '/^$/d')
workdir=$("${podman[@]}" image inspect --format '{{.Config.WorkingDir}}' "$image")
user=$("${podman[@]}" image inspect --format '{{.Config.User}}' "$image")
env -i "${env[@]}" API_HOST=127.0.0.1 API_PORT="$port" \
  chroot --userspec="$user" "$rootfs" /bin/sh -c "cd '$workdir' && exec ktserve serve ${SMOKE_ARGS:-}" > "$work/serve.log" 2>&1 &
server_pid=$!
start=$(date +%s)
until curl -fs "http://127.0.0.1:$port/health" > /dev/null; do
  if ! kill -0 "$server_pid" 2>/dev/null || [ $(( $(date +%s) - start )) -gt 300 ]; then
    echo "the server did not become healthy; its log:" >&2; tail -30 "$work/serve.log" >&2; exit 1
  fi
  sleep 1
done
ready_seconds=$(( $(date +%s) - start ))
answer=$(curl -fsS "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"messages": [{"role": "user", "content": "Hello from the image"}], "max_tokens": 8}')
echo "$answer"
python3 -c 'import json, sys; r = json.loads(sys.argv[1]); assert r["choices"][0]["message"]["content"], r' "$answer"
printf '{"image": "%s", "base": "%s", "build_seconds": %d, "image_bytes": %d, "serve_ready_seconds": %d, "chat": "ok"}\n' \
  "$image" "$base" "$build_seconds" "$size_bytes" "$ready_seconds"
