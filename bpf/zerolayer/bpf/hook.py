"""How ``zerolayer runtime`` meters tokens: its audit flags and the probe whose ``emit`` is the token sink.

The runtime imports this module only; it depends on :mod:`zerolayer.bpf.probes` and nothing
heavier (no bcc, no SQLite). The USDT probe is always on (a nop until an auditor attaches).
"""

from __future__ import annotations

import argparse
import os
import sys
from zerolayer.bpf.errors import AuditError
from zerolayer.bpf.probes import TokenProbe


def add_audit_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--audit-spool", default=os.environ.get("ZEROLAYER_AUDIT_SPOOL"),
                        help="directory shared with the auditor: token counters (the cross-check) and, with "
                             "--audit-journal, the in-process event journal (env ZEROLAYER_AUDIT_SPOOL)")
    parser.add_argument("--audit-journal", action="store_true",
                        default=os.environ.get("ZEROLAYER_AUDIT_JOURNAL", "") not in ("", "0", "false"),
                        help="also write token events to the spool journal: metering for hosts without BPF")
    parser.add_argument("--audit-window-ms", type=float, default=float(os.environ.get("ZEROLAYER_AUDIT_WINDOW_MS", 50)),
                        help="metering window: one token event per request per window (default 50 ms; 0: every "
                             "event-loop iteration). A runtime killed with SIGKILL leaves its last window "
                             "unmetered (env ZEROLAYER_AUDIT_WINDOW_MS)")


def open_token_probe(args: argparse.Namespace) -> TokenProbe:
    """The process's TokenProbe as ``args`` ask for it; its ``emit`` is the server's token sink
    (the composition root passes it to the server's constructor) and it is closed at exit.

    A spool that cannot be used ends the runtime with a message (exit status 2): metering is not optional
    once asked for.
    """
    try:
        return TokenProbe(args.audit_spool, journal=bool(args.audit_journal), window_s=args.audit_window_ms / 1000)
    except AuditError as exc:
        print(f"zerolayer runtime: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
