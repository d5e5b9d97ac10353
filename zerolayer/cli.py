"""The ``zerolayer`` console command.

Each component owns its subcommands in a module with ``register(subparsers)``;
this file only lists those modules. A subcommand's handler receives the parsed
``argparse.Namespace`` and returns an exit status.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from zerolayer.version import __version__

# Order is the order shown in --help.
COMMAND_MODULES = [
    "zerolayer.cluster.cli",
    "zerolayer.operator.cli",
    "zerolayer.runtime.cli",
    "zerolayer.runtime.node.fetch_model",
    "zerolayer.map_cli",
    "zerolayer.runtime.defrag.cli",
    "zerolayer.bpf.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zerolayer",
        description="LLM inference with no orchestration layer between client and engine.",
    )
    parser.add_argument("--version", action="version", version=f"zerolayer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
