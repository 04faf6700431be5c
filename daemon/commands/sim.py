"""hwtune sim init|set|show: create and edit a simulated host file.

These edit the simulated host itself (its settings, faults and telemetry): --read-only (or
HWTUNE_READ_ONLY=1) refuses `set`, and `init --force` over an existing file, before anything
is written (exit 4, as every read-only refusal), so read-only means no change to the host,
simulated or not. A new file (`init` where there is none) changes no host. Values in `sim set` are JSON when they parse as JSON
(numbers, true, null, lists), text otherwise.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from hwtune.errors import ReadOnlyError, UsageError


def add_sim_arguments(p) -> None:
    from hwtune.backends.sim import DEFAULT_CPUS, DEFAULT_GPUS

    sub = p.add_subparsers(dest="sim_command", metavar="ACTION", required=True)
    init = sub.add_parser("init", help="create an H200-like simulated node",
                          description="Create an H200-like simulated node in FILE. Commands given "
                                      "--sim FILE keep their state (journal, lock, ledger) beside it, "
                                      "in FILE.state, unless --state-dir says otherwise.")
    init.add_argument("file", type=Path, help="the JSON file to create (e.g. host.json)")
    init.add_argument("--gpus", type=int, default=DEFAULT_GPUS,
                      help=f"simulated H200 GPUs (default {DEFAULT_GPUS}, as `hwtune demo`)")
    init.add_argument("--cpus", type=int, default=DEFAULT_CPUS, help=f"simulated CPUs (default {DEFAULT_CPUS})")
    init.add_argument("--force", action="store_true", help="overwrite an existing file")
    init.add_argument("--json", action="store_true", help="print {file, gpus} as JSON on stdout")
    st = sub.add_parser("set", help="edit values: gpus.0.telemetry.temperature_c=95 write_delay_ms=20",
                        description="Edit keys the file already has, each with a value of its type "
                                    "(JSON: numbers, true/false, null, lists; text otherwise). An "
                                    "unknown key or a wrong type is refused and nothing is written.")
    st.add_argument("file", type=Path, help="the simulated host file")
    st.add_argument("assignments", nargs="+", metavar="dotted.key=value",
                    help="e.g. gpus.1.telemetry.temperature_c=95, write_delay_ms=20, "
                         "faults='[{\"op\": \"set_power_limit\", \"gpu\": 1, \"error\": \"NoPermission\"}]'")
    st.add_argument("--json", action="store_true", help="print the assignments as JSON on stdout")
    show = sub.add_parser("show", help="print the simulated host",
                          description="Print the simulated host file (its settings, faults and telemetry) as JSON.")
    show.add_argument("file", type=Path, help="the simulated host file")
    show.add_argument("--json", action="store_true", help="accepted for symmetry: the output is always JSON")


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def run_sim(args, ctx) -> int:
    from hwtune.backends import write_json_atomic
    from hwtune.backends.sim import SimFile, check_host, new_host, set_dotted

    if args.sim_command == "init":
        from daemon.context import ensure_writable_dir

        if args.file.exists() and not args.force:
            raise UsageError(f"{args.file}: exists (use --force to overwrite)")
        if args.file.exists() and ctx.read_only:
            raise ReadOnlyError(f"read-only mode: overwriting the simulated host {args.file} refused; "
                                "nothing was written")
        if args.file.is_dir():
            raise UsageError(f"{args.file}: is a directory (name the JSON file to create)")
        if args.cpus < 1:
            raise UsageError(f"--cpus {args.cpus}: need at least 1")
        data = new_host(gpus=args.gpus, cpus=args.cpus)
        if args.state_dir is not None:  # the state the next commands will keep: check it now
            ctx.ensure_state_dir()
        ensure_writable_dir(args.file.parent, "directory", "choose another place for FILE")
        write_json_atomic(args.file, data)
        print(f"simulated host {args.file}: {args.gpus} x H200, {len(data['pcie'])} PCIe functions, "
              f"{args.cpus} CPUs", file=sys.stderr)
        if args.json:
            json.dump({"file": str(args.file), "gpus": args.gpus}, sys.stdout)
            print()
        return 0
    sim = SimFile(args.file)
    if args.sim_command == "set":
        if ctx.read_only:
            raise ReadOnlyError(f"read-only mode: sim set on {args.file} refused (it changes the simulated "
                                "host); nothing was written")
        pairs = []
        for a in args.assignments:
            key, sep, value = a.partition("=")
            if not sep or not key:
                raise UsageError(f"{a!r}: expected dotted.key=value")
            pairs.append((key, _parse_value(value), value))

        def change(data):
            for key, value, raw in pairs:
                set_dotted(data, key, value, raw)
            # the file as every command will read it: a negative limit, NaN or Infinity (JSON
            # only Python reads) made each later command refuse it
            check_host(data, str(args.file))
            try:
                json.dumps(data, allow_nan=False)
            except ValueError:
                raise UsageError(f"simulated host {args.file}: NaN or Infinity is not a number; "
                                 "nothing was written") from None
        sim.check_writable()
        sim.update(change)
        if args.json:
            json.dump({k: v for k, v, _ in pairs}, sys.stdout)
            print()
        return 0
    json.dump(sim.read(), sys.stdout, indent=2)
    print()
    return 0
