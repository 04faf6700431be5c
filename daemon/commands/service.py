"""`hwtune daemon`: the service loop (daemon/service.py)."""
from __future__ import annotations

import argparse
from pathlib import Path

from daemon.context import path_arg


def add_daemon_arguments(p: argparse.ArgumentParser) -> None:
    # Its own dest: a subparser default would otherwise overwrite the global --config.
    p.add_argument("--config", dest="daemon_config", type=path_arg, default=None, metavar="FILE",
                   help="service config (root-owned, not group/world-writable); same as the global --config")
    p.add_argument("--once", action="store_true",
                   help="recover, apply the profile, check once and exit (settings stay)")


def run_daemon(args, ctx) -> int:
    from daemon.service import Service

    ctx.check_can_write("daemon")
    ctx.ensure_state_dir()
    return Service(ctx, config_path=args.daemon_config or ctx.config_path, once=args.once).run()
