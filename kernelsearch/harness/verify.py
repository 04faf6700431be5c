"""evaluate(): one candidate through every guard and the timed runs -> Verdict.

Order per shape (the whole sweep, guard 6): two correctness trials on fresh inputs from
different distributions (guard 2), the first repeated on the same inputs (guard 10); then the
timed runs, on fresh inputs for every timed call, whose final outputs are checked too (guard 8;
on CUDA they come from CUDA graph replays, guard 9). Each trial: child draws inputs from a
one-time seed, poisons outputs (4), calls launch() under the op recorder and the launch counter
(7), reports input digests (5) and global-state changes (11), and writes the outputs to files;
the parent draws the same inputs, computes the fp64 reference and compares (3). The first
failure rejects.
"""
from __future__ import annotations

import math
import secrets
import shutil
from pathlib import Path

import torch

from kernelsearch.harness import compare, static_check, tensor_io, timing
from kernelsearch.harness.runner import ChildFailure, ChildProcess
from kernelsearch.harness.verdict import ShapeResult, Verdict
from kernelsearch.specs import SPECS, dtype_from_name

DEFAULT_TIMEOUT_S = {"cpu": 120.0, "cuda": 120.0}
STARTUP_TIMEOUT_S = 300.0   # importing torch + triton (+ CUDA init) on a loaded host
DETERMINISM_BAND = 0.05     # run-to-run difference allowed, as a fraction of the tolerance
STOCK_REPS_CPU = 5


class Rejected(Exception):
    def __init__(self, guard: str, reason: str):
        super().__init__(f"{guard}: {reason}")
        self.guard, self.reason = guard, reason


def _device_kind(device: str) -> str:
    return "cuda" if str(device).startswith("cuda") else "cpu"


def _seed() -> int:
    return secrets.randbits(62)


def _draw(spec, shape, dtype, device, seed, dist):
    g = torch.Generator(device=device).manual_seed(seed)
    return spec.make_inputs(shape, dtype, device, g, dist)


def _judge_common(reply: dict, inputs: dict, where: str) -> None:
    if not reply.get("ok"):
        raise Rejected(reply.get("guard", "exception"), f"{where}: {reply.get('reason', '')}")
    expected = {k: tensor_io.digest(v) for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    if reply["input_digests_before"] != expected:
        raise Rejected("fresh_inputs", f"{where}: the inputs the candidate saw differ from the "
                                       "harness's draw (input generation was tampered with)")
    changed = [k for k, v in reply["input_digests_after"].items() if v != reply["input_digests_before"][k]]
    if changed:
        raise Rejected("input_mutated", f"{where}: input(s) {', '.join(changed)} modified by the call")
    if reply.get("state_changes"):
        raise Rejected("global_state", f"{where}: " + "; ".join(reply["state_changes"]))


def _judge_outputs(spec, headers: dict, reference: dict, tol: float, device, where: str,
                   guard_override: str | None = None) -> float:
    worst = 0.0
    for name in spec.out_names:
        out = tensor_io.read_tensor(headers[name], device)
        err, problem = compare.compare(name, out, reference[name], tol)
        if problem:
            guard = guard_override or problem.guard
            raise Rejected(guard, f"{where}: {problem.reason}")
        worst = max(worst, err)
    return worst


def _stock_timing(spec, shape, dtype, device, inputs) -> tuple[float, float]:
    outputs = spec.make_outputs(shape, dtype, device)
    fn = lambda: spec.stock(inputs, outputs)  # noqa: E731
    reps = None if _device_kind(device) == "cuda" else STOCK_REPS_CPU
    first = timing.time_calls(fn, device, reps=reps).median_ms
    second = timing.time_calls(fn, device, reps=reps).median_ms
    return (first + second) / 2, timing.noise_band(first, second)


def evaluate(kernel: str, source_path, params: dict | None = None, device: str = "cpu",
             shapes: list[dict] | None = None, dtype: str | None = None,
             timeout_s: float | None = None, time_it: bool = True) -> Verdict:
    """Run one candidate file through every guard (and the timed runs). Never raises for a bad
    candidate: the result is a Verdict. `params=None` uses the file's CONFIGS[0] (or {}).
    `timeout_s` bounds each request to the child (one trial / one timing), not the whole sweep.
    """
    source_path = str(Path(source_path).resolve())
    verdict = Verdict(accepted=False, kernel=kernel, source_path=source_path, device=str(device),
                      params=dict(params or {}))
    spec = SPECS.get(kernel)
    if spec is None:
        verdict.guard, verdict.reason = "contract", f"unknown kernel {kernel!r} (known: {', '.join(SPECS)})"
        return verdict
    try:
        text = Path(source_path).read_text()
    except OSError as exc:
        verdict.guard, verdict.reason = "contract", f"cannot read {source_path}: {exc.strerror}"
        return verdict
    problems = static_check.check_source(text, source_path)
    if problems:
        verdict.guard, verdict.reason = "static", "; ".join(problems[:5])
        return verdict
    kind = _device_kind(device)
    if kind == "cuda" and not torch.cuda.is_available():
        verdict.guard, verdict.reason = "contract", "--device cuda but torch sees no CUDA device"
        return verdict
    shapes = list(shapes) if shapes is not None else spec.shapes(kind)
    timeout_s = float(timeout_s or DEFAULT_TIMEOUT_S[kind])
    workdir = tensor_io.private_dir()
    child = ChildProcess(str(device), workdir)
    try:
        _evaluate(child, spec, verdict, params, str(device), shapes, dtype, timeout_s, time_it, workdir)
        verdict.accepted = True
    except Rejected as exc:
        verdict.guard, verdict.reason = exc.guard, exc.reason
    except ChildFailure as exc:
        verdict.guard, verdict.reason = exc.guard, exc.reason
    finally:
        child.close()
        shutil.rmtree(workdir, ignore_errors=True)
    for result in verdict.shapes:
        if result.status == "pending":
            result.status = "rejected" if not verdict.accepted else "ok"
    return verdict


def _evaluate(child, spec, verdict, params, device, shapes, dtype, timeout_s, time_it, workdir):
    reply = child.request({"op": "load", "kernel": spec.name, "source_path": verdict.source_path},
                          max(timeout_s, STARTUP_TIMEOUT_S))
    if not reply.get("ok"):
        raise Rejected(reply.get("guard", "exception"), reply.get("reason", ""))
    if params is None:
        configs = reply.get("configs") or []
        params = dict(configs[0]) if configs else {}
    verdict.params = params
    kind = _device_kind(device)
    for i, shape in enumerate(shapes):
        dt = dtype_from_name(dtype or shape.get("dtype") or spec.primary_dtype(kind))
        shape_dims = {k: v for k, v in shape.items() if k != "dtype"}
        result = ShapeResult(shape=dict(shape), dtype=str(dt).removeprefix("torch."),
                             flops=spec.flops(shape_dims), bytes=spec.bytes(shape_dims, dt))
        verdict.shapes.append(result)
        tol = spec.tolerance(dt)
        dists = spec.distributions_for(dt)
        label = f"{spec.describe(shape_dims)} {result.dtype}"
        for trial, dist in enumerate((dists[i % len(dists)], dists[(i + 1) % len(dists)])):
            seed = _seed()
            where = f"shape {label} trial {trial + 1} ({dist} inputs)"
            reply = child.request({"op": "check", "shape": shape_dims, "dtype": result.dtype,
                                   "seed": seed, "dist": dist, "params": params,
                                   "repeat": trial == 0, "workdir": workdir, "tag": f"s{i}t{trial}"},
                                  timeout_s)
            inputs = _draw(spec, shape_dims, dt, device, seed, dist)
            _judge_common(reply, inputs, where)
            if reply["launches"] == 0:
                raise Rejected("not_triton", f"{where}: launch() ran no @triton.jit kernel")
            if reply["forbidden_ops"]:
                raise Rejected("torch_compute", f"{where}: launch() dispatched torch compute op(s) "
                                                f"{', '.join(reply['forbidden_ops'][:8])} outside Triton kernels")
            reference = spec.reference(inputs)
            err = _judge_outputs(spec, reply["outputs"], reference, tol, device, where)
            result.error_rel_l2 = max(result.error_rel_l2 or 0.0, err)
            if trial == 0 and not reply.get("repeat_identical", True):
                band = DETERMINISM_BAND * tol
                for name in spec.out_names:
                    a = tensor_io.read_tensor(reply["outputs"][name], device)
                    b = tensor_io.read_tensor(reply["repeat_outputs"][name], device)
                    diff = compare.run_to_run_difference(a, b)
                    if diff > band:
                        raise Rejected("nondeterministic", f"{where}: {name} differs between two runs on the "
                                                           f"same inputs by {diff:.3g} (band {band:.3g})")
            del inputs, reference
        if time_it:
            # warm-up/capture inputs, then a fresh draw before every timed call; the last
            # call's inputs are the ones its outputs are checked against
            seed, dist = _seed(), dists[i % len(dists)]
            rep_seeds = [_seed() for _ in range(timing.default_reps(device))]
            where = f"shape {label} timed runs"
            reply = child.request({"op": "time", "shape": shape_dims, "dtype": result.dtype,
                                   "seed": seed, "rep_seeds": rep_seeds, "dist": dist,
                                   "params": params, "workdir": workdir, "tag": f"s{i}"}, timeout_s)
            inputs = _draw(spec, shape_dims, dt, device, rep_seeds[-1], dist)
            _judge_common(reply, inputs, where)
            reference = spec.reference(inputs)
            # On CUDA the timed outputs come from graph replays: work outside the captured
            # stream (a private stream) leaves them unwritten.
            override = "cuda_graph" if kind == "cuda" else "timed_path"
            _judge_outputs(spec, reply["outputs"], reference, tol, device, where, override)
            del reference
            result.candidate_ms = timing.percentile(reply["times_ms"], 50)
            result.candidate_p20_ms = timing.percentile(reply["times_ms"], 20)
            result.candidate_p80_ms = timing.percentile(reply["times_ms"], 80)
            result.timing = reply["method"]
            result.launches_per_replay = reply["launches_per_replay"]
            result.stock_ms, result.noise_band = _stock_timing(spec, shape_dims, dt, device, inputs)
            if math.isfinite(result.candidate_ms) and result.candidate_ms > 0:
                result.speedup = result.stock_ms / result.candidate_ms
            del inputs
        result.status = "ok"
