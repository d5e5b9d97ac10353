"""bench/benchlib.py's run_client: the load generator runs in a session of its own whose scheduling group
outranks the servers' (docs/benchmarks.md section 14). Without it, a client in the bench's session was kept
off the CPU for up to 2 s at a time by busy servers in theirs, and the benches measured that."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import benchlib  # noqa: E402

AUTOGROUP = pathlib.Path("/proc/self/autogroup")
SHOW = [sys.executable, "-c", "import os; print(os.getsid(0), os.getpid(), open('/proc/self/autogroup').read().strip())"]


@pytest.mark.skipif(not AUTOGROUP.exists(), reason="kernel without autogroup (CONFIG_SCHED_AUTOGROUP)")
def test_the_client_gets_its_own_session_and_a_raised_group() -> None:
    done, group = benchlib.run_client(SHOW)
    assert done.returncode == 0, done.stderr
    sid, pid, seen = done.stdout.strip().split(maxsplit=2)
    assert sid == pid, "the client leads a session of its own"
    assert int(sid) != os.getsid(0)
    assert seen == group, "the group reported is the one the child ran in"
    if os.geteuid() == 0:  # raising a priority needs CAP_SYS_NICE
        assert group.endswith(f"nice {benchlib.CLIENT_AUTOGROUP_NICE}"), group


def test_the_client_output_and_exit_status_come_back() -> None:
    done, _ = benchlib.run_client([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); "
                                   "sys.exit(3)"])
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")


def test_a_log_takes_both_streams_in_order(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "client.log"
    with open(path, "w") as log:
        done, _ = benchlib.run_client([sys.executable, "-c", "import sys; print('out', flush=True); "
                                       "print('err', file=sys.stderr); sys.exit(2)"], log=log)
    assert (done.returncode, done.stdout, done.stderr) == (2, None, None)
    assert path.read_text() == "out\nerr\n"
