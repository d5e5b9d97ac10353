#!/bin/sh
# Prepare a Debian host (or CI container) for the auditor's real BPF path. Idempotent; run as root.
#
#   1. bcc (bpfcc-tools, python3-bpfcc), kernel headers (linux-headers-amd64) and sys/sdt.h
#      (systemtap-sdt-dev, needed to build the runtime's USDT probe extension).
#   2. bcc compiles against /lib/modules/$(uname -r)/build: when the running kernel's own headers
#      are not packaged (a cloud or VM kernel), link Debian's newest installed headers there.
#   3. tracefs at /sys/kernel/tracing (uprobes/USDT are created through it).
#   4. Make `import bcc` work for a non-Debian interpreter (pyenv, venv): a .pth file pointing at
#      Debian's dist-packages holding only bcc would be simpler, but dist-packages carries other
#      Debian-built modules, so we add a tiny shim package path instead (bcc is pure Python + libbcc).
set -eu

if [ "$(id -u)" != 0 ]; then
    echo "setup-host.sh: run as root" >&2
    exit 1
fi

need=""
for pkg in bpfcc-tools python3-bpfcc linux-headers-amd64 systemtap-sdt-dev; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need="$need $pkg"
done
if [ -n "$need" ]; then
    echo "setup-host.sh: installing$need"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q $need
fi

release=$(uname -r)
moddir=/lib/modules/$release
if [ ! -e "$moddir/build/Makefile" ]; then
    headers=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n 1)
    common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -n 1)
    if [ -z "$headers" ] || [ -z "$common" ]; then
        echo "setup-host.sh: no kernel headers under /usr/src" >&2
        exit 1
    fi
    mkdir -p "$moddir"
    ln -sfn "$headers" "$moddir/build"
    ln -sfn "$common" "$moddir/source"
    echo "setup-host.sh: linked $headers into $moddir (running kernel $release has no packaged headers)"
fi

if ! grep -q " /sys/kernel/tracing tracefs " /proc/mounts; then
    mount -t tracefs tracefs /sys/kernel/tracing
    echo "setup-host.sh: mounted tracefs"
fi

# bcc for the interpreter that runs zerolayer (first python3 on PATH unless PYTHON is set).
python=${PYTHON:-python3}
if ! "$python" -c "import bcc" 2>/dev/null; then
    site=$("$python" -c "import site; print(site.getsitepackages()[0])")
    shim=$site/zerolayer-bcc
    mkdir -p "$shim"
    ln -sfn /usr/lib/python3/dist-packages/bcc "$shim/bcc"
    echo "$shim" > "$site/zerolayer-bcc.pth"
    echo "setup-host.sh: made bcc importable for $python via $site/zerolayer-bcc.pth"
fi
"$python" -c "import bcc" && echo "setup-host.sh: ready (bcc, headers, tracefs)"
