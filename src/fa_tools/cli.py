"""fa-tools: one command line for the kernel toolchain."""

from __future__ import annotations

import argparse
import logging
import sys

from . import bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fa-tools", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench.add_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    return args.func(args)
