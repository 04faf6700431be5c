"""The search loop's own decisions, driven through its executor interface by a scripted executor.

(The real harness in child processes is exercised by test_search_cli.py and
test_agent_proposer.py; here the verdicts are scripted so the keep / revert rule is exact.)
"""
import json

from kernelsearch.dispatch import DispatchTable
from kernelsearch.harness.verdict import ShapeResult, Verdict
from kernelsearch.ledger import Ledger
from kernelsearch.search import search

FAST, CLOSE, BROKEN = {"M": 4096, "N": 4096}, {"M": 16, "N": 4096}, {"M": 1, "N": 4096}
SHAPES = [FAST, CLOSE, BROKEN]
CEILINGS = {"copy_gb_s": 4300.0, "matmul_tflops": 800.0}


class ScriptedExecutor:
    """Answers like the harness would: per shape a time, stock at 1.0 ms, noise band 5%."""
    width = 2

    def __init__(self, noise_band=0.05, stock_ms=1.0):
        self.jobs = []
        self.noise_band, self.stock_ms = noise_band, stock_ms

    def _time(self, params, shape):
        if shape == BROKEN:
            return None
        gain = 0.5 if shape == FAST else 0.99   # CLOSE never beats stock by the noise band
        return gain + 0.01 * params["ROWS_PER_PROG"] + 0.001 * params["num_warps"]

    def map(self, jobs):
        self.jobs.extend(jobs)
        verdicts = []
        for job in jobs:
            results, accepted = [], True
            for shape in job["shapes"]:
                t = self._time(job["params"], shape)
                accepted &= t is not None
                results.append(ShapeResult(shape=shape, dtype="bfloat16", status="ok" if t else "rejected",
                                           candidate_ms=t or float("inf"), stock_ms=self.stock_ms, noise_band=self.noise_band,
                                           flops=4 * shape["M"] * shape["N"], bytes=4 * shape["M"] * shape["N"]))
            if accepted:
                verdicts.append(Verdict(True, shapes=results, params=job["params"]))
            else:  # the harness rejects the whole candidate: JSON, as a worker would ship it
                verdicts.append(Verdict(False, "correctness", "rel L2 0.5 > 0.01 on M=1", shapes=results,
                                        params=job["params"]).to_json())
        return verdicts


def _run(tmp_path, executor, **kw):
    return search("rmsnorm", state_dir=tmp_path, strategy="grid", budget=6, device="cpu",
                  dtype="bfloat16", shapes=SHAPES, executor=executor, ceilings=CEILINGS, **kw)


def test_each_point_is_one_job_over_every_shape_and_every_pair_is_a_ledger_row(tmp_path):
    ex = ScriptedExecutor()
    result = _run(tmp_path, ex)
    assert len(ex.jobs) == 6 == result.evaluations        # grid points are shared by all shapes
    assert all(job["shapes"] == SHAPES for job in ex.jobs)
    # each job names the hash its verdict is recorded under: the harness checks that very text
    from kernelsearch.entry import file_sha256
    from kernelsearch.kernels import template_path
    assert {job["source_hash"] for job in ex.jobs} == {file_sha256(template_path("rmsnorm"))}
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        assert ledger.summary()["total"] == 6 * 3


def test_a_rejected_candidate_wins_nowhere_even_on_shapes_it_passed(tmp_path):
    # BROKEN is in every job, so every candidate is rejected as a whole: nothing is kept
    result = _run(tmp_path, ScriptedExecutor())
    assert [r.kept for r in result.shapes] == [False, False, False]
    assert result.shapes[0].verdicts == {"correctness": 6}
    # the roofline still says where stock sits, from the shape's work and stock's time
    assert [r.bound for r in result.shapes] == ["memory", "overhead", "overhead"]
    assert result.shapes[0].pct_of_ceiling > 0


def test_unmeasurable_noise_band_counts_as_the_default_band_fresh_and_resumed(tmp_path):
    # CLOSE's best is ~1.5% faster than stock: within the default 2% band, so never kept,
    # whether the band comes back as inf (two unusable stock timings) or as NULL from the ledger
    kw = dict(strategy="grid", budget=6, device="cpu", dtype="bfloat16", shapes=[CLOSE],
              ceilings=CEILINGS)
    fresh = search("rmsnorm", state_dir=tmp_path, executor=ScriptedExecutor(float("inf"), stock_ms=1.02),
                   **kw)
    resumed = search("rmsnorm", state_dir=tmp_path, executor=ScriptedExecutor(), resume=True, **kw)
    assert resumed.evaluations == 0 and 1.0 < fresh.shapes[0].best["candidate_ms"] < 1.02
    assert [r.kept for r in fresh.shapes] == [r.kept for r in resumed.shapes] == [False]
    assert json.loads(open(fresh.table_path).read())["entries"] == []


def test_winner_kept_only_when_faster_than_stock_by_more_than_the_noise_band(tmp_path):
    result = search("rmsnorm", state_dir=tmp_path, strategy="grid", budget=6, device="cpu",
                    dtype="bfloat16", shapes=[FAST, CLOSE], executor=ScriptedExecutor(),
                    ceilings=CEILINGS)
    fast, close = result.shapes
    assert fast.kept and fast.speedup > 1.9 and fast.best["params"]["ROWS_PER_PROG"] == 1
    assert fast.bound == "memory" and fast.pct_of_ceiling > 0
    assert not close.kept and close.best is not None        # measured, but within the noise
    table = json.loads(open(result.table_path).read())
    assert [e["shape"] for e in table["entries"]] == [FAST]
    assert table["entries"][0]["source"] == {"module": "kernelsearch.kernels.rmsnorm"}
    winner = DispatchTable.load(result.table_path).lookup("rmsnorm", FAST, "bfloat16")
    assert winner.speedup > 1.9 and winner.against == "torch.nn.functional.rms_norm"


def test_resume_skips_everything_already_in_the_ledger(tmp_path):
    _run(tmp_path, ScriptedExecutor())
    again = ScriptedExecutor()
    result = _run(tmp_path, again, resume=True)
    assert again.jobs == [] and result.evaluations == 0 and result.resumed == 6 * 3
    assert result.shapes[0].attempts == 6


def test_dispatch_table_keeps_other_kernels_entries(tmp_path):
    out = tmp_path / "table.json"
    first = search("rmsnorm", state_dir=tmp_path, strategy="grid", budget=2, device="cpu",
                   dtype="bfloat16", shapes=[FAST], executor=ScriptedExecutor(), ceilings=CEILINGS,
                   dispatch_path=out)
    table = json.loads(out.read_text())
    table["entries"].append({"kernel": "softmax", "dtype": "bfloat16", "shape": FAST, "params": {}})
    out.write_text(json.dumps(table))
    search("rmsnorm", state_dir=tmp_path, strategy="random", budget=2, device="cpu", dtype="bfloat16",
           shapes=[FAST], executor=ScriptedExecutor(), ceilings=CEILINGS, dispatch_path=out)
    kernels = sorted(e["kernel"] for e in json.loads(out.read_text())["entries"])
    assert kernels == ["rmsnorm", "softmax"] and first.fingerprint_id in out.read_text()


class _Clock:
    """kernelsearch.search's `time` with a monotonic clock that only the executor moves."""

    def __init__(self):
        import time as real
        self.real, self.now = real, 0.0

    def monotonic(self):
        return self.now

    def __getattr__(self, name):
        return getattr(self.real, name)


class _SlowExecutor(ScriptedExecutor):
    """Each batch of jobs takes 10 s on the clock."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock

    def map(self, jobs):
        self.clock.now += 10.0
        return super().map(jobs)


def test_a_time_limit_stops_new_evaluations_and_writes_only_winners_of_shapes_cut_short(tmp_path, monkeypatch):
    import kernelsearch.search as ks

    clock = _Clock()
    monkeypatch.setattr(ks, "time", clock)
    out = tmp_path / "table.json"
    # an older entry at CLOSE: a search cut short that keeps nothing there must leave it alone
    seed = search("rmsnorm", state_dir=tmp_path / "old", strategy="grid", budget=1, device="cpu",
                  dtype="bfloat16", shapes=[FAST], executor=ScriptedExecutor(), ceilings=CEILINGS,
                  dispatch_path=out)
    doc = json.loads(out.read_text())
    doc["entries"][0]["shape"] = CLOSE
    out.write_text(json.dumps(doc))
    ex = _SlowExecutor(clock)
    result = search("rmsnorm", state_dir=tmp_path, strategy="grid", budget=6, device="cpu",
                    dtype="bfloat16", shapes=[FAST, CLOSE], executor=ex, ceilings=CEILINGS,
                    dispatch_path=out, time_limit_s=15)
    # batches of 2 at t=0 and t=10 started; the one due at t=20 did not
    assert len(ex.jobs) == 4 == result.evaluations
    assert result.stopped.startswith("time limit 15 s reached after 4 evaluation(s)")
    assert result.unfinished == [FAST, CLOSE]
    assert "stopped" in result.to_json() and result.to_json()["unfinished"] == [FAST, CLOSE]
    fast, close = result.shapes
    assert fast.kept and not close.kept
    entries = {json.dumps(e["shape"], sort_keys=True): e for e in json.loads(out.read_text())["entries"]}
    assert set(entries) == {json.dumps(FAST, sort_keys=True), json.dumps(CLOSE, sort_keys=True)}
    assert entries[json.dumps(CLOSE, sort_keys=True)]["params"] == seed.shapes[0].best["params"]
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        assert ledger.summary()["total"] == 4 * 2            # what ran is in the ledger
        assert ledger.db.execute("SELECT COUNT(*) FROM searches").fetchone()[0] == 0   # nothing finished
    # resumed without a limit: the four measured points come from the ledger, two more are run
    again = ScriptedExecutor()
    done = search("rmsnorm", state_dir=tmp_path, strategy="grid", budget=6, device="cpu",
                  dtype="bfloat16", shapes=[FAST, CLOSE], executor=again, ceilings=CEILINGS,
                  dispatch_path=out, resume=True)
    assert len(again.jobs) == 2 and done.stopped is None and done.unfinished == []
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        assert ledger.db.execute("SELECT COUNT(*) FROM searches").fetchone()[0] == 2


def test_a_finished_search_records_per_shape_whether_it_kept_and_a_lost_winner_comes_back(tmp_path):
    """`searches.kept` holds each shape's outcome; only the stock-won shape counts as searched,
    and a table that lost the kept entry gets it back from a resumed search without a new job."""
    from kernelsearch.kernels import template_path
    from kernelsearch.ledger import file_hash

    out = tmp_path / "dispatch.json"
    first = search("rmsnorm", state_dir=tmp_path, strategy="grid", budget=6, device="cpu",
                   dtype="bfloat16", shapes=[FAST, CLOSE], executor=ScriptedExecutor(),
                   ceilings=CEILINGS, dispatch_path=out)
    assert [r.kept for r in first.shapes] == [True, False]
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        rows = ledger.db.execute("SELECT shape, kept FROM searches ORDER BY id").fetchall()
        covered = ledger.searched(fingerprint=first.fingerprint_id,
                                  source_hashes={"rmsnorm": file_hash(template_path("rmsnorm"))})
    assert [(json.loads(shape), kept) for shape, kept in rows] == [(FAST, 1), (CLOSE, 0)]
    assert covered == {("rmsnorm", "bfloat16", json.dumps(CLOSE, sort_keys=True, separators=(",", ":")))}
    kept_params = first.shapes[0].best["params"]
    out.unlink()   # the table lost its entries (re-seeded without them)
    again = ScriptedExecutor()
    search("rmsnorm", state_dir=tmp_path, strategy="grid", budget=6, device="cpu", dtype="bfloat16",
           shapes=[FAST], executor=again, ceilings=CEILINGS, dispatch_path=out, resume=True)
    assert again.jobs == []
    entries = json.loads(out.read_text())["entries"]
    assert [(e["shape"], e["params"]) for e in entries] == [(FAST, kept_params)]


def test_a_shape_finished_before_the_time_limit_counts_as_searched(tmp_path, monkeypatch):
    import kernelsearch.search as ks

    clock = _Clock()
    monkeypatch.setattr(ks, "time", clock)
    ex = _SlowExecutor(clock)
    # random search: each shape draws its own points; FAST's two fit in one batch (t=0 -> 10),
    # CLOSE's first batch is due at t=10, past the limit of 5 s
    result = search("rmsnorm", state_dir=tmp_path, strategy="random", budget=2, device="cpu",
                    dtype="bfloat16", shapes=[FAST, CLOSE], executor=ex, ceilings=CEILINGS,
                    time_limit_s=5)
    assert len(ex.jobs) == 2 and result.unfinished == [CLOSE] and result.stopped
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        rows = ledger.db.execute("SELECT shape FROM searches").fetchall()
    assert [json.loads(r[0]) for r in rows] == [FAST]


def test_no_time_limit_and_a_generous_one_change_nothing(tmp_path, monkeypatch):
    import kernelsearch.search as ks

    clock = _Clock()
    monkeypatch.setattr(ks, "time", clock)
    result = search("rmsnorm", state_dir=tmp_path, strategy="grid", budget=6, device="cpu",
                    dtype="bfloat16", shapes=[FAST, CLOSE], executor=_SlowExecutor(clock),
                    ceilings=CEILINGS, time_limit_s=1000)
    assert result.evaluations == 6 and result.stopped is None and result.unfinished == []


class _NoStockExecutor(ScriptedExecutor):
    """Stock's timing fails (inf) for the candidates named, or for every one."""

    def __init__(self, failing=None):
        super().__init__()
        self.failing = failing

    def map(self, jobs):
        verdicts = super().map(jobs)
        for job, v in zip(jobs, verdicts):
            if self.failing is None or job["params"] in self.failing:
                for sr in v.shapes:
                    sr.stock_ms = float("inf")
        return verdicts


def test_no_stock_time_means_nothing_is_kept_fresh_and_resumed(tmp_path):
    kw = dict(strategy="grid", budget=4, device="cpu", dtype="bfloat16", shapes=[FAST], ceilings=CEILINGS)
    fresh = search("rmsnorm", state_dir=tmp_path, executor=_NoStockExecutor(), **kw)
    rep = fresh.shapes[0]
    assert rep.best is not None and not rep.kept and rep.speedup is None
    assert json.loads(open(fresh.table_path).read())["entries"] == []
    # the ledger holds NULL stock times: a resumed run decides the same
    resumed = search("rmsnorm", state_dir=tmp_path, executor=ScriptedExecutor(), resume=True, **kw)
    assert resumed.evaluations == 0 and not resumed.shapes[0].kept


def test_a_winner_whose_own_stock_timing_failed_is_judged_against_the_shapes_stock(tmp_path):
    probe = search("rmsnorm", state_dir=tmp_path / "probe", strategy="grid", budget=4, device="cpu",
                   dtype="bfloat16", shapes=[FAST], executor=ScriptedExecutor(), ceilings=CEILINGS)
    winner = probe.shapes[0].best["params"]
    result = search("rmsnorm", state_dir=tmp_path, strategy="grid", budget=4, device="cpu",
                    dtype="bfloat16", shapes=[FAST], executor=_NoStockExecutor([winner]),
                    ceilings=CEILINGS)
    rep = result.shapes[0]
    assert rep.best["params"] == winner and rep.kept and rep.best["stock_ms"] == 1.0
    assert rep.speedup == 1.0 / rep.best["candidate_ms"]
