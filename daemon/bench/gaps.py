"""Where a decode step's time goes: kernels per step and per layer, busy vs idle, and the
gap to the bandwidth floor split into idle time and kernels running below their own floor.

Three parts:
- `profile(fn, steps)` (CUDA only): `fn` is one decode step, already warm. It is captured in a
  CUDA graph; the graph is replayed under torch.profiler (ProfilerActivity.CUDA: CUPTI reports
  the kernels inside graph replays) with a synchronize and a short sleep between replays, and
  the kernel events come back split per step. The step time is timed separately, without the
  profiler: CUDA events around back-to-back replays, median.
- `breakdown(events_per_step, step_ms, layers, ...)`: a pure function over those events.
  Medians over steps, never one step; a step with no events is dropped, a step with an extra or
  a missing kernel moves no median much.
- `python3 -m daemon.bench.gaps --from-json EVENTS.json`: the markdown table from a saved
  profile (what `profile` returns, written as JSON), a torch.profiler chrome trace
  (`traceEvents`), or a bare list of steps. `profile_and_breakdown(...)` does all three in one
  call for a GPU script.

Terms (all per step, medians over the profiled steps):
- busy: time some kernel runs (union of the kernels' intervals; = their summed durations on one
  stream). idle = step time - busy: nothing runs on the GPU.
- idle between kernels: inside the first-start..last-end span of the step. A graph removes the
  CPU launch cost, not the per-kernel ramp and tail nor the dependency wait between kernels.
  edge = step time - span: the graph launch and what the trace does not see. (The span is
  measured under the profiler, the step time without it: a negative edge means the profiler
  stretched the step.)
- floor: step time at the copy bandwidth for the bytes the step must move (caller's figure:
  floor_ms and step_ms must describe the same work, both with the LM head or both without).
  gap = step - floor = idle + (kernels below their own floor) + unattributed, where a kernel
  name's own floor is its bytes per step (`bytes_by_kernel`, e.g. from ncu below) over
  `copy_gbs`, and unattributed is what is left: kernels with no bytes given, and the bytes the
  named kernels move beyond (or short of) the floor's bytes (split-K partials, re-reads).

ncu (per-kernel DRAM bytes of one decode step, to fill `bytes_by_kernel`). What the options do
is from ncu's `--help` text (Nsight Compute CLI) as quoted in public files; the docs search
found NVIDIA's CLI manual but no passage of it to quote, and ncu was not run here:
- `--graph-profiling node` (the default): profile individual kernel nodes of a CUDA graph
  (`graph` profiles entire graphs as one result).
- `--metrics a,b,...`: the metrics to collect, comma separated.
- `--clock-control none`: the default, `base`, locks the GPU clocks to base while profiling;
  the lent H200's clocks are not to be touched. `--cache-control none`: the help only says it
  controls the GPU caches during profiling (default `all`; that `all` flushes them between
  kernels is the usual reading, not quoted); `none` keeps a decode step's activations in L2.
- `--profile-from-start off`: profile only between cudaProfilerStart/Stop (what
  `replay_for_ncu` calls around its replays).
- `--csv` (implies `--print-units base`: bytes, nanoseconds) and `--page raw` (every collected
  metric), `--log-file FILE` for the output.
- `--kernel-name-base demangled` (default `function`): the names ncu prints. torch.profiler
  names C++ kernels (cuBLAS, aten) by their demangled signature, Triton kernels by their
  function name; bytes are matched to the trace by exact name, and the names that match no
  traced kernel are listed (`floor.bytes_unmatched`), their bytes left out of the split.
The command (run from the worktree, after a warm-up inside the script):

    ncu --graph-profiling node --profile-from-start off --cache-control none \
        --clock-control none --kernel-name-base demangled \
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
        --csv --page raw --log-file ncu.csv python3 YOUR_SCRIPT.py  # calls replay_for_ncu(step, 2)

then `python3 -m daemon.bench.gaps --from-json EVENTS.json --ncu-csv ncu.csv --ncu-steps 2
--copy-gbs 4223`. Check the metric names on the device first (`ncu --query-metrics`, with
`--chips` from `ncu --list-chips`; all three are in the help): `dram__bytes_read.sum` /
`dram__bytes_write.sum` are the names in common use, not confirmed here from NVIDIA's docs.
ncu replays each kernel alone (serialised), so its `gpu__time_duration` is not the time inside
a graph; only its bytes are used. `bytes_from_ncu_csv` was written against the column names
the help text implies ("Kernel Name" plus one column per metric) and has not been run on a
real ncu file.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

FORMAT = "hwtune-gaps-events/1"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")   # chrome-trace categories of GPU work
GRAPH_LAUNCH_NAMES = ("cudaGraphLaunch", "cuGraphLaunch")


class GapsError(ValueError):
    """Bad input to the gap tools, with what was wrong."""


# ---- events ------------------------------------------------------------------------------------
def _event(e: dict) -> dict:
    try:
        return {"name": str(e["name"]), "start_us": float(e["start_us"]), "dur_us": float(e["dur_us"])}
    except (KeyError, TypeError, ValueError) as exc:
        raise GapsError(f"kernel event {e!r}: needs name, start_us, dur_us ({exc})") from None


def _split_by_gap(kernels: list[dict], min_gap_us: float | None) -> list[list[dict]]:
    if not kernels:
        return []
    gaps = [max(0.0, b["start_us"] - (a["start_us"] + a["dur_us"])) for a, b in zip(kernels, kernels[1:])]
    if min_gap_us is None:
        positive = [g for g in gaps if g > 0]
        # Inside a graph the gaps are ~1-10 us; profile() sleeps milliseconds between replays.
        min_gap_us = max(50.0, 20 * statistics.median(positive)) if positive else float("inf")
    steps, cur = [], [kernels[0]]
    for gap, k in zip(gaps, kernels[1:]):
        if gap > min_gap_us:
            steps.append(cur)
            cur = []
        cur.append(k)
    steps.append(cur)
    return steps


def steps_from_trace(trace_events: list[dict], kernels_per_step: int | None = None,
                     min_gap_us: float | None = None) -> list[list[dict]]:
    """Kernel events per step from chrome-trace events (torch.profiler's export_chrome_trace).

    Steps are told apart by, in order: `kernels_per_step` when given (sequential chunks, an
    incomplete tail dropped); the graph launch each kernel's correlation id points to, when
    there are at least two launches and every kernel points to one; else the gaps between
    kernels (a gap above `min_gap_us`, by default 20x the median gap and at least 50 us, starts
    a step)."""
    kernels = sorted((e for e in trace_events if e.get("ph", "X") == "X" and e.get("cat") in GPU_CATS
                      and "ts" in e and "dur" in e), key=lambda e: float(e["ts"]))
    slim = [{"name": str(e.get("name", "?")), "start_us": float(e["ts"]), "dur_us": float(e["dur"])}
            for e in kernels]
    if kernels_per_step:
        n = int(kernels_per_step)
        return [slim[i:i + n] for i in range(0, len(slim) - n + 1, n)]
    launches = {}
    for e in trace_events:
        name = str(e.get("name", ""))
        corr = (e.get("args") or {}).get("correlation")
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and corr is not None \
                and name.startswith(GRAPH_LAUNCH_NAMES):
            launches[corr] = float(e.get("ts", 0.0))
    if launches:
        groups: dict = {}
        for e, s in zip(kernels, slim):
            groups.setdefault((e.get("args") or {}).get("correlation"), []).append(s)
        # Only when every kernel points to a graph launch (else a kernel would be lost).
        if len(groups) >= 2 and all(c in launches for c in groups):
            return [groups[c] for c in sorted(groups, key=lambda c: launches[c])]
    return _split_by_gap(slim, min_gap_us)


def load_events(doc, kernels_per_step: int | None = None) -> tuple[list[list[dict]], dict]:
    """(events per step, the document's other keys) from what --from-json reads: a profile()
    document ({"steps": [[event, ...], ...], ...}), a chrome trace ({"traceEvents": [...]}), a
    list of steps, or one flat list of events (split by kernels_per_step or by gaps)."""
    meta: dict = {}
    if isinstance(doc, dict) and "steps" in doc:
        meta = {k: v for k, v in doc.items() if k != "steps"}
        raw = doc["steps"]
    elif isinstance(doc, dict) and "traceEvents" in doc:
        return steps_from_trace(doc["traceEvents"], kernels_per_step), meta
    elif isinstance(doc, list):
        raw = doc
    else:
        raise GapsError("events JSON: expected {'steps': [...]}, {'traceEvents': [...]} or a list")
    if raw and all(isinstance(s, dict) for s in raw):  # one flat list of events
        flat = sorted((_event(e) for e in raw), key=lambda e: e["start_us"])
        if kernels_per_step:
            n = int(kernels_per_step)
            return [flat[i:i + n] for i in range(0, len(flat) - n + 1, n)], meta
        return _split_by_gap(flat, None), meta
    if not all(isinstance(s, list) for s in raw):
        raise GapsError("events JSON: 'steps' must be a list of lists of events")
    return [[_event(e) for e in s] for s in raw], meta


# ---- the breakdown (pure) ------------------------------------------------------------------------
def _union_us(events: list[dict]) -> float:
    total, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e["start_us"]):
        s, f = e["start_us"], e["start_us"] + e["dur_us"]
        if f <= end:
            continue
        total += f - max(s, end)
        end = f
    return total


def _step_stats(events: list[dict]) -> dict:
    ev = sorted(events, key=lambda e: e["start_us"])
    t0 = ev[0]["start_us"]
    t1 = max(e["start_us"] + e["dur_us"] for e in ev)
    gaps, end = [], ev[0]["start_us"] + ev[0]["dur_us"]
    for e in ev[1:]:
        gaps.append(max(0.0, e["start_us"] - end))
        end = max(end, e["start_us"] + e["dur_us"])
    busy = _union_us(ev)
    return {"kernels": len(ev), "span_us": t1 - t0, "busy_us": busy,
            "kernel_sum_us": sum(e["dur_us"] for e in ev), "idle_between_us": (t1 - t0) - busy,
            "gap_median_us": statistics.median(gaps) if gaps else 0.0,
            "gap_max_us": max(gaps) if gaps else 0.0}


def _head_count(head_kernels, counts: dict) -> int:
    if head_kernels is None:
        return 0
    if isinstance(head_kernels, int):
        return head_kernels
    if isinstance(head_kernels, str):
        head_kernels = [head_kernels]
    return sum(counts.get(name, 0) for name in head_kernels)


def breakdown(events_per_step, step_ms: float | None, layers: int, floor_ms: float | None = None,
              head_kernels=None, bytes_by_kernel: dict | None = None,
              copy_gbs: float | None = None) -> dict:
    """Kernels per step and per layer, busy vs idle, per-kernel-name table and (floor_ms given)
    the gap to the floor split into idle, kernels below their own bandwidth floor, unattributed.

    events_per_step: list of steps, each a list of {name, start_us, dur_us}. step_ms: the step
    time measured outside the trace (None: the median traced span is used, edge unknown).
    layers: decoder layers in the step. head_kernels: kernels outside the layers (final norm, LM
    head, ...) as a count per step or as kernel names. bytes_by_kernel: {kernel name: bytes that
    name moves in one step, all its launches}, with copy_gbs (GB/s, read + write bytes) its floor.
    All times are medians over the non-empty steps."""
    if layers is None or int(layers) < 1:
        raise GapsError(f"layers={layers!r}: need at least 1")
    steps = [list(map(_event, s)) for s in events_per_step]
    used = [s for s in steps if s]
    if not used:
        raise GapsError("no kernel events in any step")
    if bytes_by_kernel and not copy_gbs:
        raise GapsError("bytes_by_kernel needs copy_gbs (the measured copy bandwidth, GB/s)")
    stats = [_step_stats(s) for s in used]
    med = {k: statistics.median(st[k] for st in stats) for k in stats[0]}
    kernels_per_step = int(statistics.median_low(st["kernels"] for st in stats))
    irregular = [i for i, s in enumerate(steps) if s and len(s) != kernels_per_step]
    step_given = step_ms is not None
    step_us = float(step_ms) * 1e3 if step_given else med["span_us"]
    busy_us = med["busy_us"]

    names: list[str] = []
    for s in used:
        for e in s:
            if e["name"] not in names:
                names.append(e["name"])
    per_name = []
    counts_per_step = {}
    for name in names:
        durs = [e["dur_us"] for s in used for e in s if e["name"] == name]
        counts = [sum(1 for e in s if e["name"] == name) for s in used]
        totals = [sum(e["dur_us"] for e in s if e["name"] == name) for s in used]
        count = int(statistics.median_low(counts))
        counts_per_step[name] = count
        row = {"name": name, "per_step": count, "median_us": statistics.median(durs),
               "us_per_step": statistics.median(totals),
               "share_of_step": statistics.median(totals) / step_us if step_us > 0 else None}
        if bytes_by_kernel and name in bytes_by_kernel:
            floor_k = float(bytes_by_kernel[name]) / (float(copy_gbs) * 1e3)
            row.update({"bytes_per_step": float(bytes_by_kernel[name]), "own_floor_us": floor_k,
                        "pct_of_own_floor": floor_k / row["us_per_step"] if row["us_per_step"] > 0 else None,
                        "above_own_floor_us": row["us_per_step"] - floor_k})
        per_name.append(row)
    per_name.sort(key=lambda r: -r["us_per_step"])

    head = _head_count(head_kernels, counts_per_step)
    in_layers = kernels_per_step - head
    out = {
        "steps_given": len(steps), "steps_used": len(used),
        "steps_dropped": len(steps) - len(used), "irregular_steps": irregular,
        "kernels_per_step": kernels_per_step, "kernels_outside_layers": head, "layers": int(layers),
        "kernels_per_layer": in_layers / int(layers),
        "step_ms": step_us / 1e3, "step_ms_source": "given" if step_given else "median traced span",
        "span_ms": med["span_us"] / 1e3, "busy_ms": busy_us / 1e3,
        "kernel_sum_ms": med["kernel_sum_us"] / 1e3,
        "idle_ms": (step_us - busy_us) / 1e3,
        "idle_between_ms": med["idle_between_us"] / 1e3,
        "edge_ms": (step_us - med["span_us"]) / 1e3 if step_given else None,
        "gap_median_us": med["gap_median_us"], "gap_max_us": med["gap_max_us"],
        "busy_share": busy_us / step_us if step_us > 0 else None,
        "kernels": per_name,
    }
    if floor_ms is not None:
        floor_us = float(floor_ms) * 1e3
        gap_us = step_us - floor_us
        idle_us = step_us - busy_us
        split = {"floor_ms": floor_us / 1e3, "pct_of_floor": floor_us / step_us if step_us > 0 else None,
                 "gap_ms": gap_us / 1e3, "idle_ms": idle_us / 1e3}
        if bytes_by_kernel:
            named = [r for r in per_name if "own_floor_us" in r]
            below = sum(r["above_own_floor_us"] for r in named)
            split.update({"below_own_floor_ms": below / 1e3,
                          "unattributed_ms": (gap_us - idle_us - below) / 1e3,
                          "named_floor_ms": sum(r["own_floor_us"] for r in named) / 1e3,
                          "named_kernels": len(named),
                          "unnamed_kernel_ms": sum(r["us_per_step"] for r in per_name
                                                   if "own_floor_us" not in r) / 1e3,
                          "bytes_unmatched": sorted(set(bytes_by_kernel) - set(names))})
        else:
            split.update({"kernels_above_floor_ms": (gap_us - idle_us) / 1e3})
        out["floor"] = split
    return out


# ---- markdown --------------------------------------------------------------------------------------
def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown(b: dict, top: int | None = None) -> str:
    """The breakdown as BENCHMARKS.md lines: a summary and the per-kernel-name table."""
    lines = []
    src = "" if b["step_ms_source"] == "given" else " (not given: the median traced span)"
    lines.append(f"- step {b['step_ms']:.3f} ms{src}; medians over {b['steps_used']} profiled steps"
                 + (f" ({b['steps_dropped']} empty dropped)" if b["steps_dropped"] else "")
                 + (f"; steps {b['irregular_steps']} had another kernel count" if b["irregular_steps"] else ""))
    lines.append(f"- kernels per step {b['kernels_per_step']}: {b['kernels_per_layer']:.2f} per layer "
                 f"x {b['layers']} layers + {b['kernels_outside_layers']} outside the layers")
    edge = "" if b["edge_ms"] is None else f", launch edge {b['edge_ms']:.3f} ms (step - traced span)"
    lines.append(f"- busy {b['busy_ms']:.3f} ms ({_pct(b['busy_share'])} of the step), idle "
                 f"{b['idle_ms']:.3f} ms: between kernels {b['idle_between_ms']:.3f} ms (gap median "
                 f"{b['gap_median_us']:.2f} us, max {b['gap_max_us']:.2f} us){edge}")
    f = b.get("floor")
    if f:
        lines.append(f"- floor {f['floor_ms']:.3f} ms: step at {_pct(f['pct_of_floor'])} of the floor, "
                     f"gap {f['gap_ms']:.3f} ms")
        gap = f["gap_ms"]

        def part(x):
            return f"{x:.3f} ms ({_pct(x / gap) if gap else '-'})"

        if "below_own_floor_ms" in f:
            lines.append(f"- gap split: idle {part(f['idle_ms'])}; kernels below their own bandwidth "
                         f"floor {part(f['below_own_floor_ms'])} ({f['named_kernels']} kernel names with "
                         f"bytes, their floors sum to {f['named_floor_ms']:.3f} ms); unattributed "
                         f"{part(f['unattributed_ms'])} (kernels without bytes: "
                         f"{f['unnamed_kernel_ms']:.3f} ms of run time)")
            if f["bytes_unmatched"]:
                lines.append(f"- bytes given for {len(f['bytes_unmatched'])} kernel names not in the "
                             f"trace (left out): {', '.join(f['bytes_unmatched'][:5])}")
        else:
            lines.append(f"- gap split: idle {part(f['idle_ms'])}; kernels running longer than the "
                         f"floor {part(f['kernels_above_floor_ms'])} (no bytes per kernel given)")
    lines.append("")
    lines.append("| kernel | per step | median us | us per step | share of step | own floor us | % of own floor |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|")
    rows = b["kernels"] if top is None else b["kernels"][:top]
    for r in rows:
        name = r["name"] if len(r["name"]) <= 60 else r["name"][:57] + "..."
        name = name.replace("|", "\\|")
        own = f"{r['own_floor_us']:.1f}" if "own_floor_us" in r else "-"
        lines.append(f"| `{name}` | {r['per_step']} | {r['median_us']:.2f} | {r['us_per_step']:.1f} | "
                     f"{_pct(r['share_of_step'])} | {own} | {_pct(r.get('pct_of_own_floor'))} |")
    if top is not None and len(b["kernels"]) > top:
        lines.append(f"| ({len(b['kernels']) - top} more) | | | | | | |")
    return "\n".join(lines) + "\n"


# ---- ncu -------------------------------------------------------------------------------------------
def _number(text: str) -> float | None:
    try:
        return float(str(text).replace(",", "").strip())
    except ValueError:
        return None


def bytes_from_ncu_csv(text: str, steps: int = 1) -> dict:
    """{kernel name: DRAM bytes per step} from `ncu --csv --page raw` output covering `steps`
    replays of the step: dram__bytes.sum when collected, else dram__bytes_read.sum +
    dram__bytes_write.sum, summed per kernel name and divided by `steps`. Rows whose metric
    cell is not a number (the units row) are skipped; lines before the header (ncu's own
    "==PROF==" lines) are skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if '"Kernel Name"' in line or line.startswith("ID,")), None)
    if start is None:
        raise GapsError("ncu CSV: no header row with \"Kernel Name\"")
    reader = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    cols = reader.fieldnames or []
    if "dram__bytes.sum" in cols:
        metrics = ["dram__bytes.sum"]
    elif "dram__bytes_read.sum" in cols and "dram__bytes_write.sum" in cols:
        metrics = ["dram__bytes_read.sum", "dram__bytes_write.sum"]
    else:
        raise GapsError(f"ncu CSV: no dram__bytes columns among {cols}")
    if int(steps) < 1:
        raise GapsError(f"ncu steps={steps}: need at least 1")
    out: dict = {}
    for row in reader:
        vals = [_number(row.get(m, "")) for m in metrics]
        if any(v is None for v in vals):
            continue
        name = row.get("Kernel Name", "?")
        out[name] = out.get(name, 0.0) + sum(vals)
    return {k: v / int(steps) for k, v in out.items()}


# ---- CUDA: capture, replay, profile ------------------------------------------------------------------
def _require_cuda(device) -> "object":
    import torch
    dev = torch.device(device if device is not None else "cuda")
    if dev.type != "cuda":
        raise GapsError(f"profile needs a CUDA device, got {str(dev)!r}: torch.profiler sees no CUDA "
                        "kernels there (use breakdown() on events recorded on a GPU, or "
                        "python3 -m daemon.bench.gaps --from-json)")
    if not torch.cuda.is_available():
        raise GapsError("profile needs a CUDA device: torch.cuda.is_available() is False on this host")
    return torch


def _capture(torch, fn, warmup: int):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # torch requires the warm-up on a side stream
        for _ in range(max(1, warmup)):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    for _ in range(max(1, warmup)):
        graph.replay()
    torch.cuda.synchronize()
    return graph


def _step_times_ms(torch, graph, reps: int) -> list[float]:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):  # back to back, as the decode loop runs them
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def profile(fn, steps: int = 10, *, device=None, warmup: int = 3, timed_steps: int = 30,
            pause_s: float = 0.002) -> dict:
    """Capture `fn` (one decode step, already warm) in a CUDA graph, time `timed_steps` replays
    with CUDA events (median = step_ms), then replay `steps` + 1 times under torch.profiler with
    a synchronize and `pause_s` of sleep between replays (the first, where the profiler may
    still be starting, is dropped), and return the kernels per step:
    {"format", "device", "steps": [[{name, start_us, dur_us}, ...], ...], "step_ms",
    "step_ms_all", "how"} -- the JSON that `--from-json` reads. Refuses a non-CUDA device."""
    torch = _require_cuda(device)
    from torch.profiler import ProfilerActivity, profile as torch_profile
    if int(steps) < 1:
        raise GapsError(f"steps={steps}: need at least 1")
    graph = _capture(torch, fn, warmup)
    times = _step_times_ms(torch, graph, max(3, int(timed_steps)))
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(int(steps) + 1):  # the first replay under the profiler is dropped
            graph.replay()
            torch.cuda.synchronize()
            time.sleep(pause_s)  # a gap no kernel gap inside a graph comes near: splits steps
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    per_step = steps_from_trace(trace.get("traceEvents", []), min_gap_us=pause_s * 1e6 / 2)[1:]
    if not any(per_step):
        raise GapsError("torch.profiler recorded no kernels in the graph replays (CUPTI did not "
                        "trace graph kernel nodes here): use ncu or nsys on this host instead")
    return {"format": FORMAT, "device": torch.cuda.get_device_name(), "steps": per_step,
            "step_ms": statistics.median(times), "step_ms_all": times,
            "how": (f"CUDA graph of one step; step_ms = median of {len(times)} back-to-back replays "
                    f"timed by CUDA events, without the profiler; kernels from torch.profiler "
                    f"(CUPTI) over {steps} replays (one more before them dropped) separated by synchronize + "
                    f"{pause_s * 1e3:.1f} ms")}


def replay_for_ncu(fn, steps: int = 2, *, device=None, warmup: int = 3) -> None:
    """Capture `fn` in a CUDA graph, warm it, then replay it `steps` times between
    cudaProfilerStart and cudaProfilerStop, for `ncu --profile-from-start off` (module
    docstring)."""
    torch = _require_cuda(device)
    graph = _capture(torch, fn, warmup)
    torch.cuda.profiler.start()
    for _ in range(int(steps)):
        graph.replay()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def profile_and_breakdown(fn, steps: int, layers: int, floor_ms: float | None = None,
                          bytes_by_kernel: dict | None = None, *, copy_gbs: float | None = None,
                          head_kernels=None, device=None) -> tuple[dict, str]:
    """profile(fn, steps), then breakdown(...) at its step time. Returns (result, markdown):
    result is the breakdown with "raw" = the profile document (save it as JSON for
    --from-json)."""
    if bytes_by_kernel and not copy_gbs:  # before spending device time
        raise GapsError("bytes_by_kernel needs copy_gbs (the measured copy bandwidth, GB/s)")
    if layers is None or int(layers) < 1:
        raise GapsError(f"layers={layers!r}: need at least 1")
    raw = profile(fn, steps, device=device)
    result = breakdown(raw["steps"], raw["step_ms"], layers, floor_ms=floor_ms,
                       head_kernels=head_kernels, bytes_by_kernel=bytes_by_kernel, copy_gbs=copy_gbs)
    result["raw"] = {**raw, "layers": layers, "floor_ms": floor_ms, "copy_gbs": copy_gbs,
                     "bytes_by_kernel": bytes_by_kernel, "head_kernels": head_kernels}
    return result, markdown(result)


# ---- CLI -------------------------------------------------------------------------------------------
def _head_arg(text):
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return [s for s in text.split(",") if s]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m daemon.bench.gaps",
                                description="Kernels per step and the gap to the floor, from recorded kernel events.")
    p.add_argument("--from-json", required=True, metavar="EVENTS.json",
                   help="profile() output, a torch.profiler chrome trace, or a list of steps")
    p.add_argument("--layers", type=int, help="decoder layers in the step (else the file's 'layers')")
    p.add_argument("--step-ms", type=float, help="measured step time (else the file's 'step_ms')")
    p.add_argument("--floor-ms", type=float, help="bandwidth floor of the same step (else the file's)")
    p.add_argument("--copy-gbs", type=float, help="measured copy bandwidth, GB/s (read + write bytes)")
    p.add_argument("--bytes-json", metavar="FILE", help="{kernel name: bytes per step}")
    p.add_argument("--ncu-csv", metavar="FILE", help="ncu --csv --page raw output (module docstring)")
    p.add_argument("--ncu-steps", type=int, default=1, help="steps the ncu run replayed (default 1)")
    p.add_argument("--head-kernels", help="kernels outside the layers: a count or comma-separated names")
    p.add_argument("--kernels-per-step", type=int, help="split a flat trace into steps of this many kernels")
    p.add_argument("--top", type=int, help="table rows (default all)")
    p.add_argument("--json", action="store_true", help="print the breakdown as JSON")
    a = p.parse_args(argv)
    try:
        doc = json.loads(Path(a.from_json).read_text())
        steps, meta = load_events(doc, a.kernels_per_step)
        bytes_by_kernel = meta.get("bytes_by_kernel")
        if a.bytes_json:
            bytes_by_kernel = json.loads(Path(a.bytes_json).read_text())
        if a.ncu_csv:
            bytes_by_kernel = bytes_from_ncu_csv(Path(a.ncu_csv).read_text(), a.ncu_steps)
        layers = a.layers if a.layers is not None else meta.get("layers")
        if layers is None:
            raise GapsError("--layers not given and the file has no 'layers'")
        head = _head_arg(a.head_kernels) if a.head_kernels is not None else meta.get("head_kernels")
        b = breakdown(steps, a.step_ms if a.step_ms is not None else meta.get("step_ms"), layers,
                      floor_ms=a.floor_ms if a.floor_ms is not None else meta.get("floor_ms"),
                      head_kernels=head, bytes_by_kernel=bytes_by_kernel,
                      copy_gbs=a.copy_gbs if a.copy_gbs is not None else meta.get("copy_gbs"))
    except (OSError, json.JSONDecodeError, GapsError) as exc:
        print(f"gaps: {a.from_json}: {exc}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(b, indent=1))
    else:
        sys.stdout.write(markdown(b, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
