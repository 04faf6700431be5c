"""Global options shared by every command, and where state lives."""
from __future__ import annotations

import argparse
import os
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CONFIG = Path("/etc/hwtune/hwtune.yaml")
DEFAULT_PROFILE_DIR = Path("/etc/hwtune/profiles")
# The options that go before the command: name -> takes a value.
GLOBAL_OPTIONS = {"--config": True, "--state-dir": True, "--sim": True, "--sysfs-root": True,
                  "--profile-dir": True, "--read-only": False}


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def default_state_dir(sim_path: str | None) -> Path:
    # A simulated host keeps its journal beside its file, so tests and demos never touch
    # the real host's state.
    if sim_path:
        return Path(str(sim_path) + ".state")
    first = (os.environ.get("STATE_DIRECTORY") or "").split(":")[0].strip()
    if first:  # systemd StateDirectory= (an empty first path is unset, not the current directory)
        return Path(first)
    if os.geteuid() == 0:
        return Path("/var/lib/hwtune")
    return Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local/state")) / "hwtune"


def ensure_writable_dir(path: Path, what: str, advice: str, mode: int | None = None) -> None:
    """mkdir -p PATH and create (then remove) a file in it; UsageError naming PATH otherwise
    (under /proc, under a regular file, immutable, read-only mount, no permission). `mode`:
    PATH itself, when made here, gets exactly that mode whatever the umask."""
    from hwtune.errors import UsageError

    path = Path(path)
    try:
        if mode is not None and not path.exists():
            missing = [d for d in reversed(path.parents) if not d.exists()]
            for d in missing:   # parents made here: 0755, not the umask's choice
                os.mkdir(d, 0o755)
                os.chmod(d, 0o755)
            os.mkdir(path, mode)
            os.chmod(path, mode)
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".hwtune-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if isinstance(exc, FileExistsError) or (path.exists() and not path.is_dir()):
            reason = "exists and is not a directory"
        raise UsageError(f"{what} {path} cannot be created or written: {reason}; {advice}") from None


def path_arg(text: str) -> Path:
    """A path option's value; '' is refused: Path('') is the current directory, so an unset
    shell variable (--state-dir "$STATE") put the journal wherever the command ran."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (an unset shell variable?)")
    return Path(text)


@dataclass
class Context:
    config_path: Path | None
    state_dir: Path
    sim_path: Path | None
    sysfs_root: Path
    read_only: bool
    profile_dir: Path

    @staticmethod
    def add_global_arguments(parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("global options")
        g.add_argument("--config", type=path_arg, default=None,
                       help=f"service config file (default {DEFAULT_CONFIG} when present)")
        g.add_argument("--state-dir", type=path_arg, default=None,
                       help="journal, lock and results (default: HOST.json.state beside a --sim file; "
                            "else /var/lib/hwtune as root, ~/.local/state/hwtune otherwise)")
        g.add_argument("--sim", type=path_arg, default=None, metavar="HOST.json",
                       help="use the simulated host kept in this file instead of the real one "
                            "(create it with `hwtune sim init HOST.json`; also HWTUNE_SIM=HOST.json)")
        g.add_argument("--sysfs-root", type=path_arg, default=Path(os.environ.get("HWTUNE_SYSFS_ROOT") or "/"),
                       help="root under which /sys is read (for fixture trees; also HWTUNE_SYSFS_ROOT)")
        g.add_argument("--profile-dir", type=path_arg,
                       default=Path(os.environ.get("HWTUNE_PROFILE_DIR") or DEFAULT_PROFILE_DIR),
                       help="user profiles (also HWTUNE_PROFILE_DIR)")
        g.add_argument("--read-only", action="store_true",
                       help="refuse every write before it happens (also HWTUNE_READ_ONLY=1)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Context":
        sim = args.sim or (Path(os.environ["HWTUNE_SIM"]) if os.environ.get("HWTUNE_SIM") else None)
        config = args.config
        if config is None and DEFAULT_CONFIG.exists():
            config = DEFAULT_CONFIG
        return cls(
            config_path=config,
            state_dir=args.state_dir or default_state_dir(str(sim) if sim else None),
            sim_path=sim,
            sysfs_root=args.sysfs_root,
            read_only=args.read_only or _truthy(os.environ.get("HWTUNE_READ_ONLY")),
            profile_dir=args.profile_dir,
        )

    def command(self, *args: str) -> str:
        """The exact `hwtune` command line for this host and state directory, e.g. the
        rollback to print when a run is interrupted."""
        parts = ["hwtune"]
        if self.sim_path:
            parts += ["--sim", str(Path(self.sim_path).resolve())]
        elif str(self.sysfs_root) not in ("", "/"):
            parts += ["--sysfs-root", str(Path(self.sysfs_root).resolve())]
        parts += ["--state-dir", str(Path(self.state_dir).resolve()), *args]
        return shlex.join(parts)

    def ensure_state_dir(self) -> Path:
        """Create the state directory and prove it takes a file, or fail with one line (exit
        2) before anything is touched: a journal that cannot be written must stop an apply
        before its first write, not after."""
        ensure_writable_dir(self.state_dir, "state directory",
                            "choose another with --state-dir DIR, before the command", mode=0o700)
        return self.state_dir

    def check_can_write(self, command: str) -> None:
        """Before a command that writes the host runs, that this user can: a simulated host
        whose file (or its lock, or the directory its atomic rename writes into) this user
        cannot write, and the real host without root (NVML setters, /sys), are one line, exit
        2, nothing written. Found later, a point's write failed half-way into the journal
        (the sim) or every knob was skipped as NoPermission and apply said 'applied' (real).
        --read-only and a fixture --sysfs-root write nothing of the real host's."""
        from hwtune.errors import UsageError

        if self.read_only:
            return
        if self.sim_path:
            from hwtune.backends.sim import SimFile

            SimFile(Path(self.sim_path)).check_writable()
            return
        if str(self.sysfs_root) not in ("", "/") or os.geteuid() == 0:
            return
        raise UsageError("writing the real host's settings needs root: run it with sudo "
                         "(or try it without root on a simulated host: hwtune sim init host.json, "
                         f"then hwtune --sim host.json {command})")

    def check_state_dir(self) -> None:
        """For commands that only read state: a state directory that is, or lies under, a
        regular file is bad input (exit 2); one that does not exist yet simply holds nothing."""
        from hwtune.errors import UsageError

        for q in (self.state_dir, *self.state_dir.parents):
            try:
                found = q.exists()
            except OSError as exc:   # under a directory this user may not enter (--state-dir /root/x)
                raise UsageError(f"state directory {self.state_dir} cannot be read: {exc.strerror or exc}; "
                                 "choose another with --state-dir DIR, before the command") from None
            if found:
                if not q.is_dir():
                    why = ("exists and is not a directory" if q == self.state_dir
                           else f"Not a directory ({q} is a file)")
                    raise UsageError(f"state directory {self.state_dir} cannot be created or written: {why}; "
                                     "choose another with --state-dir DIR, before the command")
                return

    def open_host(self, bios=None):
        """The host the hardware loop works on: simulated (--sim) or real (NVML + sysfs)."""
        from hwtune.host import open_host

        return open_host(sim_path=self.sim_path, sysfs_root=self.sysfs_root,
                         read_only=self.read_only, bios=bios)
