"""The `hwtune` command: one entry point, one module per command family.

Each command module under daemon/commands/ exposes, per command it owns,
`add_<name>_arguments(parser)` and `run_<name>(args, ctx) -> int`.
Modules are imported only for the command being run (and for --help), so the
hardware commands never import torch.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import json
import os
import re
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


# Modules of the optional extras (pyproject.toml) -> the extra that brings them: a command that
# needs one on an install without it says which to install instead of an import traceback.
EXTRAS = {"torch": "kernels", "triton": "kernels", "numpy": "kernels", "optuna": "kernels",
          "matplotlib": "kernels", "transformers": "hf", "ray": "ray"}


def _tell(line: str) -> None:
    """The last word on stderr; a terminal that is gone must not change the exit code."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


class _Watched:
    """stdout that remembers whether anything was written (--json: one document, even on error)."""

    def __init__(self, stream):
        self.stream = stream
        self.wrote = False

    def write(self, text):
        if text:
            self.wrote = True
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _json_error(out: "_Watched | None", message: str, rc: int) -> None:
    """--json promises one JSON document on stdout: a failure before the command printed its
    own is one too ({"ok": false, "error", "exit_code"}); the reason stays on stderr as well."""
    if out is None or out.wrote:
        return
    try:
        out.write(json.dumps({"ok": False, "error": message, "exit_code": rc}) + "\n")
    except (OSError, ValueError):
        pass


def _fn_name(prefix: str, command: str) -> str:
    return f"{prefix}_{command.replace('-', '_')}"


class _Help(argparse.HelpFormatter):
    """--help shows every default that is a value (not off, not unset) unless the help text
    already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (action.option_strings and action.nargs != 0 and "default" not in text
                and default is not None and default is not False and default is not argparse.SUPPRESS):
            # `is`, not `in (None, False, ...)`: 0 == False, and a seed's default 0 went unsaid
            text += f" (default {default})"
        return text


class _Parser(argparse.ArgumentParser):
    """Bad arguments are one line on stderr, exit 2 (argparse's usage block buries the reason).
    Subparsers inherit the class, and with it the help that shows defaults."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        bad = re.search(r"invalid choice: '?([^' ]+)'? \(choose from (.*)\)", message)
        if bad:   # a typo (hwtune stauts, --device gpu): name the choice meant
            choices = [c.strip(" '\"") for c in bad.group(2).split(",")]
            near = difflib.get_close_matches(bad.group(1), choices, n=1, cutoff=0.7)  # not gpu -> cpu
            if near:
                message += f"; did you mean {near[0]}?"
        _Parser.last_error = f"{self.prog}: {message}"
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")

    last_error: str | None = None


def _misplaced(argv: list[str], extra: list[str]) -> str | None:
    """A global option written after the command (`hwtune status --sim h.json`): say where it
    goes, with the command line put right."""
    from daemon.context import GLOBAL_OPTIONS

    moved: list[str] = []
    for n, arg in enumerate(extra):
        name = arg.split("=", 1)[0]
        if name in GLOBAL_OPTIONS:
            moved.append(arg)
            takes_value = GLOBAL_OPTIONS[name] and "=" not in arg
            if takes_value and n + 1 < len(extra) and not extra[n + 1].startswith("-"):
                moved.append(extra[n + 1])
    if not moved:
        return None
    rest = list(argv)
    for arg in moved:
        rest.reverse()
        rest.remove(arg)  # the last occurrence: the misplaced one, after the command
        rest.reverse()
    fixed = " ".join(["hwtune", *moved, *rest])
    return f"{moved[0]} is a global option: global options go before the command: {fixed}"


def _before_command(argv: list[str], parser) -> str | None:
    """An option of the command written before it (`hwtune -p throughput plan`): argparse took
    its value for the command ('invalid choice: throughput'); say where it goes instead."""
    from daemon.context import GLOBAL_OPTIONS

    n = 0
    while n < len(argv) and argv[n].startswith("-") and argv[n] != "--":
        name = argv[n].split("=", 1)[0]
        if name not in GLOBAL_OPTIONS:
            break
        n += 1 + (GLOBAL_OPTIONS[name] and "=" not in argv[n])
    if n >= len(argv) or not argv[n].startswith("-") or argv[n] in ("-h", "--help", "--version", "--"):
        return None
    commands = [i for i in range(n + 1, len(argv)) if argv[i] in parser.command_parsers]
    if not commands:
        return None
    command = argv[commands[0]]
    name = argv[n].split("=", 1)[0]
    own = {o: a for a in parser.command_parsers[command]._actions for o in a.option_strings}
    if name not in own:
        return None
    moved = argv[n:commands[0]]
    fixed = " ".join(["hwtune", *argv[:n], command, *moved, *argv[commands[0] + 1:]])
    return f"hwtune {command}: {name} is an option of {command}: it goes after the command: {fixed}"


def _set_by_environment(args, ctx, message: str, rc: int) -> str:
    """A refusal caused by an environment variable standing for a global option (an exported
    HWTUNE_READ_ONLY=1 or HWTUNE_SIM from an earlier session) names it: the command line the
    user typed does not show it."""
    from hwtune.errors import ReadOnlyError

    if rc == ReadOnlyError.exit_code and ctx.read_only and not getattr(args, "read_only", False):
        return f" (HWTUNE_READ_ONLY={os.environ.get('HWTUNE_READ_ONLY')} is set)"
    if ctx.sim_path is not None and getattr(args, "sim", None) is None and "simulated host" in message:
        return f" (HWTUNE_SIM={os.environ.get('HWTUNE_SIM')} is set)"
    return ""


def _action_options(p) -> set[str]:
    """The options of a command's actions (share import --force, sim init --gpus)."""
    return {o for a in p._actions if isinstance(a, argparse._SubParsersAction)
            for sub in a.choices.values() for b in sub._actions for o in b.option_strings}


def _quiet_broken_pipe() -> None:
    """The reader went away (`hwtune status | head -3`): drop what is left of our output
    instead of a BrokenPipeError at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):
            pass


def _lenient_output() -> None:
    """A terminal that is not UTF-8 (PYTHONIOENCODING=ascii, a latin-1 locale) gets a name it
    cannot show (a profile or host file called é.yaml) as a backslash escape, not a
    UnicodeEncodeError traceback in place of the result. --json output is ASCII already."""
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) == "strict":
            try:
                stream.reconfigure(errors="backslashreplace")
            except (AttributeError, ValueError, OSError):
                pass


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hwtune")
    except PackageNotFoundError:   # run from a checkout that was never pip-installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hwtune",
        description="Tune an owned GPU host: hardware knobs, Triton kernels, end-to-end proof.",
    )
    parser.add_argument("--version", action="version", version=f"hwtune {_version()}")
    Context.add_global_arguments(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.command_parsers = {}
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        parser.command_parsers[name] = p
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
    _lenient_output()
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["help"]:   # `hwtune help [COMMAND]`, as git, pip and docker take it
        argv = [*argv[1:2], "--help"]
    early = _before_command(argv, parser)
    if early:
        if "--json" in argv:
            _json_error(_Watched(sys.stdout), early, 2)
        parser.exit(2, f"{early} (see {early.split(':')[0]} --help)\n")
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as exc:
        # --json promises one JSON document on stdout, a usage error's too
        if exc.code == 2 and "--json" in argv and _Parser.last_error:
            _json_error(_Watched(sys.stdout), _Parser.last_error, 2)
        raise
    if extra:
        hint = _misplaced(argv, extra) if args.command else None
        if args.command and not hint:
            own = {o for a in parser.command_parsers[args.command]._actions for o in a.option_strings}
            early = [a for a in extra if a.split("=", 1)[0] in own]
            if early:
                hint = f"{early[0]} is an option of {args.command}: it goes after the command"
            else:   # a typo (--budgt): name the option meant
                for a in extra:
                    near = difflib.get_close_matches(a.split("=", 1)[0], sorted(own | _action_options(
                        parser.command_parsers[args.command])), n=1, cutoff=0.7) \
                        if a.startswith("--") else []
                    if near:
                        hint = f"unrecognized arguments: {' '.join(extra)} (did you mean {near[0]}?)"
                        break
        where = f"hwtune {args.command}" if args.command else "hwtune"
        message = f"{where}: {hint or 'unrecognized arguments: ' + ' '.join(extra)}"
        if "--json" in argv:
            _json_error(_Watched(sys.stdout), message, 2)
        parser.exit(2, f"{message} (see {where} --help)\n")
    if not args.command:
        parser.print_help()
        return 2
    if getattr(args, "_missing", None):
        print(f"hwtune {args.command}: not available in this build ({args._missing} missing)", file=sys.stderr)
        return 2
    ctx = Context.from_args(args)
    rc = 0
    out = None
    if getattr(args, "json", False) and not isinstance(sys.stdout, _Watched):
        out = sys.stdout = _Watched(sys.stdout)
    try:
        try:
            rc = int(args._run(args, ctx) or 0)
        except HwtuneError as exc:
            rc = exc.exit_code
            message = str(exc) + _set_by_environment(args, ctx, message=str(exc), rc=rc)
            _tell(f"hwtune {args.command}: {message}")
            _json_error(out, message, rc)
        except ModuleNotFoundError as exc:
            extra = EXTRAS.get((exc.name or "").split(".")[0])
            if extra is None:
                raise
            rc = 2
            message = f"needs {exc.name}, which is not installed: pip install 'hwtune[{extra}]'"
            _tell(f"hwtune {args.command}: {message}")
            _json_error(out, message, rc)
        except KeyboardInterrupt:
            rc = 130
            _tell(f"hwtune {args.command}: interrupted")
            _json_error(out, "interrupted", rc)
        sys.stdout.flush()  # here, where a closed pipe can still be caught
        return rc
    except BrokenPipeError:
        # The reader left (`hwtune status | head -3`): it has what it wanted; nothing to say.
        _quiet_broken_pipe()
        return rc
    finally:
        if out is not None and sys.stdout is out:
            sys.stdout = out.stream


if __name__ == "__main__":
    sys.exit(main())
