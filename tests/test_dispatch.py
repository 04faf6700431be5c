"""Dispatch uses a tuned kernel only on its own device and shapes; everything else goes to stock.

The tuned path really runs a Triton kernel, under the interpreter in a child process: the
launch plan the harness made in its sandbox, never the file's Python.
"""
import json
import subprocess
import sys
import textwrap

import pytest

from kernelsearch.dispatch import DispatchTable, Entry, EntryError, TableError, file_sha256, shape_matches
from kernelsearch.fingerprint import collect, fingerprint_id

from conftest import ROOT

TUNED_RMSNORM = textwrap.dedent('''
    import triton
    import triton.language as tl

    @triton.jit
    def _rmsnorm(x_ptr, w_ptr, out_ptr, N, eps, BLOCK_N: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
        tl.store(out_ptr + row * N + cols, (x * inv * w).to(out_ptr.dtype.element_ty), mask=mask)

    def launch(x, weight, eps, out, BLOCK_N=128):
        _rmsnorm[(x.shape[0],)](x, weight, out, x.shape[1], eps, BLOCK_N=BLOCK_N)
''')

CHILD = textwrap.dedent('''
    import json, sys
    import torch
    from kernelsearch.dispatch import DispatchTable
    table = DispatchTable.load(sys.argv[1])
    report = {}
    for m, n in [(4, 100), (9, 100), (4, 128), (40, 100)]:
        x = torch.randn(m, n)
        w = torch.rand(n) + 0.5
        launch, params, why = table.route("rmsnorm", x, w, 1e-6)
        out = table.call("rmsnorm", x, w, 1e-6)
        ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        report[f"{m}x{n}"] = {"why": why, "params": params,
                              "err": float((out - ref).abs().max())}
    report["tuned_calls"] = table.counts.get(("rmsnorm", "tuned"), 0)
    report["launch_defined"] = any("launch" in vars(m) for name, m in sys.modules.items()
                                   if name.startswith("hwtune_kernels_"))
    print(json.dumps(report))
''')


@pytest.fixture
def cpu_fingerprint(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return collect("cpu")


def _table(tmp_path, fp, source_hash=None, plan_edit=None):
    from kernelsearch.harness.verify import make_plan

    src = tmp_path / "tuned_rmsnorm.py"
    src.write_text(TUNED_RMSNORM)
    entry = {"kernel": "rmsnorm", "dtype": "float32", "source": {"path": str(src)},
             "source_hash": source_hash or file_sha256(src), "candidate_ms": 0.01,
             "stock_ms": 0.02, "speedup": 2.0}
    plans = {}
    for m, block in ((4, 128), (9, 256)):
        plans[m] = make_plan("rmsnorm", src, {"M": m, "N": 100}, "float32", {"BLOCK_N": block}, "cpu")
        assert plans[m] and plans[m]["steps"][0]["kernel"] == "_rmsnorm"
    if plan_edit:
        plan_edit(plans[4])
    table = DispatchTable({"format": 1, "fingerprint_id": fingerprint_id(fp), "fingerprint": fp,
                           "entries": [dict(entry, shape={"M": 4, "N": 100}, params={"BLOCK_N": 128},
                                            plan=plans[4]),
                                       dict(entry, shape={"M": 9, "N": 100}, params={"BLOCK_N": 256},
                                            plan=plans[9])]})
    return table.save(tmp_path / "dispatch" / f"{fingerprint_id(fp)}.json")


def _run_child(table_path):
    proc = subprocess.run([sys.executable, "-c", CHILD, str(table_path)], cwd=ROOT, text=True,
                          capture_output=True, timeout=180,
                          env={"TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_tuned_kernel_runs_its_verified_plan_on_matching_shapes_and_stock_elsewhere(tmp_path, cpu_fingerprint):
    report = _run_child(_table(tmp_path, cpu_fingerprint))
    assert report["4x100"]["why"] == "tuned" and report["4x100"]["params"] == {"BLOCK_N": 128}
    assert report["9x100"]["why"] == "tuned" and report["9x100"]["params"] == {"BLOCK_N": 256}
    assert report["4x128"]["why"] == "no entry for shape"
    assert report["40x100"]["why"] == "no entry for shape"
    assert report["tuned_calls"] == 2
    assert report["launch_defined"] is False   # only the checked kernels were compiled
    assert all(r["err"] < 1e-4 for k, r in report.items() if isinstance(r, dict))


def test_a_tampered_plan_in_the_table_falls_back_to_stock(tmp_path, cpu_fingerprint):
    def tamper(plan):
        plan["steps"][0]["kernel"] = "print"
    report = _run_child(_table(tmp_path, cpu_fingerprint, plan_edit=tamper))
    assert report["4x100"]["why"].startswith("tuned source missing, changed or without a valid plan")
    assert report["9x100"]["why"] == "tuned"


def test_table_from_another_device_falls_back_to_stock(tmp_path, cpu_fingerprint):
    other = dict(cpu_fingerprint, cpu="some other CPU")
    report = _run_child(_table(tmp_path, other))
    assert {r["why"] for k, r in report.items() if isinstance(r, dict)} == {"fingerprint mismatch"}
    assert report["tuned_calls"] == 0


def test_changed_tuned_source_falls_back_to_stock(tmp_path, cpu_fingerprint):
    report = _run_child(_table(tmp_path, cpu_fingerprint, source_hash="0" * 16))
    assert report["4x100"]["why"].startswith("tuned source missing, changed")
    assert report["tuned_calls"] == 0


def test_exact_entry_wins_over_range_and_range_needs_other_dims_equal():
    ranged = {"shape": {"M": 16, "K": 4096, "N": 4096}, "range": {"M": [1, 16]}}
    as_entry = Entry.make(kernel="matmul", dtype="bfloat16", **ranged)
    assert shape_matches(as_entry, {"M": 3, "K": 4096, "N": 4096})
    assert not shape_matches(as_entry, {"M": 3, "K": 4096, "N": 1024})
    assert not shape_matches(as_entry, {"M": 17, "K": 4096, "N": 4096})
    table = DispatchTable({"format": 1, "entries": [
        dict(ranged, kernel="matmul", dtype="bfloat16", params={"SPLIT_K": 4}),
        {"kernel": "matmul", "dtype": "bfloat16", "shape": {"M": 3, "K": 4096, "N": 4096},
         "params": {"SPLIT_K": 8}}]})
    assert table.lookup("matmul", {"M": 3, "K": 4096, "N": 4096}, "bfloat16").params == {"SPLIT_K": 8}
    assert table.lookup("matmul", {"M": 5, "K": 4096, "N": 4096}, "bfloat16").params == {"SPLIT_K": 4}
    assert table.lookup("matmul", {"M": 3, "K": 4096, "N": 4096}, "float16") is None


def test_dispatch_module_imports_no_search_machinery():
    code = ("import sys, kernelsearch.dispatch; "
            "bad = [m for m in ('optuna', 'sqlite3', 'kernelsearch.harness', 'kernelsearch.search', "
            "'kernelsearch.ledger', 'kernelsearch.proposers') if m in sys.modules]; print(bad)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True, capture_output=True,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.stdout.strip() == "[]", proc.stderr


def test_the_tables_lock_is_never_opened_through_a_link(tmp_path):
    """A link planted as PATH.lock beside a --dispatch-out had root create the file it named."""
    elsewhere = tmp_path / "elsewhere"
    path = tmp_path / "table.json"
    (tmp_path / "table.json.lock").symlink_to(elsewhere)
    with pytest.raises(TableError, match="lock"):
        with DispatchTable.updating(path):
            pass
    assert not elsewhere.exists() and not path.exists()


def test_concurrent_updates_of_one_table_keep_every_writers_entries(tmp_path):
    """Two processes merging into the same table at once (a search and a `share import`, or two
    searches) must not lose each other's winners: load-merge-save runs under the table's lock."""
    path = tmp_path / "table.json"
    writer = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from kernelsearch.dispatch import DispatchTable, Entry
        name = sys.argv[1]
        for i in range(25):
            with DispatchTable.updating({str(path)!r}) as table:
                table.entries.append(Entry.make(kernel=name, dtype="float32", shape={{"M": i}}))
                time.sleep(0.002)  # widen the load -> save window
                table.save({str(path)!r})
    """)
    procs = [subprocess.Popen([sys.executable, "-c", writer, name]) for name in ("a", "b")]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    entries = json.loads(path.read_text())["entries"]
    assert sorted((e["kernel"], e["shape"]["M"]) for e in entries) == \
        sorted((k, i) for k in ("a", "b") for i in range(25))
    assert not list(tmp_path.glob("*.tmp"))


def test_entry_is_frozen_validated_and_round_trips_through_json():
    raw = {"kernel": "rmsnorm", "dtype": "bfloat16", "shape": {"M": 1, "N": 4096},
           "source": {"module": "kernelsearch.kernels.rmsnorm"}, "source_hash": "ab12", "params": {"num_warps": 4},
           "plan": {"launches": [{"grid": [1, 1, 1]}]}, "candidate_ms": 0.004, "stock_ms": 0.01,
           "speedup": 2.5, "against": "torch.nn.functional.rms_norm", "noise_band": 0.01,
           "imported_from": "cuda-0ther"}
    e = Entry.from_json(raw)
    assert Entry.from_json(json.loads(json.dumps(e.to_json()))) == e
    assert e.to_json() == raw
    assert e.describe_speedup() == "2.50x against torch.nn.functional.rms_norm"
    with pytest.raises(TypeError):
        e.params["num_warps"] = 8
    with pytest.raises(TypeError):
        e.plan["launches"][0]["grid"][0] = 9
    import dataclasses
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.kernel = "softmax"
    for bad, field in [({"dtype": "bfloat16", "shape": {}}, "kernel"),
                       ({"kernel": "x", "dtype": "bfloat16", "shape": [1, 2]}, "shape"),
                       ({"kernel": "x", "dtype": "bfloat16", "shape": {"M": "1"}}, "shape"),
                       ({"kernel": "x", "dtype": "bfloat16", "shape": {}, "source": {"exec": "x"}}, "source"),
                       ({"kernel": "x", "dtype": "bfloat16", "shape": {}, "speedup": "fast"}, "speedup"),
                       ({"kernel": "x", "dtype": "bfloat16", "shape": {}, "range": {"M": [1]}}, "range")]:
        with pytest.raises(EntryError, match=field):
            Entry.from_json(bad)
    table = DispatchTable({"format": 1, "entries": [raw, {"kernel": 3}]})
    assert table.entries == [e] and len(table.invalid) == 1 and "kernel" in table.invalid[0]


def test_a_module_source_other_than_a_built_in_template_is_stock_and_imports_nothing(tmp_path, monkeypatch):
    """Finding a dotted module imports its parent packages: a table entry naming
    {"module": "pkg.x"} ran pkg/__init__.py. Only kernelsearch.kernels.<kernel> is a module source."""
    pkg = tmp_path / "planted"
    pkg.mkdir()
    marker = tmp_path / "ran"
    (pkg / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    plan = {"buffers": {}, "steps": [{"op": "launch", "kernel": "_rmsnorm", "grid": [4], "args": {}}]}
    for module in ("planted.kernel", "planted", "kernelsearch.kernels", "kernelsearch.dispatch"):
        entry = Entry.make(kernel="rmsnorm", dtype="float32", shape={"M": 4, "N": 100},
                           source={"module": module}, source_hash="0" * 16, params={}, plan=plan)
        assert not DispatchTable({"format": 1, "entries": [entry]}).usable(entry)
    assert not marker.exists()
    from kernelsearch.dispatch import source_text
    from kernelsearch.kernels import template_path
    assert source_text({"module": "kernelsearch.kernels.rmsnorm"})[1] == template_path("rmsnorm")


def test_a_source_swapped_between_its_read_and_its_hash_check_is_stock(tmp_path, monkeypatch, cpu_fingerprint):
    """The source text compiled must be the text hashed: the file was read, then hashed again by
    path, so a file swapped in between (other text compiled, the verified text hashed) routed."""
    import kernelsearch.dispatch as dispatch
    from kernelsearch.harness.verify import make_plan

    src = tmp_path / "tuned_rmsnorm.py"
    src.write_text(TUNED_RMSNORM)
    verified = file_sha256(src)
    plan = make_plan("rmsnorm", src, {"M": 4, "N": 100}, "float32", {"BLOCK_N": 128}, "cpu")
    entry = Entry.make(kernel="rmsnorm", dtype="float32", shape={"M": 4, "N": 100}, source={"path": str(src)},
                       source_hash=verified, params={"BLOCK_N": 128}, plan=plan)
    assert DispatchTable({"format": 1, "entries": [entry]}).usable(entry)
    swapped = TUNED_RMSNORM.replace("x * inv * w", "x * inv * w * 2.0")
    read = dispatch.source_text

    def read_then_swap_back(source):
        src.write_text(swapped)
        found = read(source)
        src.write_text(TUNED_RMSNORM)   # the verified text again for the hash check
        return found
    monkeypatch.setattr(dispatch, "source_text", read_then_swap_back)
    assert not DispatchTable({"format": 1, "entries": [entry]}).usable(entry)


def test_a_source_path_that_is_no_regular_file_is_stock_without_waiting_or_reading_it_whole(tmp_path):
    """A FIFO as an entry's source hung the first call (read waited for a writer); /dev/zero was read
    until memory ran out (a MemoryError into the model); a file past the harness's limit was read whole."""
    import os

    from kernelsearch.harness.source import MAX_SOURCE_BYTES

    fifo = tmp_path / "source.py"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.py"
    with open(huge, "wb") as f:
        f.truncate(4 * MAX_SOURCE_BYTES)
    plan = {"buffers": {}, "steps": [{"op": "launch", "kernel": "_rmsnorm", "grid": [4], "args": {}}]}
    for path in (fifo, "/dev/zero", huge, tmp_path):
        entry = Entry.make(kernel="rmsnorm", dtype="float32", shape={"M": 4, "N": 100},
                           source={"path": str(path)}, source_hash="0" * 16, params={}, plan=plan)
        assert not DispatchTable({"format": 1, "entries": [entry]}).usable(entry)


def test_an_entry_without_a_source_hash_is_stock(tmp_path, cpu_fingerprint):
    """No source_hash skipped the check: whatever file sat at the path (never verified) routed."""
    from kernelsearch.harness.verify import make_plan

    src = tmp_path / "tuned_rmsnorm.py"
    src.write_text(TUNED_RMSNORM)
    plan = make_plan("rmsnorm", src, {"M": 4, "N": 100}, "float32", {"BLOCK_N": 128}, "cpu")
    src.write_text(TUNED_RMSNORM.replace("x * inv * w", "x * inv * w * 2.0"))   # never verified
    for missing in (None, ""):
        entry = Entry.make(kernel="rmsnorm", dtype="float32", shape={"M": 4, "N": 100},
                           source={"path": str(src)}, source_hash=missing, params={"BLOCK_N": 128}, plan=plan)
        assert not DispatchTable({"format": 1, "entries": [entry]}).usable(entry)


@pytest.mark.parametrize("text", ['[1, 2]', '{"format": 1, "entries": null}', '{"format": 1, "entries": 5}',
                                  '{"format": 1, "entries": [' + "[" * 100000 + "]" * 100000 + ']}',
                                  '{"format": 1, "entries": []}\xff', '{"format": 2, "entries": []}'])
def test_a_file_that_is_not_a_table_is_one_table_error_naming_it(tmp_path, text):
    """A JSON list, entries that are no list, JSON nested past the parser's depth or bytes that are
    not UTF-8 were an AttributeError, TypeError, RecursionError or UnicodeDecodeError from load."""
    from kernelsearch.dispatch import TableError

    path = tmp_path / "table.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape") if "\xff" not in text
                     else text[:-1].encode() + b"\xff")
    with pytest.raises(TableError, match="table.json"):
        DispatchTable.load(path)


def test_an_entry_nested_past_the_recursion_limit_is_left_out_not_the_table(tmp_path):
    path = tmp_path / "table.json"
    deep = "[" * 900 + "]" * 900
    path.write_text('{"format": 1, "entries": [{"kernel": "rmsnorm", "dtype": "float32", "shape": {"M": 4}, '
                    '"plan": {"a": ' + deep + '}}, {"kernel": "rmsnorm", "dtype": "float32", "shape": {"M": 5}}]}')
    table = DispatchTable.load(path)
    assert [dict(e.shape) for e in table.entries] == [{"M": 5}] and "nested" in table.invalid[0]


def test_a_table_another_user_may_write_is_refused(tmp_path):
    """A table's plans are what runs on the GPU: one owned by another user, or that group or
    others may write, was loaded and routed as if the harness had written it."""
    import os

    from kernelsearch.dispatch import TableError

    path = DispatchTable.empty().save(tmp_path / "table.json")
    assert DispatchTable.load(path).entries == []
    path.chmod(0o664)
    with pytest.raises(TableError, match="lets other users write it"):
        DispatchTable.load(path)
    path.chmod(0o644)
    assert DispatchTable.load(path).entries == []
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
        with pytest.raises(TableError, match="owned by uid 65534"):
            DispatchTable.load(path)


def test_a_table_that_cannot_be_saved_is_a_table_write_error_and_stays_as_it_was(tmp_path, monkeypatch):
    """A full disk (ENOSPC) while saving was an OSError traceback after a whole search."""
    import errno
    import os

    from kernelsearch.dispatch import TableWriteError

    path = tmp_path / "table.json"
    DispatchTable.empty().save(path)
    before = path.read_bytes()

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    table = DispatchTable.empty()
    table.data["fingerprint_id"] = "cpu-new"
    with pytest.raises(TableWriteError, match=f"{path}: cannot be written \\(No space left on device\\)"):
        table.save(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table.json"]   # no temporary file left


def test_an_entrys_time_that_is_negative_zero_or_past_a_float_is_unknown_not_an_error(tmp_path):
    """-5 ms was kept as a time (it wins every "faster than" comparison: a share import's winner
    with it replaced any local one), and 10**400 ms was an OverflowError traceback from loading
    the table -- from hwtune search before its first evaluation."""
    base = {"kernel": "rmsnorm", "dtype": "float32", "shape": {"M": 9, "N": 128}}
    e = Entry.from_json({**base, "candidate_ms": -5, "stock_ms": 0, "speedup": -2.0, "noise_band": -0.1})
    assert (e.candidate_ms, e.stock_ms, e.speedup, e.noise_band) == (None, None, None, None)
    assert Entry.from_json({**base, "noise_band": 0, "candidate_ms": 0.5}).noise_band == 0.0
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"format": 1, "entries": [{**base, "candidate_ms": 10 ** 400}]}))
    path.chmod(0o600)
    table = DispatchTable.load(path)
    assert len(table.entries) == 1 and table.entries[0].candidate_ms is None


UNALIGNED_CHILD = textwrap.dedent('''
    import json, sys
    import torch
    from kernelsearch.dispatch import DispatchTable
    table = DispatchTable.load(sys.argv[1])
    wide = torch.randn(4 * 100 + 1)
    w = torch.rand(100) + 0.5
    report = {}
    for name, x in (("aligned", wide[:400].view(4, 100).clone()), ("odd", wide[1:].view(4, 100))):
        assert x.is_contiguous()
        _, _, why = table.route("rmsnorm", x, w, 1e-6)
        out = table.call("rmsnorm", x, w, 1e-6)
        ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        report[name] = {"why": why, "err": float((out - ref).abs().max())}
    print(json.dumps(report))
''')


def test_a_view_at_an_address_no_check_used_goes_to_stock(tmp_path, cpu_fingerprint):
    """Every buffer the harness checks a kernel on is 16-byte aligned; a contiguous view at an
    odd offset got the tuned kernel, where Triton compiles a specialisation never checked, and a
    kernel right only on aligned addresses (hack_unaligned_view) was wrong there."""
    from kernelsearch.harness.verify import make_plan

    src = ROOT / "tests" / "candidates" / "hack_unaligned_view.py"
    plan = make_plan("rmsnorm", src, {"M": 4, "N": 100}, "float32", {}, "cpu")
    assert plan
    table = DispatchTable({"format": 1, "fingerprint_id": fingerprint_id(cpu_fingerprint),
                           "fingerprint": cpu_fingerprint,
                           "entries": [{"kernel": "rmsnorm", "dtype": "float32", "source": {"path": str(src)},
                                        "source_hash": file_sha256(src), "candidate_ms": 0.01,
                                        "stock_ms": 0.02, "speedup": 2.0, "shape": {"M": 4, "N": 100},
                                        "params": {}, "plan": plan}]})
    path = table.save(tmp_path / "dispatch" / f"{fingerprint_id(cpu_fingerprint)}.json")
    proc = subprocess.run([sys.executable, "-c", UNALIGNED_CHILD, str(path)], cwd=ROOT, text=True,
                          capture_output=True, timeout=180,
                          env={"TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["aligned"]["why"] == "tuned" and report["aligned"]["err"] < 1e-4, report
    assert report["odd"]["why"] != "tuned" and report["odd"]["err"] < 1e-4, report


EPS_CHILD = textwrap.dedent('''
    import json, sys
    import torch
    from kernelsearch.dispatch import DispatchTable
    table = DispatchTable.load(sys.argv[1])
    x, w = torch.randn(4, 100), torch.rand(100) + 0.5
    report = {}
    for eps in (1e-6, 1e-5, 1e-8):
        _, _, why = table.route("rmsnorm", x, w, eps)
        out = table.call("rmsnorm", x, w, eps)
        ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
        report[str(eps)] = {"why": why, "err": float((out - ref).abs().max())}
    print(json.dumps(report))
''')


def test_a_scalar_outside_the_range_the_checks_drew_goes_to_stock(tmp_path, cpu_fingerprint):
    """eps is checked in 1e-6..1e-2; a call with eps 1e-8 got the tuned kernel, and one wrong
    below the range (hack_small_eps) was wrong there."""
    from kernelsearch.harness.verify import make_plan

    src = ROOT / "tests" / "candidates" / "hack_small_eps.py"
    plan = make_plan("rmsnorm", src, {"M": 4, "N": 100}, "float32", {}, "cpu")
    assert plan
    table = DispatchTable({"format": 1, "fingerprint_id": fingerprint_id(cpu_fingerprint),
                           "fingerprint": cpu_fingerprint,
                           "entries": [{"kernel": "rmsnorm", "dtype": "float32", "source": {"path": str(src)},
                                        "source_hash": file_sha256(src), "candidate_ms": 0.01,
                                        "stock_ms": 0.02, "speedup": 2.0, "shape": {"M": 4, "N": 100},
                                        "params": {}, "plan": plan}]})
    path = table.save(tmp_path / "dispatch" / f"{fingerprint_id(cpu_fingerprint)}.json")
    proc = subprocess.run([sys.executable, "-c", EPS_CHILD, str(path)], cwd=ROOT, text=True,
                          capture_output=True, timeout=180,
                          env={"TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["1e-06"]["why"] == report["1e-05"]["why"] == "tuned", report
    assert report["1e-08"]["why"] != "tuned" and all(r["err"] < 1e-4 for r in report.values()), report
