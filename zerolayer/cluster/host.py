"""Host-level pieces of real nodes: packages, the node bridge, sysctls, and the teardown that leaves the host clean.

Everything here acts on the whole machine (the root network namespace, iptables, ipsets, cgroups,
a few fixed host paths that kubelet and containerd create whatever their flags say), so only one
cluster with real nodes may run on a machine at a time: :func:`acquire` takes a host-wide claim
file and refuses a second one. The claim records what the host looked like before (sysctls, which
fixed host paths existed) so :func:`release` restores exactly that.

Needs root. Nothing here sends traffic anywhere; it only creates and removes addresses we own
(``BRIDGE`` with ``GATEWAY_IP`` and ``NODE_IP`` in ``NETWORK``).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import time

BRIDGE = "zl-br0"
NETWORK = "10.233.0.0/16"
PREFIX_LEN = 16
GATEWAY_IP = "10.233.0.1"  # the pods' default gateway and the API server's address
NODE_IP = "10.233.0.2"  # every real node's InternalIP (shared: see zerolayer.cluster.node)
CGROUP_PARENT = "zerolayer"  # real node i's kubelet uses cgroup root /zerolayer/real-node-<i>

CLAIM = pathlib.Path("/run/zerolayer-real-nodes.json")

# Paths kubelet and containerd create regardless of their flags (path -> the program that makes
# them); removed at teardown when they did not exist before the cluster started and no other such
# program still runs on the host.
FIXED_HOST_PATHS = {
    "/var/log/pods": "kubelet", "/var/log/containers": "kubelet", "/var/lib/kubelet": "kubelet",
    "/var/lib/cni": "containerd", "/opt/containerd": "containerd", "/run/containerd": "containerd",
    "/run/nri": "containerd",
}

# kubelet sets the first three at start (protectKernelDefaults=false); kube-router and bridged pod
# traffic need the last. All are restored at teardown.
SYSCTLS = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops", "net/bridge/bridge-nf-call-iptables")

# Debian packages real nodes need, keyed by a file each one installs.
PACKAGES = {
    "/usr/bin/containerd": "containerd",
    "/usr/bin/containerd-shim-runc-v2": "containerd",
    "/usr/sbin/runc": "runc",
    "/usr/lib/cni/bridge": "containernetworking-plugins",
    "/usr/lib/cni/host-local": "containernetworking-plugins",
    "/usr/lib/cni/loopback": "containernetworking-plugins",
    "/usr/lib/cni/portmap": "containernetworking-plugins",
    "/usr/sbin/iptables": "iptables",
    "/usr/sbin/ipset": "ipset",
    "/usr/sbin/conntrack": "conntrack",
    "/bin/busybox": "busybox-static",
    "/usr/bin/gcc": "gcc",
    "/usr/lib/x86_64-linux-gnu/libc.a": "libc6-dev",
}

# Chains and ipsets that kube-proxy, kube-router and the CNI portmap plugin create.
CHAIN_PREFIXES = ("KUBE-", "CNI-")
IPSET_PREFIXES = ("KUBE-", "TMP-", "inet6:KUBE-", "inet6:TMP-", "kube-router")


class HostError(RuntimeError):
    """The host cannot run real nodes, or a host change failed."""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and proc.returncode != 0:
        raise HostError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")
    return proc


# ---------------------------------------------------------------- packages and checks
def missing_packages() -> list[str]:
    return sorted({pkg for path, pkg in PACKAGES.items() if not os.path.exists(path)})


def ensure_packages(log=print) -> None:
    """Install the Debian packages real nodes need (apt-get, only the missing ones). Needs root.

    The packages' services are not started: no system containerd runs; each node runs its own.
    """
    missing = missing_packages()
    if not missing:
        return
    if os.geteuid() != 0:
        raise HostError(f"not root: cannot install {', '.join(missing)}")
    log(f"installing Debian packages for real nodes: {', '.join(missing)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing]):
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise HostError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}")


def unsupported_reason() -> str | None:
    """Why this host cannot run real nodes, or None. Checked before anything is changed."""
    if os.geteuid() != 0:
        return "real nodes need root (kubelet, containerd, iptables)"
    missing = missing_packages()
    if missing:
        return f"missing packages {', '.join(missing)} (scripts/setup.sh installs them)"
    if not pathlib.Path("/proc/sys/net/bridge/bridge-nf-call-iptables").exists():
        return "the kernel lacks br_netfilter (bridged pod traffic would bypass NetworkPolicies)"
    if "overlay" not in pathlib.Path("/proc/filesystems").read_text():
        return "the kernel lacks overlayfs (containerd's snapshotter)"
    if not pathlib.Path("/sys/fs/cgroup/memory").is_dir() and not pathlib.Path("/sys/fs/cgroup/cgroup.controllers").exists():
        return "no usable cgroup hierarchy under /sys/fs/cgroup"
    return None


# ---------------------------------------------------------------- claim
def claim_holder() -> str | None:
    """The state directory of the cluster whose real nodes hold this host, if any."""
    try:
        return json.loads(CLAIM.read_text())["state_dir"]
    except (FileNotFoundError, KeyError, json.JSONDecodeError):
        return None


def acquire(state_dir: pathlib.Path) -> None:
    """Claim the host for ``state_dir``'s real nodes, recording what teardown must restore."""
    holder = claim_holder()
    if holder is not None and holder != str(state_dir):
        raise HostError(f"real nodes of another local cluster ({holder}) hold this host; "
                        f"take that one down first (ZEROLAYER_STATE=... zerolayer cluster down)")
    if holder is None:
        record = {
            "state_dir": str(state_dir),
            "sysctls": {k: _read_sysctl(k) for k in SYSCTLS},
            "preexisting_paths": [p for p in FIXED_HOST_PATHS if os.path.lexists(p)],
        }
        CLAIM.write_text(json.dumps(record, indent=2))


def _read_sysctl(key: str) -> str | None:
    try:
        return pathlib.Path("/proc/sys", key).read_text().strip()
    except OSError:
        return None


def _write_sysctl(key: str, value: str) -> None:
    with contextlib.suppress(OSError):
        pathlib.Path("/proc/sys", key).write_text(value)


# ---------------------------------------------------------------- network
def setup_network() -> None:
    """Create ``BRIDGE`` with the gateway and node addresses (idempotent) and let bridged traffic
    through iptables, so NetworkPolicies apply between pods on the same bridge."""
    if _run("ip", "link", "show", BRIDGE, check=False).returncode != 0:
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
    have = _run("ip", "-4", "-o", "addr", "show", "dev", BRIDGE).stdout
    # The gateway first: it is the bridge's primary address.
    for ip in (GATEWAY_IP, NODE_IP):
        if f" {ip}/" not in have:
            _run("ip", "addr", "add", f"{ip}/{PREFIX_LEN}", "dev", BRIDGE)
    _run("ip", "link", "set", BRIDGE, "up")
    _write_sysctl("net/bridge/bridge-nf-call-iptables", "1")


def make_cgroup_root(node: str) -> str:
    """Create ``/zerolayer/<node>`` in every mounted cgroup hierarchy (the kubelet requires its
    cgroup root to exist) and return that path. One root per node keeps each kubelet's orphaned-pod
    cleanup away from the other nodes' pods."""
    rel = f"{CGROUP_PARENT}/{node}"
    for hierarchy in _cgroup_hierarchies():
        path = hierarchy / rel
        path.mkdir(parents=True, exist_ok=True)
        if hierarchy.name == "cpuset":
            # A new cpuset cgroup starts with no CPUs or memory nodes; copy the parent's.
            for parent, child in ((hierarchy, hierarchy / CGROUP_PARENT), (hierarchy / CGROUP_PARENT, path)):
                for knob in ("cpuset.cpus", "cpuset.mems"):
                    if not (child / knob).read_text().strip():
                        (child / knob).write_text((parent / knob).read_text())
    return "/" + rel


def _cgroup_hierarchies() -> list[pathlib.Path]:
    root = pathlib.Path("/sys/fs/cgroup")
    if (root / "cgroup.controllers").exists():
        return [root]
    return [p for p in root.iterdir() if p.is_dir() and not p.is_symlink()
            and ((p / "cgroup.procs").exists())]


# ---------------------------------------------------------------- teardown
def _descendants(roots: set[int]) -> list[int]:
    """PIDs below ``roots`` (by parent PID), deepest last."""
    children: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            out.append(child)
            todo.append(child)
    return out


def processes_mentioning(needle: str) -> list[int]:
    """PIDs whose command line contains ``needle`` (e.g. a node's containerd socket path)."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _netns_inode(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def kill_pods(needle: str) -> set[int]:
    """SIGKILL every containerd shim whose command line contains ``needle`` and everything below it
    (the pods' processes). Returns the network-namespace inodes those processes were in."""
    shims = set(processes_mentioning(needle))
    below = _descendants(shims)
    host_ns = _netns_inode(os.getpid())
    netns = {ino for ino in (_netns_inode(p) for p in below) if ino is not None and ino != host_ns}
    for pid in below + sorted(shims):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in below + list(shims)):
        time.sleep(0.1)
    return netns


def _mounts() -> list[str]:
    points = []
    for line in pathlib.Path("/proc/self/mountinfo").read_text().splitlines():
        points.append(line.split()[4].replace("\\040", " "))
    return points


def unmount_under(prefixes: list[str]) -> None:
    """Lazily unmount every mount point at or below ``prefixes``, deepest first."""
    norm = [p.rstrip("/") for p in prefixes]
    targets = [m for m in _mounts() if any(m == p or m.startswith(p + "/") for p in norm)]
    for point in sorted(set(targets), key=len, reverse=True):
        _run("umount", "-l", point, check=False)


def remove_netns(inodes: set[int]) -> list[str]:
    """Remove the named network namespaces (bind mounts under /run/netns) with these inodes."""
    removed = []
    base = pathlib.Path("/run/netns")
    for entry in sorted(base.iterdir()) if base.is_dir() else []:
        try:
            ino = entry.stat().st_ino
        except OSError:
            continue
        if ino in inodes:
            _run("umount", "-l", str(entry), check=False)
            with contextlib.suppress(OSError):
                entry.unlink()
            removed.append(entry.name)
    return removed


def remove_cgroups(node: str) -> None:
    """Remove ``/zerolayer/<node>`` and what the kubelet and runc made below it, in every hierarchy."""
    for hierarchy in _cgroup_hierarchies():
        top = hierarchy / CGROUP_PARENT / node
        if top.is_dir():
            for path in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
                with contextlib.suppress(OSError):
                    path.rmdir()
            with contextlib.suppress(OSError):
                top.rmdir()
        with contextlib.suppress(OSError):
            (hierarchy / CGROUP_PARENT).rmdir()  # only once empty: the last node's teardown


def remove_bridge() -> None:
    if _run("ip", "link", "show", BRIDGE, check=False).returncode == 0:
        _run("ip", "link", "del", BRIDGE)


def _iptables_tools() -> list[str]:
    return [t for t in ("iptables", "ip6tables", "iptables-legacy", "ip6tables-legacy") if shutil.which(t)]


def chains(tool: str = "iptables") -> dict[str, list[str]]:
    """table -> chains created by kube-proxy, kube-router or CNI (by prefix) in one iptables flavour."""
    out: dict[str, list[str]] = {}
    dump = _run(f"{tool}-save" if not tool.endswith("-legacy") else tool.replace("-legacy", "-legacy-save"),
                check=False).stdout
    table = None
    for line in dump.splitlines():
        if line.startswith("*"):
            table = line[1:]
        elif line.startswith(":") and table and line[1:].startswith(CHAIN_PREFIXES):
            out.setdefault(table, []).append(line[1:].split()[0])
    return out


def remove_chains() -> list[str]:
    """Delete every KUBE-*/CNI-* chain in every iptables flavour, after the rules that jump to them."""
    removed = []
    for tool in _iptables_tools():
        for table, names in chains(tool).items():
            ours = set(names)
            rules = _run(tool, "-t", table, "-S", check=False).stdout.splitlines()
            for rule in rules:
                parts = shlex.split(rule)
                if parts[:1] == ["-A"] and parts[1] not in ours and _jumps_to(parts, ours):
                    _run(tool, "-t", table, "-D", *parts[1:], check=False)
            for name in names:
                _run(tool, "-t", table, "-F", name, check=False)
            for name in names:
                if _run(tool, "-t", table, "-X", name, check=False).returncode == 0:
                    removed.append(f"{tool}/{table}/{name}")
    return removed


def _jumps_to(parts: list[str], targets: set[str]) -> bool:
    return any(flag in ("-j", "-g") and i + 1 < len(parts) and parts[i + 1] in targets
               for i, flag in enumerate(parts))


def remove_ipsets() -> list[str]:
    if not shutil.which("ipset"):
        return []
    names = [n for n in _run("ipset", "list", "-n", check=False).stdout.split() if n.startswith(IPSET_PREFIXES)]
    for name in names:
        _run("ipset", "destroy", name, check=False)
    return names


def _other_runtimes() -> dict[str, list[str]]:
    """PIDs of containerd and kubelet processes still running (this cluster's are stopped before release)."""
    found: dict[str, list[str]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                comm = (entry / "comm").read_text().strip()
            except OSError:
                continue
            if comm in ("containerd", "kubelet"):
                found.setdefault(comm, []).append(entry.name)
    return found


def release(state_dir: pathlib.Path, log=print) -> None:
    """Undo :func:`acquire` and :func:`setup_network`: bridge, chains, ipsets, fixed host paths,
    sysctls, the claim. Call after every process and mount of the cluster is gone. Idempotent."""
    holder = claim_holder()
    if holder is not None and holder != str(state_dir):
        log(f"host real-node state belongs to {holder}; leaving it")
        return
    try:
        record = json.loads(CLAIM.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        record = {"sysctls": {}, "preexisting_paths": list(FIXED_HOST_PATHS)}
    remove_bridge()
    remove_chains()
    remove_ipsets()
    others = _other_runtimes()
    for path, owner in FIXED_HOST_PATHS.items():
        if path in record.get("preexisting_paths", []) or not os.path.lexists(path):
            continue
        if others.get(owner):
            # Another containerd or kubelet (not ours: ours are stopped by now) may use it.
            log(f"leaving {path}: {owner} pid {', '.join(others[owner])} still runs on this host")
            continue
        shutil.rmtree(path, ignore_errors=True)
    for key, value in record.get("sysctls", {}).items():
        if value is not None:
            _write_sysctl(key, value)
    with contextlib.suppress(FileNotFoundError):
        CLAIM.unlink()
