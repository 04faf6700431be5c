"""`hwtune share export|import`: move ledger rows and dispatch tables between hosts of the same
device fingerprint (kernelsearch.share). Messages go to stderr; `--json` prints one document."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from daemon.device import DEVICE_HELP, resolve_device
from hwtune.errors import UsageError


def add_share_arguments(p) -> None:
    sub = p.add_subparsers(dest="share_command", metavar="ACTION", required=True)
    exp = sub.add_parser("export", help="write this device's rows and dispatch table as a JSON bundle")
    exp.add_argument("-o", "--output", default="-", help="bundle file (default: stdout)")
    exp.add_argument("--kernel", default=None, help="only this kernel's rows and winners")
    exp.add_argument("--fingerprint", default=None, metavar="ID",
                     help="export this fingerprint id instead of this host's")
    exp.add_argument("--json", action="store_true",
                     help="one JSON document on stdout: the bundle (the default), or with -o FILE "
                          "{file, fingerprint_id, rows, entries}; an error is one too")
    imp = sub.add_parser("import", help="store a bundle's rows and winners here (same fingerprint only)")
    imp.add_argument("bundle", help="bundle file ('-': stdin)")
    imp.add_argument("--force", action="store_true",
                     help="import a bundle from another fingerprint (rows keep their fingerprint; "
                          "winners go into this host's table marked imported_from)")
    imp.add_argument("--json", action="store_true", help="one JSON document on stdout")
    for q in (exp, imp):
        q.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                       help=f"whose fingerprint is 'this host': {DEVICE_HELP}")
        q.add_argument("--ledger", type=Path, default=None, help="SQLite ledger (default STATE_DIR/ledger.sqlite)")


def _local_fingerprint(device: str) -> dict:
    device = resolve_device(device)
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # as `hwtune search --device cpu` measures
    from kernelsearch.fingerprint import collect

    return collect(device)


def _write_whole(path: Path, text: str) -> None:
    """A regular file (or a new one) gets the whole bundle or keeps what it held: a full disk
    left a truncated bundle, an earlier one at that name lost. Anything else (/dev/stdout, a
    FIFO) is written as it is."""
    import stat

    from kernelsearch.dispatch import write_whole

    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        regular = True
    if not regular:
        path.write_text(text)
        return
    write_whole(path, text, mode=0o644)


MAX_BUNDLE_BYTES = 256 << 20   # a bundle is read whole: ledger rows and kernel sources, far less


def run_share(args, ctx) -> int:
    from kernelsearch import share
    from kernelsearch.dispatch import TableError
    from kernelsearch.fingerprint import fingerprint_id
    from kernelsearch.ledger import LedgerError

    if args.share_command == "export":
        if args.kernel is not None:
            from kernelsearch.specs import SPECS

            if args.kernel not in SPECS:
                from daemon.commands.kernels import did_you_mean

                raise UsageError(f"--kernel {args.kernel}: no such kernel{did_you_mean(args.kernel)} "
                                 f"(known: {', '.join(SPECS)})")
        local = None if args.fingerprint else _local_fingerprint(args.device)
        ctx.ensure_state_dir()  # the ledger lives there (opening it creates it)
        fp_id = args.fingerprint or fingerprint_id(local)
        try:
            bundle = share.export_bundle(ctx.state_dir, fp_id, fingerprint=local, ledger_path=args.ledger,
                                         kernel=args.kernel)
        except LookupError as exc:
            raise UsageError(str(exc).strip("'\"")) from None
        except TableError as exc:
            raise UsageError(f"{exc}; move it aside to export the ledger rows alone") from None
        except LedgerError as exc:
            raise UsageError(str(exc)) from None
        text = json.dumps(bundle, indent=1, sort_keys=True) + "\n"
        if args.output == "-":
            sys.stdout.write(text)
        else:
            try:
                _write_whole(Path(args.output), text)
            except OSError as exc:
                raise UsageError(f"--output {args.output}: {exc.strerror or exc}") from None
        for note in bundle["notes"]:
            print(f"note: {note}", file=sys.stderr)
        entries = len((bundle["dispatch"] or {}).get("entries", []))
        if args.json and args.output != "-":
            print(json.dumps({"file": args.output, "fingerprint_id": fp_id, "rows": len(bundle["attempts"]),
                              "entries": entries}))
        print(f"exported {len(bundle['attempts'])} ledger rows and {entries} dispatch entries for {fp_id}"
              f"{' -> ' + args.output if args.output != '-' else ''}", file=sys.stderr)
        return 0

    from hwtune import yamlguard

    try:
        if args.bundle == "-":
            raw = sys.stdin.buffer.read(MAX_BUNDLE_BYTES + 1)
            if len(raw) > MAX_BUNDLE_BYTES:
                raise yamlguard.Unreadable(f"larger than {MAX_BUNDLE_BYTES >> 20} MiB")
        else:   # a regular file, read no further than the limit (/dev/zero, a FIFO: refused)
            raw, _ = yamlguard.read_input(args.bundle, MAX_BUNDLE_BYTES)
        bundle = json.loads(raw.decode("utf-8"))
    except yamlguard.Unreadable as exc:
        raise UsageError(f"{args.bundle}: {exc.problem}") from None
    except (ValueError, RecursionError) as exc:   # not UTF-8, not JSON, nested past the parser
        raise UsageError(f"{args.bundle}: not JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
    local = _local_fingerprint(args.device)
    ctx.ensure_state_dir()
    try:
        report = share.import_bundle(bundle, ctx.state_dir, local, ledger_path=args.ledger, force=args.force)
    except share.FingerprintMismatch as exc:
        theirs = (bundle.get("fingerprint") or {}).get("device") if isinstance(bundle, dict) else None
        hint = ""
        if theirs == "cpu" and local.get("device") != "cpu":
            hint = " -- the bundle holds Triton-interpreter (CPU) results: import them with --device cpu"
        raise UsageError(f"{args.bundle}: {exc}{hint}") from None
    except share.BadBundle as exc:
        raise UsageError(f"{args.bundle}: {exc}") from None
    except TableError as exc:
        raise UsageError(f"this host's {exc}; nothing was merged into it") from None
    except LedgerError as exc:
        raise UsageError(f"{exc}; nothing was imported") from None
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    print(f"{'forced: ' if report['forced'] else ''}{report['rows_added']} ledger rows added "
          f"({report['rows_present']} already present); dispatch entries: {report['entries_added']} added, "
          f"{report['entries_replaced']} replaced by faster ones, {report['entries_kept']} kept, "
          f"{report['entries_refused']} refused" + (f" -> {report['table']}" if report["table"] else ""),
          file=sys.stderr)
    for line in report["refused"]:
        print(f"refused: {line}", file=sys.stderr)
    return 0

