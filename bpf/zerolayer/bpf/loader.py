"""Load bpf/token_events.bpf.c and turn ring-buffer records into :class:`TokenEvent`.

bcc style: :func:`check_kernel` says plainly why the kernel path cannot run here;
:func:`render_program` fills the placeholders of the C file; ``python -m zerolayer.bpf.loader
--print-bpf`` prints the final program. :class:`BpfTokenSource` attaches once to the probe
library (``zerolayer/bpf/_probes*.so``): every process that maps it -- each runtime, also one
started later -- fires the probe; the program keeps only the processes or cgroups it is told about.

bcc is Debian's ``python3-bpfcc``; for another interpreter bpf/setup-host.sh makes it importable.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import pathlib
import struct
import sys
import time
from typing import Iterable

from zerolayer.bpf.errors import BpfUnavailable
from zerolayer.bpf.events import TokenEvent, decode_records
from zerolayer.bpf.probes import probe_library

log = logging.getLogger(__name__)
PROGRAM = pathlib.Path(__file__).with_name("token_events.bpf.c")
TRACEFS = pathlib.Path("/sys/kernel/tracing")
DEBIAN_DIST_PACKAGES = "/usr/lib/python3/dist-packages"
PAGE = 4096


# struct batch_header in token_events.bpf.c: ktime_ns, cgroup_id, pid, count, len, pad.
HEADER = struct.Struct("<QQIIII")


def import_bcc():  # type: ignore[no-untyped-def]
    """Return the ``bcc`` module, also from Debian's dist-packages for a non-Debian interpreter."""
    try:
        import bcc
    except ImportError:
        if os.path.isdir(os.path.join(DEBIAN_DIST_PACKAGES, "bcc")) and DEBIAN_DIST_PACKAGES not in sys.path:
            sys.path.append(DEBIAN_DIST_PACKAGES)
            try:
                import bcc
            except ImportError as exc:
                raise BpfUnavailable(f"bcc is installed for Debian's python but does not import here: {exc}") from exc
        else:
            raise BpfUnavailable("bcc is not installed (Debian: apt-get install python3-bpfcc; see "
                                 "bpf/setup-host.sh)") from None
    return bcc


def wall_offset_ns() -> int:
    """Wall clock minus CLOCK_MONOTONIC now (what turns a BPF ktime into Unix time)."""
    return time.time_ns() - time.monotonic_ns()


def ring_pages(ring_buffer_bytes: int) -> int:
    """Ring buffers are a power-of-two number of pages; round the setting up."""
    pages = max(1, -(-ring_buffer_bytes // PAGE))
    return 1 << (pages - 1).bit_length()


def render_program(*, ring_buffer_bytes: int = 16 << 20, filter_pids: bool = False,
                   filter_cgroups: bool = False) -> str:
    text = PROGRAM.read_text()
    return (text.replace("RINGBUF_PAGES", str(ring_pages(ring_buffer_bytes)))
            .replace("FILTER_PIDS", "1" if filter_pids else "0")
            .replace("FILTER_CGROUPS", "1" if filter_cgroups else "0"))


def check_kernel() -> None:
    """Raise :class:`BpfUnavailable` naming the first missing piece; return when all is there."""
    if os.geteuid() != 0:
        raise BpfUnavailable("not root: loading BPF programs needs root (or CAP_BPF+CAP_PERFMON)")
    if probe_library() is None:
        raise BpfUnavailable("the USDT probe extension (zerolayer.bpf._probes) was not built: install "
                             "systemtap-sdt-dev and reinstall zerolayer")
    if not (TRACEFS / "uprobe_events").exists():
        raise BpfUnavailable(f"tracefs is not mounted at {TRACEFS} (mount -t tracefs tracefs {TRACEFS}) "
                             "or the kernel lacks CONFIG_UPROBE_EVENTS")
    release = os.uname().release
    if not pathlib.Path(f"/lib/modules/{release}/build").exists():
        raise BpfUnavailable(f"no kernel headers at /lib/modules/{release}/build (bcc compiles against them; "
                             "see bpf/setup-host.sh)")
    major, minor = (int(x) for x in release.split(".")[:2])
    if (major, minor) < (5, 8):
        raise BpfUnavailable(f"kernel {release} has no BPF ring buffer (needs 5.8+)")
    import_bcc()


def cgroup_id(path: str | os.PathLike[str]) -> int:
    """The id ``bpf_get_current_cgroup_id()`` returns for a cgroup v2 directory: its inode number."""
    try:
        return os.stat(path).st_ino
    except OSError as exc:
        raise BpfUnavailable(f"cannot read cgroup {path}: {exc}") from exc


def cgroup2_root(base: str | os.PathLike[str] = "/sys/fs/cgroup") -> pathlib.Path:
    """Where the cgroup v2 hierarchy is: ``base`` (unified) or ``base/unified`` (hybrid). ``base`` is the host's
    /sys/fs/cgroup, or where a container sees it mounted (the operator's auditor: /host/sys/fs/cgroup)."""
    for path in (pathlib.Path(base), pathlib.Path(base) / "unified"):
        if (path / "cgroup.procs").exists() and (path / "cgroup.controllers").exists():
            return path
    raise BpfUnavailable(f"no cgroup v2 hierarchy at {base} or {base}/unified")


def pod_cgroups(uid: str, root: str | os.PathLike[str] | None = None, max_depth: int = 6) -> list[str]:
    """The cgroup v2 directories of the pod with this UID on this host (the kubelet's pod-level cgroup).

    Both kubelet cgroup drivers: cgroupfs names it ``pod<uid>``, systemd ``kubepods-<qos>-pod<uid_>.slice``
    (dashes as underscores). Its containers are below it, which the BPF filter covers.
    """
    base = pathlib.Path(root) if root is not None else cgroup2_root()
    needles = (f"pod{uid}", f"pod{uid.replace('-', '_')}")
    found: list[str] = []
    level = [base]
    for _ in range(max_depth):
        below = []
        for directory in level:
            try:
                children = [c for c in directory.iterdir() if c.is_dir()]
            except OSError:
                continue
            for child in children:
                name = child.name
                if name.endswith(needles) or any(f"{n}." in name for n in needles):
                    found.append(str(child))
                else:
                    below.append(child)
        level = below
    return sorted(found)


class BpfTokenSource:
    """The kernel path: attach, then ``poll`` for events. Not thread-safe; one reader thread."""

    kind = "bpf"

    def __init__(self, *, ring_buffer_bytes: int = 16 << 20, pids: Iterable[int] = (),
                 cgroups: Iterable[str] = (), drain_interval_s: float = 0.1, filter_pids: bool = False,
                 library: str | None = None) -> None:
        """``pids``/``cgroups``: meter only these (none: every process that loads the probe library).
        ``filter_pids=True`` filters by pid even with no pid yet: add them later with :meth:`add_pid`.
        ``library``: the probe library file the runtimes map (default: this installation's). Uprobes key on
        the file's inode: a runtime in another container of the same image maps the same lower-layer file;
        otherwise pass its path as seen from here (e.g. ``/proc/<pid>/root/...``)."""
        check_kernel()
        self.drain_interval_s = drain_interval_s
        bcc = import_bcc()
        self.pids = [int(p) for p in pids]
        self.cgroup_ids = [cgroup_id(c) for c in cgroups]
        self.text = render_program(ring_buffer_bytes=ring_buffer_bytes, filter_pids=bool(self.pids) or filter_pids,
                                   filter_cgroups=bool(self.cgroup_ids))
        library = library or probe_library()
        try:
            usdt = bcc.USDT(path=library)
            usdt.enable_probe(probe="tokens", fn_name="on_tokens")
            # bytes everywhere: bcc warns (DeprecationWarning) on str arguments
            self.bpf = bcc.BPF(text=self.text.encode(), usdt_contexts=[usdt])
            for pid in self.pids:
                self.bpf[b"target_pids"][ctypes.c_uint32(pid)] = ctypes.c_uint8(1)
            for cid in self.cgroup_ids:
                self.bpf[b"target_cgroups"][ctypes.c_uint64(cid)] = ctypes.c_uint8(1)
            self._ring = self.bpf[b"events"]
            self._ring.open_ring_buffer(self._on_event)
        except Exception as exc:  # bcc raises Exception for compile/attach failures
            raise BpfUnavailable(f"cannot load the BPF program: {exc}") from exc
        self._raw: list[bytes] = []
        self.batches = 0
        self.corrupt = 0  # batches whose records did not decode (counted in lost())

    def _on_event(self, ctx, data, size) -> int:  # type: ignore[no-untyped-def]
        # Runs once per batch: copy the bytes out, decode after the drain.
        self._raw.append(ctypes.string_at(data, size))
        return 0

    def poll(self, timeout_ms: int = 100) -> list[TokenEvent]:
        """Sleeps ``min(timeout_ms, drain interval)``, then returns every event submitted so far.

        The program submits without waking us (BPF_RB_NO_WAKEUP): draining on a timer costs one
        wakeup per interval instead of one per batch, on both sides. ``poll(0)`` never sleeps.
        """
        if timeout_ms > 0:
            time.sleep(min(timeout_ms / 1000, self.drain_interval_s))
        self.bpf.ring_buffer_consume()
        raw, self._raw = self._raw, []
        events: list[TokenEvent] = []
        # ktime is CLOCK_MONOTONIC; events are stored with wall time. The offset is read at every poll, not
        # once at attach: an NTP step moves the wall clock and not ktime (review finding 29).
        offset = wall_offset_ns()
        for record in raw:
            ktime, cgroup, pid, count, length, _ = HEADER.unpack_from(record)
            try:
                batch, used = decode_records(record[HEADER.size:HEADER.size + length], pid, wall_ns=ktime + offset,
                                             cgroup_id=cgroup, source="bpf")
                if used != length or len(batch) != count:
                    raise ValueError(f"{len(batch)} of {count} events in {used} of {length} bytes")
            except ValueError as exc:
                # Not the runtime's records: count them as lost (never silent) and keep going.
                self.corrupt += count
                log.error("dropping a corrupt token batch from pid %d: %s", pid, exc)
                continue
            events.extend(batch)
        self.batches += len(raw)
        return events

    def lost(self) -> int:
        """Events lost since attach: the ring buffer was full, or a batch could not be read or decoded."""
        return int(sum(self.bpf[b"lost"].getvalue(0))) + self.corrupt

    def add_pid(self, pid: int) -> None:
        """Meter this process from now on (only when the program filters by pid)."""
        self.bpf[b"target_pids"][ctypes.c_uint32(pid)] = ctypes.c_uint8(1)
        self.pids.append(pid)

    def close(self) -> None:
        self.bpf.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zerolayer.bpf.loader",
                                     description="Check the kernel path or print the BPF program.")
    parser.add_argument("--print-bpf", action="store_true", help="print the final BPF C program and exit")
    parser.add_argument("--ring-buffer-mb", type=float, default=16)
    parser.add_argument("--pid", type=int, action="append", default=[])
    parser.add_argument("--cgroup", action="append", default=[])
    args = parser.parse_args(argv)
    if args.print_bpf:
        print(render_program(ring_buffer_bytes=int(args.ring_buffer_mb * (1 << 20)), filter_pids=bool(args.pid),
                             filter_cgroups=bool(args.cgroup)))
        return 0
    try:
        check_kernel()
    except BpfUnavailable as exc:
        print(f"BPF path unavailable: {exc}")
        return 1
    print("BPF path available")
    return 0


if __name__ == "__main__":
    sys.exit(main())
