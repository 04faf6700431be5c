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
import threading
import time
from pathlib import Path


def add_demo_arguments(p) -> None:
    from daemon.context import path_arg
    from hwtune.backends.sim import DEFAULT_GPUS

    p.add_argument("--out", type=path_arg, default=Path("hwtune-demo"),
                   help="work directory for the simulated host, state and report (default ./hwtune-demo)")
    p.add_argument("--simulated", action="store_true",
                   help="use a simulated host even when a GPU is present")
    p.add_argument("--gpus", type=int, default=None,
                   help=f"GPUs of the simulated host (default {DEFAULT_GPUS}, as `hwtune sim init`; a host "
                        "file an earlier demo left in --out keeps its own)")
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
    """Runs `hwtune` steps as child processes: echoes the command, streams the step's output
    as it comes (a JSON document on stdout is kept, not echoed), writes one log per step."""

    def __init__(self, global_args: list[str], env: dict[str, str], log_dir: Path):
        self.global_args, self.env, self.log_dir = global_args, env, log_dir
        self.env["PYTHONUNBUFFERED"] = "1"  # the steps' own prints arrive as they are made
        self.steps: list[dict] = []

    def run(self, name: str, args: list[str], parse_json: bool = False, ok_codes=(0,)) -> dict:
        argv = [sys.executable, "-m", "daemon.cli", *self.global_args, *args]
        shown = "hwtune " + " ".join(shlex.quote(a) for a in [*self.global_args, *args])
        print(f"\n$ {shown}", file=sys.stderr, flush=True)
        log_path = self.log_dir / f"{len(self.steps):02d}-{name}.log"
        started = time.monotonic()
        stdout: list[str] = []
        with open(log_path, "w") as log:
            log.write(f"$ {shown}\n")
            proc = subprocess.Popen(argv, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, bufsize=1, cwd=Path(__file__).resolve().parents[2])
            lock = threading.Lock()

            def pump(stream, keep: list | None, echo: bool) -> None:
                for line in stream:
                    if keep is not None:
                        keep.append(line)
                    with lock:
                        if echo:
                            sys.stderr.write("  " + line)
                            sys.stderr.flush()
                        if keep is None or not parse_json:
                            log.write(line)
                            log.flush()

            pumps = [threading.Thread(target=pump, args=(proc.stdout, stdout, not parse_json), daemon=True),
                     threading.Thread(target=pump, args=(proc.stderr, None, True), daemon=True)]
            for t in pumps:
                t.start()
            rc = _wait_step(proc)
            for t in pumps:
                t.join()
            elapsed = time.monotonic() - started
            if parse_json:
                log.write(f"(stdout: the JSON document, in {log_path.with_suffix('.json').name})\n")
                log_path.with_suffix(".json").write_text("".join(stdout))
            log.write(f"exit {rc} in {elapsed:.1f} s\n")
        step = {"name": name, "command": shown, "exit": rc, "seconds": round(elapsed, 1),
                "ok": rc in ok_codes, "log": str(log_path)}
        if parse_json:
            try:
                step["result"] = json.loads("".join(stdout))
            except ValueError:
                step["ok"] = False
                step["result"] = None
        print(f"  -> exit {rc} in {elapsed:.1f} s", file=sys.stderr, flush=True)
        self.steps.append(step)
        return step


def _settle(proc: subprocess.Popen, wait):
    """`wait()` for a step (proc.wait or proc.communicate). On Ctrl-C the step is not killed
    mid-write: it gets SIGINT (it holds it while it writes, then undoes or finishes), and the
    demo waits for it before re-raising."""
    try:
        return wait()
    except KeyboardInterrupt:
        try:
            try:  # a terminal's Ctrl-C reached the step too: let it answer that one
                wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGINT)  # only the demo was signalled (kill -INT)
                wait(timeout=120)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            proc.kill()
            wait()
        raise


def _wait_step(proc: subprocess.Popen) -> int:
    """Wait for a streamed step (its output is pumped by threads)."""
    return _settle(proc, proc.wait)


def _run_child(argv: list, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    """Run one step, its output collected."""
    with subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        out, err = _settle(proc, proc.communicate)
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
    from daemon.context import ensure_writable_dir
    from hwtune.backends.sim import DEFAULT_GPUS, MAX_GPUS
    from hwtune.errors import UsageError

    if args.gpus is not None and not 1 <= args.gpus <= MAX_GPUS:   # sim init would refuse it, then each step after
        raise UsageError(f"--gpus {args.gpus}: 1 to {MAX_GPUS}")
    out = args.out.resolve()
    earlier = Path(ctx.sim_path) if ctx.sim_path else out / "host.json"
    if args.gpus is not None and earlier.is_file():
        # the demo reuses that host (sim init is skipped): --gpus would be ignored unsaid
        try:
            has = len(json.loads(earlier.read_text()).get("gpus", []))
        except (OSError, ValueError, AttributeError, TypeError):
            has = None   # a broken file: the first step says what is wrong with it
        if has is not None and has != args.gpus:
            how = ("leave out --gpus, or give --sim another host file" if ctx.sim_path
                   else f"remove it, or choose another --out, for {args.gpus}")
            raise UsageError(f"--gpus {args.gpus}: the simulated host {earlier} has {has} GPU(s) and the demo "
                             f"uses it as it is; {how}")
    gpus = args.gpus if args.gpus is not None else DEFAULT_GPUS
    from hwtune import profiles

    profiles.load(args.profile, ctx.profile_dir)   # not found: one line now, not after the tune and bench
    # the steps run from the checkout (so that a daemon/ or hwtune/ where the user is shadows
    # nothing): a relative path given to the demo is made absolute for them
    if ("/" in args.profile or Path(args.profile).suffix in (".yaml", ".yml")) and Path(args.profile).exists():
        args.profile = str(Path(args.profile).resolve())   # a path, as hwtune.profiles reads it
    ensure_writable_dir(out, "--out", "choose another with --out DIR")
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    for old in logs.glob("[0-9][0-9]-*.*"):  # a rerun's logs are this run's only
        old.unlink()
    simulated = args.simulated or ctx.sim_path is not None or not _gpu_present()
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    global_args: list[str] = []
    device = "cpu" if simulated or not _cuda_available() else "cuda"
    if simulated:
        sim = ctx.sim_path or out / "host.json"
        env["TRITON_INTERPRET"] = "1"  # kernels are checked under the interpreter on the CPU
        global_args += ["--sim", str(Path(sim).resolve()), "--state-dir", str(out / "state")]
        label = ("SIMULATED host (no GPU here): the hardware steps ran on a simulated H200 node and "
                 "their figures come from its calibrated model, not from a GPU")
        if device == "cpu":
            label += ("; the benchmark ran for real on this CPU (a tiny model; its kernel search ran "
                      "Triton candidates under the interpreter): it checks the pipeline, it does not "
                      "measure speed")
    else:
        global_args += ["--state-dir", str(Path(ctx.state_dir).resolve())]
        label = "real GPU host" + (" (read-only)" if ctx.read_only else "")
    from daemon.context import DEFAULT_PROFILE_DIR

    if Path(ctx.profile_dir) != DEFAULT_PROFILE_DIR:
        global_args += ["--profile-dir", str(Path(ctx.profile_dir).resolve())]
    if ctx.read_only:
        global_args.append("--read-only")
    print(f"hwtune demo: {label}", file=sys.stderr, flush=True)
    r = _Runner(global_args, env, logs)
    started = time.monotonic()

    if simulated and not (ctx.sim_path or (out / "host.json").exists()):
        r.run("sim-init", ["sim", "init", str(out / "host.json"), "--gpus", str(gpus)])
    try:
        return _demo_steps(args, ctx, r, out, label, simulated, device, started)
    except KeyboardInterrupt:
        if ctx.read_only:
            return 130
        return _restore_after_interrupt(r)


def _demo_steps(args, ctx, r, out, label, simulated, device, started) -> int:
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
        # one evaluation per kernel: on the interpreter the search cannot beat torch anyway
        bench_args += ["--device", "cpu", "--preset", "tiny", "--search-evals", "1"]
    r.run("bench", bench_args, parse_json=True)
    if not args.keep and not ctx.read_only:
        r.run("rollback", ["rollback"])
    after = r.run("status-after", ["status", "--json"], parse_json=True)
    restored = _same_settings(before.get("result"), after.get("result"))

    summary = {"label": label, "simulated": simulated, "device": device, "out": str(out),
               "restored": restored if not args.keep else None, "kept": args.keep,
               "seconds": round(time.monotonic() - started, 1), "steps": r.steps}
    summary["headline"] = headline(summary)
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


def headline(summary: dict) -> str | None:
    """One sentence: what the tuning gained and what it cost, from the tune step's numbers."""
    tune = _find(summary["steps"], "tune")
    res = tune.get("result") if tune else None
    if not isinstance(res, dict) or not isinstance(res.get("search"), dict):
        return None
    sm = res.get("summary") or {}
    search = res["search"]
    size = (res.get("space") or {}).get("size")
    stock = (search.get("reference") or {}).get("metrics") or {}
    best = search.get("best") or {}
    metrics = best.get("metrics") or {}
    who = "Simulated tuning" if res.get("source") == "simulated" else "Tuning"
    n = sm.get("evaluations")
    of = f"{n} of {size} points" if size else f"{n} points"
    if not metrics or sm.get("tokens_per_j_vs_stock") is None or best.get("label") == (search.get("reference") or {}).get("label"):
        return f"{who} found no point better than stock in {of}; stock settings kept."
    power = ""
    if stock.get("power_w") and metrics.get("power_w"):
        power = f", drawing {metrics['power_w']:.0f} W instead of {stock['power_w']:.0f} W per GPU"
    text = (f"{who} gained {sm['tokens_per_j_vs_stock']:.2f}\u00d7 tokens per joule at "
            f"{sm['tokens_per_s_vs_stock']:.1%} of stock throughput{power}, found in {of} "
            f"({best.get('label')})")
    if sm.get("found_vs_exhaustive"):
        more = 1 / sm["found_vs_exhaustive"]
        text += (f"; an exhaustive sweep of all {sm.get('exhaustive_evaluations')} points "
                 + ("finds nothing better" if more < 1.0005 else f"finds a point {more:.3f}\u00d7 better"))
    return text + "."


def _rel(path, base: Path) -> str:
    """`path` relative to the report's folder when it lies inside it, else as it is."""
    try:
        return str(Path(path).resolve().relative_to(base))
    except ValueError:
        return str(path)


def _link(path, base: Path) -> str:
    rel = _rel(path, base)
    return f"[{rel}]({rel})"


def _report(summary: dict) -> str:
    out = Path(summary.get("out") or ".")
    lines = ["# hwtune demo report", "", f"**{summary['label']}**", ""]
    if summary.get("headline"):
        lines += [f"**{summary['headline']}**", ""]
    lines += [f"The demo took {summary.get('seconds', 0):.0f} s.", "",
              "| step | command | exit | seconds | log |", "|---|---|---|---|---|"]
    for s in summary["steps"]:
        log = _link(s["log"], out) if s.get("log") else ""
        lines.append(f"| {s['name']} | `{s['command']}` | {s['exit']} | {s['seconds']} | {log} |")
    from daemon.bench.report import interpreted

    tune = _find(summary["steps"], "tune")
    if tune and isinstance(tune.get("result"), dict):
        res = tune["result"]
        lines += ["", "## Tuning (outer hardware loop" + (", simulated)" if summary["simulated"] else ")"), ""]
        lines.append(f"- objective: {res.get('objective')} (throughput floor {res.get('floor')}), "
                     f"workload: {res.get('workload')}, source: {res.get('source')}")
        for key, value in (res.get("summary") or {}).items():
            lines.append(f"- {key}: {_fmt(value)}")
        if res.get("tuned_profile"):
            end = ("kept while the benchmark ran, then rolled back" if not summary.get("kept")
                   else "kept (journaled: `hwtune rollback` undoes it)")
            lines.append(f"- kept profile (YAML; {end}): {_link(res['tuned_profile'], out)}")
        else:
            lines.append("- no point beat the starting settings: nothing kept")
        for k in res.get("kernels") or []:
            lines.append(f"- inner kernel search {k.get('kernel')} on {k.get('device')}: "
                         f"{'ok' if k.get('ok') else 'failed'} in {k.get('seconds')} s"
                         + (" (Triton interpreter: times check the loop, they are not speeds)"
                            if k.get("device") == "cpu" else ""))
    bench = _find(summary["steps"], "bench")
    if bench and isinstance(bench.get("result"), dict):
        doc = bench["result"]
        cpu = doc.get("label") == "cpu" or summary.get("device") == "cpu"
        rows = doc.get("decode") or []
        lines += ["", f"## End-to-end benchmark ({'real, on this CPU' if cpu else doc.get('label', '')})", ""]
        if cpu:
            lines += ["On a CPU the model is tiny. Before the `tuned` variant, the benchmark ran the kernel "
                      "search on the model's own decode shapes; its Triton candidates ran under the "
                      "interpreter (each kernel program by program in Python), which never beats torch, so "
                      "the search kept stock and the tuned step runs the stock kernels wherever the table "
                      "has no entry: a check of search -> dispatch table -> tuned step, not a speed. A row "
                      "that did run Triton kernels is marked an interpreter timing (slower than eager is "
                      "expected there, not a regression). Speeds need a GPU (see BENCHMARKS.md).", ""]
        what = "what the figure is" if cpu else "status"
        lines += [f"| variant | batch | ctx | step ms | tokens/s | {what} |", "|---|---|---|---|---|---|"]
        for row in rows if isinstance(rows, list) else []:
            if not isinstance(row, dict):
                continue
            note = row.get("status", "")
            if cpu and note == "ok":
                note = ("Triton interpreter timing, not a speed" if interpreted(doc, row)
                        else "CPU timing of the tiny model (pipeline check)")
            lines.append("| {} | {} | {} | {} | {} | {} |".format(
                row.get("variant"), row.get("batch"), row.get("ctx"),
                _fmt(row.get("step_ms")), _fmt(row.get("tokens_per_s")), note))
        bench_dir = out / "bench"
        lines += ["", f"Full benchmark report: {_link(bench_dir / 'report.md', out)}; chart: "
                      f"{_link(bench_dir / 'report.png', out)}", "",
                  f"![tokens/s per variant]({_rel(bench_dir / 'report.png', out)})"]
    lines += ["", "## Files", ""]
    lines.append("- logs, one per step (command, live output, exit code): [logs/](logs/)")
    lines.append(f"- this run as JSON: {_link(out / 'summary.json', out)}")
    if summary.get("restored") is not None:
        lines += ["", f"Host settings restored to the starting point: **{summary['restored']}**"]
    return "\n".join(lines) + "\n"


def _fmt(v):
    return f"{v:.3f}" if isinstance(v, float) else ("-" if v is None else str(v))
