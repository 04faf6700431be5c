"""The `hwtune` command: one entry point, one module per command family.

Each command module under daemon/commands/ exposes, per command it owns,
`add_<name>_arguments(parser)` and `run_<name>(args, ctx) -> int`.
Modules are imported only for the command being run (and for --help), so the
hardware commands never import torch.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from daemon.context import Context
from hwtune.errors import HwtuneError

# name -> (module, one-line help). Explicit registry, no discovery magic.
COMMANDS: dict[str, tuple[str, str]] = {
    "status": ("daemon.commands.hardware", "every knob's current value per device"),
    "plan": ("daemon.commands.hardware", "what apply would change, old -> new; writes nothing"),
    "apply": ("daemon.commands.hardware", "journal, write, read back; restore all on failure"),
    "verify": ("daemon.commands.hardware", "exit 0 when the host matches the profile, 1 on drift"),
    "rollback": ("daemon.commands.hardware", "restore every journaled original value"),
    "sim": ("daemon.commands.sim", "create or edit a simulated host file"),
    "check-kernel": ("daemon.commands.kernels", "run one candidate through the verifier and timing"),
    "search": ("daemon.commands.search", "kernel autoresearch loop"),
    "share": ("daemon.commands.share", "export / import search results between hosts of one device fingerprint"),
    "tune": ("daemon.commands.tune", "nested tuning cycle: hardware points x kernels"),
    "bench": ("daemon.commands.bench", "end-to-end tokens/s and tokens/J"),
    "daemon": ("daemon.commands.service", "the service loop"),
    "demo": ("daemon.commands.demo", "the new user's main job: plan -> tune -> bench -> report"),
}


def _tell(line: str) -> None:
    """The last word on stderr; a terminal that is gone must not change the exit code."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _fn_name(prefix: str, command: str) -> str:
    return f"{prefix}_{command.replace('-', '_')}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hwtune",
        description="Tune an owned GPU host: hardware knobs, Triton kernels, end-to-end proof.",
    )
    Context.add_global_arguments(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            p.set_defaults(_missing=module_name)
            continue
        add = getattr(module, _fn_name("add", name) + "_arguments")
        add(p)
        p.set_defaults(_run=getattr(module, _fn_name("run", name)))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    if getattr(args, "_missing", None):
        print(f"hwtune {args.command}: not available in this build ({args._missing} missing)", file=sys.stderr)
        return 2
    ctx = Context.from_args(args)
    try:
        return int(args._run(args, ctx) or 0)
    except HwtuneError as exc:
        _tell(f"hwtune {args.command}: {exc}")
        return exc.exit_code
    except KeyboardInterrupt:
        _tell(f"hwtune {args.command}: interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
