"""`zerolayer defragd` and `zerolayer map` run on GPU nodes whose Python may lack what the local control
plane needs (its PKI uses `cryptography`): building the CLI must not import it; `cluster` actions do."""

from __future__ import annotations

import subprocess
import sys

BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "cryptography" or name.startswith("cryptography."):
            raise ImportError("cryptography is blocked in this test")
sys.meta_path.insert(0, Block())
sys.argv = ["zerolayer", *sys.argv[1:]]
from zerolayer import cli
sys.exit(cli.main())
"""


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK, *args], capture_output=True, text=True, timeout=60)


def test_defragd_and_map_help_without_cryptography():
    for command in ("defragd", "map"):
        result = run_cli(command, "--help")
        assert result.returncode == 0, result.stderr
        assert "usage: zerolayer" in result.stdout


def test_a_cluster_action_still_needs_it_and_says_so():
    result = run_cli("cluster", "status")
    assert result.returncode != 0
    assert "cryptography" in result.stderr
