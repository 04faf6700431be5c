"""The child process: imports one candidate and runs it on request. Never compares anything.

Protocol: one JSON object per line on a dedicated pipe each way (fds given in argv; stdout is
redirected to stderr so a candidate's prints cannot forge a reply). Tensors travel as raw bytes
in files (tensor_io). Requests: load, check, time, exit. Every reply has "ok"; a failed request
carries "guard" and "reason".

Inputs are drawn here from the seed the parent sends for this trial only (the parent draws the
same inputs independently for the reference and checks our digest of them), so a candidate
never sees an input before the call that uses it.
"""
from __future__ import annotations

import json
import os
import sys
import traceback


def _reply(out, msg: dict) -> None:
    out.write(json.dumps(msg) + "\n")
    out.flush()


def _exc_text(exc: BaseException) -> str:
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return (f"{type(exc).__name__}: {exc}".strip()[:400] + "\n" + "".join(tb[-3:])[-1200:]).strip()


class Child:
    def __init__(self, device: str):
        import torch

        self.torch = torch
        self.device = device
        if device.startswith("cuda"):
            torch.cuda.init()
            dev = torch.device(device)
            # torch >= 2.11 refuses set_device("cuda") without an index.
            torch.cuda.set_device(dev.index if dev.index is not None else 0)
        else:
            torch.set_num_threads(1)
        from kernelsearch.harness import sandbox, tensor_io, timing
        from kernelsearch.specs import SPECS, dtype_from_name

        self.sandbox, self.tensor_io, self.timing = sandbox, tensor_io, timing
        self.SPECS, self.dtype_from_name = SPECS, dtype_from_name
        self.counter = sandbox.LaunchCounter()
        self.counter.install()
        sandbox.warm_up(device)
        self.state0 = None
        self.launch = None
        self.spec = None

    # --- helpers ----------------------------------------------------------------------
    def _sync(self):
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize()

    def _inputs(self, request, seed):
        dtype = self.dtype_from_name(request["dtype"])
        g = self.torch.Generator(device=self.device).manual_seed(int(seed))
        return self.spec.make_inputs(request["shape"], dtype, self.device, g, request["dist"])

    def _tensors(self, request):
        outputs = self.spec.make_outputs(request["shape"], self.dtype_from_name(request["dtype"]),
                                         self.device)
        return self._inputs(request, request["seed"]), outputs

    def _poison(self, outputs):
        for t in outputs.values():
            t.fill_(float("nan"))

    def _input_digests(self, inputs):
        return {k: self.tensor_io.digest(v) for k, v in inputs.items()
                if isinstance(v, self.torch.Tensor)}

    def _state_changes(self):
        return self.sandbox.diff_state(self.state0, self.sandbox.snapshot_state()) + (
            [] if self.counter.intact() else ["triton JITFunction.run was replaced"])

    def _write(self, outputs, workdir, tag):
        return {k: self.tensor_io.write_tensor(v, os.path.join(workdir, f"{tag}-{k}.bin"))
                for k, v in outputs.items()}

    def _call(self, args, params):
        self.launch(*args, **params)

    # --- requests ---------------------------------------------------------------------
    def load(self, request):
        import importlib.util

        self.spec = self.SPECS[request["kernel"]]
        self.state0 = self.sandbox.snapshot_state()
        try:
            module_spec = importlib.util.spec_from_file_location("hwtune_candidate", request["source_path"])
            module = importlib.util.module_from_spec(module_spec)
            sys.modules["hwtune_candidate"] = module
            module_spec.loader.exec_module(module)
        except BaseException as exc:
            return {"ok": False, "guard": "exception", "reason": "import failed: " + _exc_text(exc)}
        changes = self._state_changes()
        if changes:
            return {"ok": False, "guard": "global_state", "reason": "at import: " + "; ".join(changes)}
        self.launch = getattr(module, "launch", None)
        if not callable(self.launch):
            return {"ok": False, "guard": "contract", "reason": "the file defines no launch() function"}
        configs = getattr(module, "CONFIGS", None)
        try:
            configs = json.loads(json.dumps(configs)) if configs is not None else None
        except (TypeError, ValueError):
            return {"ok": False, "guard": "contract", "reason": "CONFIGS is not a JSON list of dicts"}
        if configs is not None and not (isinstance(configs, list) and all(isinstance(c, dict) for c in configs)):
            return {"ok": False, "guard": "contract", "reason": "CONFIGS must be a list of dicts"}
        return {"ok": True, "configs": configs}

    def check(self, request):
        inputs, outputs = self._tensors(request)
        args = self.spec.call_args(inputs, outputs)
        params = request.get("params") or {}
        before = self._input_digests(inputs)
        self._poison(outputs)
        self._sync()
        self.counter.launches = 0
        self.counter.violations = []
        recorder = self.sandbox.OpRecorder()
        try:
            with recorder:
                self._call(args, params)
            self._sync()
        except BaseException as exc:
            return self._exception_reply(exc)
        reply = {"ok": True, "launches": self.counter.launches,
                 "forbidden_ops": sorted(set(recorder.forbidden + self.counter.violations)),
                 "input_digests_before": before, "input_digests_after": self._input_digests(inputs),
                 "state_changes": self._state_changes()}
        reply["outputs"] = self._write(outputs, request["workdir"], f"{request['tag']}-run1")
        if request.get("repeat"):
            first = {k: self.tensor_io.digest(v) for k, v in outputs.items()}
            self._poison(outputs)
            try:
                self._call(args, params)
                self._sync()
            except BaseException as exc:
                return self._exception_reply(exc)
            second = {k: self.tensor_io.digest(v) for k, v in outputs.items()}
            reply["repeat_identical"] = first == second
            if first != second:
                reply["repeat_outputs"] = self._write(outputs, request["workdir"], f"{request['tag']}-run2")
            reply["state_changes"] = self._state_changes()
        return reply

    def time(self, request):
        inputs, outputs = self._tensors(request)
        args = self.spec.call_args(inputs, outputs)
        params = request.get("params") or {}
        rep_seeds = [int(s) for s in request["rep_seeds"]]
        before = {}

        def refresh(i):
            # Fresh values in the same buffers (a captured graph keeps its pointers) before
            # every timed call: the inputs of warm-up and capture are never timed again.
            fresh = self._inputs(request, rep_seeds[i])
            for name, t in fresh.items():
                if isinstance(t, self.torch.Tensor):
                    inputs[name].copy_(t)
            if i == len(rep_seeds) - 1:
                before.update(self._input_digests(fresh))
        # CUDA graph capture/replay registers torch's CUDA generator with the graph: that is
        # the harness's doing. Its RNG state is judged on the check requests, restored here.
        rng = self.torch.cuda.get_rng_state_all() if self.device.startswith("cuda") else None
        try:
            timing = self.timing.time_calls(lambda: self._call(args, params), self.device,
                                            poison=lambda: self._poison(outputs),
                                            reps=len(rep_seeds), refresh=refresh)
            self._sync()
        except self.timing.CaptureError as exc:
            return {"ok": False, "guard": "cuda_graph", "reason": f"not capturable in a CUDA graph: {exc}"}
        except BaseException as exc:
            return self._exception_reply(exc)
        changes = [c for c in self._state_changes() if not c.startswith("torch.cuda RNG state")]
        if rng is not None:
            self.torch.cuda.set_rng_state_all(rng)
        return {"ok": True, "times_ms": timing.times_ms, "method": timing.method,
                "launches_per_replay": timing.launches_per_replay,
                "input_digests_before": before, "input_digests_after": self._input_digests(inputs),
                "state_changes": changes,
                "outputs": self._write(outputs, request["workdir"], f"{request['tag']}-timed")}

    def _exception_reply(self, exc):
        guard = "exception"
        if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
            guard = "out_of_memory"
        return {"ok": False, "guard": guard, "reason": _exc_text(exc)}


def main(argv: list[str]) -> int:
    fd_in, fd_out, device = int(argv[0]), int(argv[1]), argv[2]
    requests = os.fdopen(fd_in, "r")
    replies = os.fdopen(fd_out, "w")
    os.dup2(2, 1)  # the candidate's prints go to stderr, never into the protocol
    sys.stdout = sys.stderr
    try:
        child = Child(device)
    except BaseException as exc:
        _reply(replies, {"ok": False, "guard": "harness", "reason": "child setup: " + _exc_text(exc)})
        return 1
    handlers = {"load": child.load, "check": child.check, "time": child.time}
    for line in requests:
        request = json.loads(line)
        op = request.get("op")
        if op == "exit":
            break
        try:
            reply = handlers[op](request)
        except BaseException as exc:  # harness-side failure inside a request: still data
            reply = {"ok": False, "guard": "exception", "reason": _exc_text(exc)}
        _reply(replies, reply)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
