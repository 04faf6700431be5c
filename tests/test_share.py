"""kernelsearch.share and `hwtune share export|import`: one fingerprint's rows and winners move
between hosts (here: two state directories); another fingerprint is refused unless --force."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_hwtune

TESTS = Path(__file__).resolve().parent


def _template_hash() -> str:
    from kernelsearch.dispatch import file_sha256
    from kernelsearch.kernels import template_path

    return file_sha256(template_path("rmsnorm"))


TEMPLATE_HASH = _template_hash()


@pytest.fixture(scope="module")
def local_fp():
    """This host's cpu fingerprint, as `--device cpu` computes it (interpreter on)."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from kernelsearch.fingerprint import collect, fingerprint_id

        fp = collect("cpu")
        return fp, fingerprint_id(fp)
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


def row(fp, fp_id, run_id="r1", params=None, accepted=True, candidate_ms=0.8, started_at=1000.0, **kw):
    r = {"run_id": run_id, "kernel": "rmsnorm", "dtype": "float32", "shape": {"M": 4, "N": 64},
         "strategy": "grid", "source": json.dumps({"module": "kernelsearch.kernels.rmsnorm"}),
         "source_hash": "abc123", "params": params or {"BLOCK_N": 0}, "accepted": accepted,
         "guard": None if accepted else "correctness", "reason": "" if accepted else "off by 3%",
         "candidate_ms": candidate_ms, "stock_ms": 1.0, "noise_band": 0.01, "flops": 10.0, "bytes": 20.0,
         "fingerprint": fp_id, "fingerprint_json": fp, "code_version": "ks-test", "git_describe": "g1",
         "started_at": started_at, "finished_at": started_at + 1}
    r.update(kw)
    return r


def entry(shape, candidate_ms, source, source_hash, params):
    return {"kernel": "rmsnorm", "dtype": "float32", "shape": shape, "source": source,
            "source_hash": source_hash, "params": params, "candidate_ms": candidate_ms,
            "stock_ms": 1.0, "speedup": 1.0 / candidate_ms, "noise_band": 0.01}


def make_host(state: Path, fp, fp_id, entries, rows):
    from kernelsearch.dispatch import DispatchTable, table_path
    from kernelsearch.ledger import Ledger

    with Ledger(state / "ledger.sqlite") as ledger:
        ledger.record(rows)
    from kernelsearch.dispatch import Entry

    table = DispatchTable.empty()
    table.entries = [Entry.from_json(e) for e in entries]
    table.data.update(fingerprint_id=fp_id, fingerprint=fp)
    table.save(table_path(state, fp_id))


def ledger_rows(state: Path) -> list:
    from kernelsearch.ledger import Ledger

    with Ledger(state / "ledger.sqlite") as ledger:
        rows = ledger.attempts()
    return sorted(json.dumps({k: v for k, v in r.items() if k != "id"}, sort_keys=True, default=str)
                  for r in rows)


def table(state: Path, fp_id: str) -> dict:
    return json.loads((state / "dispatch" / f"{fp_id}.json").read_text())


@pytest.fixture
def host_a(tmp_path, local_fp):
    from kernelsearch.ledger import file_hash

    fp, fp_id = local_fp
    cand = tmp_path / "agent_cand.py"
    cand.write_text((TESTS / "candidates" / "honest_rmsnorm.py").read_text())
    state = tmp_path / "a"
    make_host(state, fp, fp_id,
              entries=[entry({"M": 4, "N": 64}, 0.8, {"module": "kernelsearch.kernels.rmsnorm"}, TEMPLATE_HASH,
                             {"BLOCK_N": 0}),
                       entry({"M": 5, "N": 1000}, 0.6, {"path": str(cand)}, file_hash(cand), {})],
              rows=[row(fp, fp_id), row(fp, fp_id, params={"BLOCK_N": 1024}, accepted=False,
                                        candidate_ms=math.inf, started_at=1001.0)])
    return state, cand


def test_export_then_import_moves_rows_and_winners_to_another_host(tmp_path, host_a, local_fp):
    from kernelsearch.dispatch import file_sha256

    fp, fp_id = local_fp
    state_a, cand = host_a
    bundle = tmp_path / "bundle.json"
    out = run_hwtune("--state-dir", state_a, "share", "export", "--device", "cpu", "-o", bundle)
    assert out.returncode == 0, out.stderr
    assert "exported 2 ledger rows and 2 dispatch entries" in out.stderr
    cand.unlink()  # the receiving host never had the file: its text travels in the bundle

    state_b = tmp_path / "b"
    got = run_hwtune("--state-dir", state_b, "share", "import", bundle, "--device", "cpu", "--json")
    assert got.returncode == 0, got.stderr
    report = json.loads(got.stdout)
    assert (report["rows_added"], report["entries_added"], report["forced"]) == (2, 2, False)
    assert ledger_rows(state_b) == ledger_rows(state_a)  # inf time (a failed try) included
    entries = {e["shape"]["M"]: e for e in table(state_b, fp_id)["entries"]}
    moved = Path(entries[5]["source"]["path"])
    assert moved.is_relative_to(state_b) and file_sha256(moved) == entries[5]["source_hash"]
    assert entries[4]["source"] == {"module": "kernelsearch.kernels.rmsnorm"}


def test_importing_the_same_bundle_twice_stores_each_row_once(tmp_path, host_a):
    state_a, _ = host_a
    bundle = tmp_path / "bundle.json"
    run_hwtune("--state-dir", state_a, "share", "export", "--device", "cpu", "-o", bundle, check=True)
    state_b = tmp_path / "b"
    first = run_hwtune("--state-dir", state_b, "share", "import", bundle, "--device", "cpu", "--json", check=True)
    second = run_hwtune("--state-dir", state_b, "share", "import", bundle, "--device", "cpu", "--json", check=True)
    assert json.loads(first.stdout)["rows_added"] == 2
    again = json.loads(second.stdout)
    assert (again["rows_added"], again["rows_present"], again["entries_added"], again["entries_kept"]) == (0, 2, 0, 2)
    assert len(ledger_rows(state_b)) == 2
    # and importing back into the host it came from changes nothing either
    home = run_hwtune("--state-dir", state_a, "share", "import", bundle, "--device", "cpu", "--json", check=True)
    assert json.loads(home.stdout)["rows_added"] == 0


def test_bundle_from_another_fingerprint_is_refused_with_exit_2_unless_forced(tmp_path, host_a, local_fp):
    fp, fp_id = local_fp
    state_a, _ = host_a
    bundle_path = tmp_path / "bundle.json"
    run_hwtune("--state-dir", state_a, "share", "export", "--device", "cpu", "-o", bundle_path, check=True)
    bundle = json.loads(bundle_path.read_text())
    bundle["fingerprint"] = dict(bundle["fingerprint"], triton="0.0-other")
    bundle["fingerprint_id"] = "cpu-0ther000"
    for r in bundle["attempts"]:
        r["fingerprint"], r["fingerprint_json"] = "cpu-0ther000", bundle["fingerprint"]
    bundle_path.write_text(json.dumps(bundle))

    state_b = tmp_path / "b"
    refused = run_hwtune("--state-dir", state_b, "share", "import", bundle_path, "--device", "cpu")
    assert refused.returncode == 2
    assert "triton '0.0-other' (bundle) != " in refused.stderr and "--force" in refused.stderr
    assert not (state_b / "dispatch").exists()
    assert not (state_b / "ledger.sqlite").exists()  # refused before anything was written

    forced = run_hwtune("--state-dir", state_b, "share", "import", bundle_path, "--device", "cpu", "--force",
                        "--json", check=True)
    assert json.loads(forced.stdout)["forced"] is True
    assert {json.loads(r)["fingerprint"] for r in ledger_rows(state_b)} == {"cpu-0ther000"}  # where measured
    here = table(state_b, fp_id)  # winners usable on this host, marked
    assert here["fingerprint_id"] == fp_id
    assert {e["imported_from"] for e in here["entries"]} == {"cpu-0ther000"}


def test_a_faster_imported_winner_replaces_a_slower_local_one_and_a_slower_one_does_not(tmp_path, local_fp):
    from kernelsearch.share import export_bundle, import_bundle

    fp, fp_id = local_fp
    mod = {"module": "kernelsearch.kernels.rmsnorm"}
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    h = TEMPLATE_HASH
    make_host(fast, fp, fp_id, [entry({"M": 1, "N": 128}, 0.5, mod, h, {"BLOCK_N": 0}),
                                entry({"M": 3, "N": 130}, 0.9, mod, h, {"BLOCK_N": 0})], [row(fp, fp_id)])
    make_host(slow, fp, fp_id, [entry({"M": 1, "N": 128}, 0.7, mod, h, {"BLOCK_N": 1024}),
                                entry({"M": 3, "N": 130}, 0.4, mod, h, {"BLOCK_N": 1024})], [row(fp, fp_id, run_id="r2")])
    report = import_bundle(export_bundle(fast, fp_id), slow, fp)
    assert (report["entries_replaced"], report["entries_kept"], report["rows_added"]) == (1, 1, 1)
    winners = {e["shape"]["M"]: (e["candidate_ms"], e["params"]) for e in table(slow, fp_id)["entries"]}
    assert winners == {1: (0.5, {"BLOCK_N": 0}), 3: (0.4, {"BLOCK_N": 1024})}


def test_export_of_a_fingerprint_with_nothing_recorded_lists_what_is_there(tmp_path, host_a, local_fp):
    state_a, _ = host_a
    got = run_hwtune("--state-dir", state_a, "share", "export", "--fingerprint", "nvidia-h200-00000000")
    assert got.returncode == 2
    assert f"{local_fp[1]} (2 rows)" in got.stderr


def test_a_file_that_is_not_a_bundle_is_refused(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"hello": 1}))
    got = run_hwtune("--state-dir", tmp_path / "s", "share", "import", bad, "--device", "cpu")
    assert got.returncode == 2 and "not an hwtune share bundle" in got.stderr


@pytest.mark.parametrize("what", ["dev-zero", "fifo", "deep"])
def test_a_bundle_that_never_ends_or_nests_past_the_parser_is_one_line(tmp_path, what):
    # before: /dev/zero was read until a MemoryError, a FIFO hung, [[[...]]] was a RecursionError
    bundle = tmp_path / "b.json"
    if what == "dev-zero":
        bundle = Path("/dev/zero")
    elif what == "fifo":
        os.mkfifo(bundle)
    else:
        bundle.write_text("[" * 200000 + "]" * 200000)
    got = run_hwtune("--state-dir", tmp_path / "s", "share", "import", bundle, "--device", "cpu", timeout=60)
    assert got.returncode == 2 and "Traceback" not in got.stderr, got.stderr
    assert len(got.stderr.strip().splitlines()) == 1, got.stderr
    assert ("not a regular file" if what != "deep" else "not JSON") in got.stderr


def test_a_broken_dispatch_table_here_is_one_line_for_export_import_and_search(tmp_path, host_a, local_fp):
    """A table file that is not a table (a JSON list) was an AttributeError traceback from share
    export, share import and, after the whole search, from hwtune search."""
    _, fp_id = local_fp
    bundle = tmp_path / "bundle.json"
    run_hwtune("--state-dir", host_a[0], "share", "export", "--device", "cpu", "-o", bundle, check=True)
    state = tmp_path / "b"
    (state / "dispatch").mkdir(parents=True)
    state.chmod(0o700)
    (state / "dispatch" / f"{fp_id}.json").write_text("[1]")
    for args in (("share", "export", "--device", "cpu", "-o", tmp_path / "out.json"),
                 ("share", "import", bundle, "--device", "cpu"),
                 ("search", "rmsnorm", "--device", "cpu", "--budget", "1")):
        got = run_hwtune("--state-dir", state, *args)
        assert got.returncode == 2, (args, got.stderr)
        assert "Traceback" not in got.stderr and "not a dispatch table" in got.stderr, got.stderr


def test_an_imported_winner_runs_the_plan_this_host_verified_and_an_unverifiable_one_is_refused(tmp_path, local_fp,
                                                                                                 monkeypatch):
    """A bundle is untrusted: its plans and sources were stored as given, so a hand-written plan
    for the built-in template at its real hash (the output aliased onto the input x) routed and
    overwrote the caller's tensor, and a kernel that is wrong (its text at its own hash) routed."""
    import copy

    from kernelsearch.dispatch import DispatchTable
    from kernelsearch.harness.verify import make_plan
    from kernelsearch.kernels import template_path
    from kernelsearch.share import import_bundle

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fp, fp_id = local_fp
    shape, params = {"M": 4, "N": 100}, {"BLOCK_N": 0}
    honest = make_plan("rmsnorm", template_path("rmsnorm"), shape, "float32", params, "cpu")
    aliased = copy.deepcopy(honest)
    launch = next(s for s in aliased["steps"] if s["op"] == "launch")
    launch["args"]["out_ptr"] = {"ref": {"buf": "x", "offset": 0, "dtype": "float32"}}
    wrong = (TESTS / "candidates" / "honest_rmsnorm.py").read_text().replace("1.0 / tl.sqrt", "2.0 / tl.sqrt")
    def _text_hash(text):
        import hashlib
        return hashlib.sha256(text.encode()).hexdigest()[:16]
    entries = [dict(entry(shape, 0.1, {"module": "kernelsearch.kernels.rmsnorm"}, TEMPLATE_HASH, params),
                    plan=aliased),
               dict(entry({"M": 5, "N": 1000}, 0.1, {"path": "/elsewhere/wrong.py"}, _text_hash(wrong), {}),
                    plan=aliased),
               dict(entry({"M": 6, "N": 1000}, 0.1, {"path": "/elsewhere/other.py"}, "0123abcd", {}),
                    plan=aliased)]
    assert wrong != (TESTS / "candidates" / "honest_rmsnorm.py").read_text()
    bundle = {"format": "hwtune-share", "version": 1, "fingerprint_id": fp_id, "fingerprint": fp, "attempts": [],
              "dispatch": {"entries": entries}, "sources": {_text_hash(wrong): wrong, "0123abcd": wrong}}
    state = tmp_path / "b"
    report = import_bundle(bundle, state, fp)
    assert (report["entries_added"], report["entries_refused"]) == (1, 2), report
    assert "rejected by this host's harness" in " ".join(report["refused"])
    table = DispatchTable.load(state / "dispatch" / f"{fp_id}.json")
    (only,) = table.entries
    from kernelsearch.entry import _thaw
    assert _thaw(only.plan) == json.loads(json.dumps(honest)) != aliased
    # the tuned path in a child: TRITON_INTERPRET must be set before triton is imported
    child = (
        "import sys, torch\n"
        "from kernelsearch.dispatch import DispatchTable\n"
        "table = DispatchTable.load(sys.argv[1])\n"
        "x = torch.randn(4, 100); x0, w = x.clone(), torch.rand(100) + 0.5\n"
        "assert table.route('rmsnorm', x, w, 1e-6)[2] == 'tuned'\n"
        "out = table.call('rmsnorm', x, w, 1e-6)\n"
        "assert torch.equal(x, x0), 'the input was written'\n"
        "assert torch.allclose(out, x0 * torch.rsqrt(x0.pow(2).mean(-1, keepdim=True) + 1e-6) * w, atol=1e-5)\n"
        "print('ok', table.counts.get(('rmsnorm', 'tuned'), 0))\n")
    proc = subprocess.run([sys.executable, "-c", child, str(state / "dispatch" / f"{fp_id}.json")],
                          capture_output=True, text=True, timeout=300, cwd=TESTS.parent,
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(TESTS.parent)})
    assert proc.stdout.split() == ["ok", "1"], proc.stderr[-3000:]


@pytest.mark.parametrize("part", [{"attempts": [5]}, {"dispatch": [1]}, {"fingerprint_id": ["x"]},
                                  {"sources": [1], "dispatch": {"entries": []}}, {"fingerprint": "cpu"}])
def test_a_bundle_of_the_wrong_form_is_one_line_exit_2(tmp_path, local_fp, part):
    """Rows that are no objects, a dispatch or sources that are lists: TypeError / AttributeError
    tracebacks from share import."""
    bundle = tmp_path / "x.json"
    bundle.write_text(json.dumps({"format": "hwtune-share", "version": 1, "fingerprint_id": local_fp[1], **part}))
    got = run_hwtune("--state-dir", tmp_path / "s", "share", "import", bundle, "--device", "cpu")
    assert got.returncode == 2 and "Traceback" not in got.stderr and "malformed bundle" in got.stderr, got.stderr


def test_a_ledger_that_is_not_one_is_one_line_exit_2_for_export_import_and_search(tmp_path, host_a):
    """A corrupt, truncated or other-version ledger was a sqlite3 traceback (exit 1, no JSON
    document) from share export, share import and, after the roofline, from hwtune search."""
    bundle = tmp_path / "bundle.json"
    run_hwtune("--state-dir", host_a[0], "share", "export", "--device", "cpu", "-o", bundle, check=True)
    state = tmp_path / "b"
    state.mkdir(mode=0o700)
    ledger = state / "ledger.sqlite"
    ledger.write_bytes(b"not a database" * 300)
    for args in (("share", "export", "--device", "cpu", "-o", tmp_path / "out.json", "--json"),
                 ("share", "import", bundle, "--device", "cpu", "--json"),
                 ("search", "rmsnorm", "--device", "cpu", "--budget", "1", "--shape", "M=1,N=128", "--json")):
        got = run_hwtune("--state-dir", state, *args, timeout=300)
        assert got.returncode == 2 and "Traceback" not in got.stderr, (args, got.stderr)
        assert got.stderr.strip().count("\n") == 0 and f"ledger {ledger}: not a ledger" in got.stderr, got.stderr
        assert json.loads(got.stdout)["exit_code"] == 2
        assert "roofline" not in got.stderr   # refused before the search measured anything
    assert ledger.read_bytes() == b"not a database" * 300
    assert not (state / "dispatch").exists() or not any((state / "dispatch").glob("*.json"))


@pytest.mark.parametrize("field,value,why", [
    ("candidate_ms", "fast", "'candidate_ms' must be a number or null"),
    ("candidate_ms", 10 ** 400, "'candidate_ms' must be a number or null"),
    ("started_at", None, "'started_at' must be a finite number"),
    ("started_at", "yesterday", "'started_at' must be a finite number"),
    ("shape", "M=4,N=64", "'shape' must be an object"),
    ("kernel", 5, "'kernel' must be a string"),
    ("accepted", "false", "'accepted' must be true or false")])
def test_a_ledger_row_of_the_wrong_types_is_refused_and_nothing_is_stored(tmp_path, local_fp, field, value, why):
    """A string or an int past a float's range as a time was a ValueError / OverflowError
    traceback; a null time a NOT NULL error; the others were stored as given ("false" as
    accepted)."""
    fp, fp_id = local_fp
    bundle = tmp_path / "x.json"
    bad = {**row(fp, fp_id, run_id="r2"), field: value}
    bundle.write_text(json.dumps({"format": "hwtune-share", "version": 1, "fingerprint_id": fp_id,
                                  "fingerprint": fp, "attempts": [row(fp, fp_id), bad]}))
    state = tmp_path / "s"
    got = run_hwtune("--state-dir", state, "share", "import", bundle, "--device", "cpu", "--json")
    assert got.returncode == 2 and "Traceback" not in got.stderr, got.stderr
    assert got.stderr.strip() == f"hwtune share: {bundle}: malformed bundle: ledger row 1: {why}"
    assert json.loads(got.stdout)["exit_code"] == 2
    assert ledger_rows(state) == []


def test_an_export_that_cannot_be_written_whole_keeps_the_file_it_replaces(tmp_path, monkeypatch):
    """`share export -o FILE` on a full disk left FILE truncated (an earlier bundle there lost)."""
    import errno

    from daemon.commands import share as share_cmd

    out = tmp_path / "bundle.json"
    out.write_text('{"earlier": 1}')

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        share_cmd._write_whole(out, json.dumps({"rows": list(range(1000))}))
    assert out.read_text() == '{"earlier": 1}'
    assert [p.name for p in tmp_path.iterdir()] == ["bundle.json"]
    monkeypatch.undo()
    share_cmd._write_whole(out, "{}\n")
    assert out.read_text() == "{}\n" and oct(out.stat().st_mode & 0o777) == "0o644"
