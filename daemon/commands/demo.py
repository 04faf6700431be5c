"""`hwtune demo`: the new user's main job — status -> plan -> apply -> tune -> bench -> report -> restore.

Each step is the real `hwtune` command run as a child process, printed before it runs, so the
demo shows exactly what a node owner would type. On a host without a GPU (or with --simulated)
every hardware step runs on a simulated H200 host created in the work directory and every
figure is labelled simulated; kernels are checked under the Triton interpreter. The host is
restored at the end (rollback), and the demo checks that `status` is back to what it was.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path


def add_demo_arguments(p) -> None:
    p.add_argument("--out", type=Path, default=Path("hwtune-demo"),
                   help="work directory for the simulated host, state and report (default ./hwtune-demo)")
    p.add_argument("--simulated", action="store_true",
                   help="use a simulated host even when a GPU is present")
    p.add_argument("--gpus", type=int, default=2, help="GPUs of the simulated host (default 2)")
    p.add_argument("--profile", default="throughput", help="profile to plan/apply (default throughput)")
    p.add_argument("--keep", action="store_true",
                   help="keep the tuned settings at the end instead of rolling back")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def _gpu_present() -> bool:
    try:
        from hwtune.backends.nvml import NvmlGpus

        return NvmlGpus().count() > 0
    except Exception:
        return False


class _Runner:
    """Runs `hwtune` steps as child processes, echoing the command, collecting results."""

    def __init__(self, global_args: list[str], env: dict[str, str], log_dir: Path):
        self.global_args, self.env, self.log_dir = global_args, env, log_dir
        self.steps: list[dict] = []

    def run(self, name: str, args: list[str], parse_json: bool = False, ok_codes=(0,)) -> dict:
        argv = [sys.executable, "-m", "daemon.cli", *self.global_args, *args]
        shown = "hwtune " + " ".join(shlex.quote(a) for a in [*self.global_args, *args])
        print(f"\n$ {shown}", file=sys.stderr, flush=True)
        started = time.monotonic()
        proc = _run_child(argv, self.env, Path(__file__).resolve().parents[2])
        elapsed = time.monotonic() - started
        (self.log_dir / f"{len(self.steps):02d}-{name}.log").write_text(
            f"$ {shown}\nexit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
        if not parse_json:
            sys.stderr.write(proc.stdout)
        tail = proc.stderr.strip().splitlines()[-12:]
        if tail:
            sys.stderr.write("\n".join(tail) + "\n")
        step = {"name": name, "command": shown, "exit": proc.returncode, "seconds": round(elapsed, 1),
                "ok": proc.returncode in ok_codes}
        if parse_json:
            try:
                step["result"] = json.loads(proc.stdout)
            except ValueError:
                step["ok"] = False
                step["result"] = None
        print(f"  -> exit {proc.returncode} in {elapsed:.1f} s", file=sys.stderr, flush=True)
        self.steps.append(step)
        return step


def _run_child(argv: list, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    """Run one step. On Ctrl-C the step is not killed mid-write: it gets SIGINT (it holds it
    while it writes, then undoes or finishes), and the demo waits for it before going on."""
    with subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        try:
            out, err = proc.communicate()
        except KeyboardInterrupt:
            try:
                try:  # a terminal's Ctrl-C reached the step too: let it answer that one
                    proc.communicate(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.send_signal(signal.SIGINT)  # only the demo was signalled (kill -INT)
                    proc.communicate(timeout=120)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                proc.kill()
                proc.communicate()
            raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _restore_after_interrupt(r: "_Runner") -> int:
    """Ctrl-C: put the host back (the real `hwtune rollback`, printed) and exit 130."""
    shown = "hwtune " + " ".join(shlex.quote(a) for a in [*r.global_args, "rollback"])
    print(f"\nhwtune demo: interrupted; restoring the host: {shown}", file=sys.stderr, flush=True)
    for _ in range(3):
        try:
            proc = _run_child([sys.executable, "-m", "daemon.cli", *r.global_args, "rollback"], r.env,
                              Path(__file__).resolve().parents[2])
            break
        except KeyboardInterrupt:
            continue  # the rollback holds its own signals; ask again until it has run
    else:
        proc = None
    if proc is not None and proc.returncode == 0:
        print("hwtune demo: host restored", file=sys.stderr, flush=True)
    else:
        print(f"hwtune demo: the host may still be tuned; restore it with: {shown}", file=sys.stderr, flush=True)
    return 130


def run_demo(args, ctx) -> int:
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    simulated = args.simulated or ctx.sim_path is not None or not _gpu_present()
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    global_args: list[str] = []
    if simulated:
        sim = ctx.sim_path or out / "host.json"
        env["TRITON_INTERPRET"] = "1"  # kernels are checked under the interpreter on the CPU
        global_args += ["--sim", str(sim), "--state-dir", str(out / "state")]
        label = "SIMULATED host (no GPU here): every hardware figure below comes from the simulated H200"
    else:
        global_args += ["--state-dir", str(ctx.state_dir)]
        label = "real GPU host" + (" (read-only)" if ctx.read_only else "")
    if ctx.read_only:
        global_args.append("--read-only")
    print(f"hwtune demo: {label}", file=sys.stderr, flush=True)
    r = _Runner(global_args, env, logs)
    device = "cpu" if simulated or not _cuda_available() else "cuda"

    if simulated and not (ctx.sim_path or (out / "host.json").exists()):
        r.run("sim-init", ["sim", "init", str(out / "host.json"), "--gpus", str(args.gpus)])
    try:
        return _demo_steps(args, ctx, r, out, label, simulated, device)
    except KeyboardInterrupt:
        if ctx.read_only:
            return 130
        return _restore_after_interrupt(r)


def _demo_steps(args, ctx, r, out, label, simulated, device) -> int:
    before = r.run("status-before", ["status", "--json"], parse_json=True)
    r.run("plan", ["plan", "-p", args.profile])
    if not ctx.read_only:
        r.run("apply", ["apply", "-p", args.profile])
        r.run("verify", ["verify", "-p", args.profile])
        # `tune` starts from the host as found, so put it back first.
        r.run("rollback-profile", ["rollback"])
    tune_args = ["tune", "--objective", "energy", "--budget", "12", "--exhaustive",
                 "--kernels", "rmsnorm", "--kernel-budget", "2", "--json"]
    if ctx.read_only:
        print("  (read-only: tune would write settings; skipped)", file=sys.stderr)
    else:
        r.run("tune", tune_args, parse_json=True)
    bench_args = ["bench", "--json", "--out", str(out / "bench")]
    if device == "cpu":
        bench_args += ["--preset", "tiny"]
    r.run("bench", bench_args, parse_json=True)
    if not args.keep and not ctx.read_only:
        r.run("rollback", ["rollback"])
    after = r.run("status-after", ["status", "--json"], parse_json=True)
    restored = _same_settings(before.get("result"), after.get("result"))

    summary = {"label": label, "simulated": simulated, "device": device,
               "restored": restored if not args.keep else None, "steps": r.steps}
    report = out / "report.md"
    report.write_text(_report(summary))
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    if args.json:
        print(json.dumps(summary, indent=1, default=str))
    else:
        print(_report(summary))
        print(f"report: {report}")
    failed = [s["name"] for s in r.steps if not s["ok"]]
    if failed or (restored is False and not args.keep):
        print(f"hwtune demo: failed steps: {', '.join(failed) or 'none'}; host restored: {restored}",
              file=sys.stderr)
        return 1
    return 0


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _settings(status: dict | None) -> dict | None:
    """The writable settings of a status document (telemetry moves on its own; settings must not)."""
    if not status:
        return None
    keep = {}
    for gpu in status.get("gpus", []):
        keep[gpu.get("target")] = {k: gpu.get(k) for k in
                                   ("persistence_mode", "power_limit_w", "sm_clock_mhz", "memory_clock_mhz")}
    for fn in status.get("pcie", []):
        keep[fn.get("target")] = {k: fn.get(k) for k in ("relaxed_ordering", "max_read_request_bytes")}
    cpu = status.get("cpu") or {}
    keep["cpu"] = {k: cpu.get(k) for k in ("governor", "max_cstate_latency_us")}
    return keep


def _same_settings(before: dict | None, after: dict | None):
    a, b = _settings(before), _settings(after)
    if a is None or b is None:
        return None
    return a == b


def _find(steps, name):
    return next((s for s in steps if s["name"] == name), None)


def _report(summary: dict) -> str:
    lines = ["# hwtune demo report", "", f"**{summary['label']}**", "",
             "| step | command | exit | seconds |", "|---|---|---|---|"]
    for s in summary["steps"]:
        lines.append(f"| {s['name']} | `{s['command']}` | {s['exit']} | {s['seconds']} |")
    tune = _find(summary["steps"], "tune")
    if tune and isinstance(tune.get("result"), dict):
        res = tune["result"]
        lines += ["", "## Tuning (outer hardware loop" + (", simulated)" if summary["simulated"] else ")"), ""]
        lines.append(f"- objective: {res.get('objective')} (throughput floor {res.get('floor')}), "
                     f"workload: {res.get('workload')}, source: {res.get('source')}")
        for key, value in (res.get("summary") or {}).items():
            lines.append(f"- {key}: {_fmt(value)}")
        for k in res.get("kernels") or []:
            lines.append(f"- inner kernel search {k.get('kernel')} on {k.get('device')}: "
                         f"{'ok' if k.get('ok') else 'failed'} in {k.get('seconds')} s")
    bench = _find(summary["steps"], "bench")
    if bench and isinstance(bench.get("result"), dict):
        rows = bench["result"].get("decode") or []
        lines += ["", f"## End-to-end benchmark ({bench['result'].get('label', '')})", "",
                  "| variant | batch | ctx | step ms | tokens/s | status |", "|---|---|---|---|---|---|"]
        for row in rows if isinstance(rows, list) else []:
            if not isinstance(row, dict):
                continue
            lines.append("| {} | {} | {} | {} | {} | {} |".format(
                row.get("variant"), row.get("batch"), row.get("ctx"),
                _fmt(row.get("step_ms")), _fmt(row.get("tokens_per_s")), row.get("status", "")))
    if summary.get("restored") is not None:
        lines += ["", f"Host settings restored to the starting point: **{summary['restored']}**"]
    return "\n".join(lines) + "\n"


def _fmt(v):
    return f"{v:.3f}" if isinstance(v, float) else ("-" if v is None else str(v))
