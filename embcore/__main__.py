"""``python -m embcore``: command-line helpers.

    python -m embcore kernels     build the fused CPU kernels now (they are otherwise built on
                                  first use) and print where the library is
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m embcore", description="embcore's helpers.")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("kernels", help="build the fused CPU kernels now and print where they are")
    args = p.parse_args(argv)
    if args.command == "kernels":
        from .kernels import cpu
        return cpu.main()
    return 2  # (argparse rejects other commands)


if __name__ == "__main__":
    sys.exit(main())
