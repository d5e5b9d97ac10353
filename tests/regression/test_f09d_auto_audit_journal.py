"""Review finding 9d: with ``audit.mode: auto`` the auditor falls back to the runtime's journal when
BPF cannot run, but the server wrote a journal only for ``inprocess``: all usage was then booked from
counters, at the snapshot minute, with zero requests. ``auto`` now passes ``--audit-journal``."""

from __future__ import annotations

import pytest

from tests.regression.manifest_fixtures import containers, daemonset, inode

pytestmark = [pytest.mark.regression]


@pytest.mark.parametrize("audit", [{}, {"mode": "auto"}, {"mode": "inprocess"}])
def test_modes_that_may_read_the_journal_get_one(audit):
    server = containers(daemonset(inode(audit=audit)))["server"]
    assert "--audit-journal" in server["args"]


def test_bpf_mode_writes_no_journal():
    server = containers(daemonset(inode(audit={"mode": "bpf"})))["server"]
    assert "--audit-journal" not in server["args"]


def test_the_spool_is_bounded():
    """The journal lives in the pod's ``run`` emptyDir: a stalled auditor must not fill the node's disk."""
    ds = daemonset(inode(audit={"mode": "auto"}))
    run = next(v for v in ds["spec"]["template"]["spec"]["volumes"] if v["name"] == "run")
    assert run["emptyDir"].get("sizeLimit")
