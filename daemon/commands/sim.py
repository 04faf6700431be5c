"""hwtune sim init|set|show: create and edit a simulated host file.

These edit the simulation (its "hardware" and telemetry), so they are not host writes and
--read-only does not apply to them. Values in `sim set` are JSON when they parse as JSON
(numbers, true, null, lists), text otherwise.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from hwtune.errors import UsageError


def add_sim_arguments(p) -> None:
    sub = p.add_subparsers(dest="sim_command", metavar="ACTION", required=True)
    init = sub.add_parser("init", help="create an H200-like simulated node")
    init.add_argument("file", type=Path)
    init.add_argument("--gpus", type=int, default=8)
    init.add_argument("--cpus", type=int, default=8)
    init.add_argument("--force", action="store_true", help="overwrite an existing file")
    init.add_argument("--json", action="store_true")
    st = sub.add_parser("set", help="edit values: gpus.0.telemetry.temperature_c=95 write_delay_ms=20")
    st.add_argument("file", type=Path)
    st.add_argument("assignments", nargs="+", metavar="dotted.key=value")
    st.add_argument("--json", action="store_true")
    show = sub.add_parser("show", help="print the simulated host")
    show.add_argument("file", type=Path)
    show.add_argument("--json", action="store_true")


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def run_sim(args, ctx) -> int:
    from hwtune.backends import write_json_atomic
    from hwtune.backends.sim import SimFile, new_host, set_dotted

    if args.sim_command == "init":
        if args.file.exists() and not args.force:
            raise UsageError(f"{args.file}: exists (use --force to overwrite)")
        data = new_host(gpus=args.gpus, cpus=args.cpus)
        args.file.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(args.file, data)
        print(f"simulated host {args.file}: {args.gpus} x H200, {len(data['pcie'])} PCIe functions, "
              f"{args.cpus} CPUs", file=sys.stderr)
        if args.json:
            json.dump({"file": str(args.file), "gpus": args.gpus}, sys.stdout)
            print()
        return 0
    sim = SimFile(args.file)
    if args.sim_command == "set":
        pairs = []
        for a in args.assignments:
            key, sep, value = a.partition("=")
            if not sep or not key:
                raise UsageError(f"{a!r}: expected dotted.key=value")
            pairs.append((key, _parse_value(value)))

        def change(data):
            for key, value in pairs:
                set_dotted(data, key, value)
        sim.update(change)
        if args.json:
            json.dump({k: v for k, v in pairs}, sys.stdout)
            print()
        return 0
    json.dump(sim.read(), sys.stdout, indent=2)
    print()
    return 0
