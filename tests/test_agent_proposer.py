"""The agent proposer: context pack in, candidate file out, judged by the same harness.

Scripted agents live in tests/agents/; they run as real child processes.
"""
import json
import os
import sys
import time
from pathlib import Path

import pytest

from kernelsearch.agent import AgentConfig, _demote, command_problem, context_notes, run_agent, write_context_pack
from kernelsearch.ledger import Ledger
from kernelsearch.search import search
from kernelsearch.specs import get_spec

from conftest import ROOT

AGENTS = ROOT / "tests" / "agents"
SHAPE = [{"M": 3, "N": 130}]
H200 = {"device": "cuda", "gpu": "NVIDIA H200", "capability": "9.0", "sm_count": 132}


def _agent(script, timeout_s=60.0):
    return AgentConfig(argv=[sys.executable, str(AGENTS / script)], timeout_s=timeout_s)


def _pack(work):
    from kernelsearch.kernels import template_path

    return write_context_pack(work, kernel="rmsnorm", spec=get_spec("rmsnorm"), shapes=SHAPE,
                              dtype=None, device="cpu", fingerprint=H200,
                              ceilings={"copy_gb_s": 4300.0, "matmul_tflops": 800.0},
                              ledger_summary={"total": 0}, recent_attempts=[], best=[],
                              baseline_path=template_path("rmsnorm"))


def test_context_notes_follow_gpu_generation_and_model_family():
    names = [p.name for p in context_notes(H200, "deepseek")]
    assert names == ["README.md", "hopper-h100-h200.md", "deepseek-mla-sparse.md"]
    rtx = [p.name for p in context_notes({"gpu": "NVIDIA GeForce RTX 4090", "capability": "8.9"})]
    assert "consumer-no-nvlink.md" in rtx and "hopper-h100-h200.md" not in rtx
    a100 = [p.name for p in context_notes({"gpu": "NVIDIA A100-SXM4-80GB", "capability": "8.0"}, "all")]
    assert a100 == ["README.md", "ampere-a100.md", "llama-gqa.md", "deepseek-mla-sparse.md"]
    assert [p.name for p in context_notes({"device": "cpu"})] == ["README.md", "llama-gqa.md"]


def test_context_pack_holds_task_contract_notes_roofline_and_ledger(tmp_path):
    written = _pack(tmp_path)
    assert {"TASK.md", "baseline.py", "roofline.json", "ledger.json", "best.json",
            "context/hopper-h100-h200.md"} <= set(written)
    task = (tmp_path / "TASK.md").read_text()
    assert "launch(x, weight, eps, out" in task and '"M": 3' in task
    assert json.loads((tmp_path / "roofline.json").read_text())["copy_gb_s"] == 4300.0


def test_task_says_which_dtype_each_shape_is_measured_in(tmp_path):
    from kernelsearch.kernels import template_path

    common = dict(kernel="rmsnorm", spec=get_spec("rmsnorm"), device="cpu", fingerprint=H200,
                  ceilings={}, ledger_summary={}, recent_attempts=[], best=[],
                  baseline_path=template_path("rmsnorm"))
    write_context_pack(tmp_path / "a", shapes=[{"M": 3, "N": 130, "dtype": "bfloat16"}],
                       dtype="float32", **common)
    assert "## Shapes (all in float32)" in (tmp_path / "a" / "TASK.md").read_text()
    write_context_pack(tmp_path / "b", shapes=SHAPE, dtype=None, **common)
    assert "unless a shape names its own" in (tmp_path / "b" / "TASK.md").read_text()


def test_agent_that_writes_a_file_hands_back_its_candidate(tmp_path):
    _pack(tmp_path)
    outcome = run_agent(_agent("copy_baseline.py"), tmp_path)
    assert outcome.status == "ok" and outcome.candidate_path == tmp_path / "candidate.py"


def test_agent_that_hangs_is_killed_with_its_children_and_reported_as_timeout(tmp_path):
    outcome = run_agent(_agent("hang.py", timeout_s=2), tmp_path)
    assert outcome.status == "timeout" and "2 s" in outcome.reason
    helper = int((tmp_path / "helper.pid").read_text())
    for _ in range(50):   # SIGKILL is asynchronous; the helper is reaped by init
        stat = Path(f"/proc/{helper}/stat")
        if not stat.exists() or stat.read_text().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"agent's helper {helper} survived the timeout")


def _assert_gone(pid):
    for _ in range(50):   # SIGKILL is asynchronous; the helper is reaped by init
        stat = Path(f"/proc/{pid}/stat")
        if not stat.exists() or stat.read_text().split()[2] == "Z":
            return
        time.sleep(0.1)
    raise AssertionError(f"agent's helper {pid} survived")


def test_helpers_an_agent_leaves_behind_after_exiting_are_killed(tmp_path):
    outcome = run_agent(_agent("leave_helper.py"), tmp_path)
    assert outcome.status == "ok"
    _assert_gone(int((tmp_path / "helper.pid").read_text()))


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another user needs root")
def test_agent_run_as_a_user_gets_that_users_group_and_no_root_groups():
    import pwd
    import shutil
    import tempfile

    python = "/usr/bin/python3"
    if not os.access(python, os.X_OK):
        pytest.skip("no system python the agent user can run")
    nobody = pwd.getpwnam("nobody")
    work = Path(tempfile.mkdtemp(prefix="hwtune-agent-test-", dir="/tmp"))
    try:
        os.chmod(work, 0o755)
        config = AgentConfig(argv=[python, "-c", "import os; open('candidate.py', 'w').write("
                                   "repr([os.getuid(), os.getgid(), sorted(os.getgroups())]))"],
                             timeout_s=60, user="nobody")
        outcome = run_agent(config, work)
        assert outcome.status == "ok", outcome.reason
        uid, gid, groups = eval((work / "candidate.py").read_text())
        assert (uid, gid) == (nobody.pw_uid, nobody.pw_gid)
        assert 0 not in groups and set(groups) <= {nobody.pw_gid}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_agent_that_writes_nothing_or_cannot_start_is_a_verdict(tmp_path):
    assert run_agent(_agent("silent.py"), tmp_path).status == "missing"
    broken = run_agent(AgentConfig(argv=[str(tmp_path / "no-such-agent")]), tmp_path)
    assert broken.status == "failed" and "cannot start" in broken.reason


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the agent as nobody")
@pytest.mark.parametrize("exit_code", [1, 0])
def test_agent_links_to_root_only_files_are_never_followed(tmp_path, exit_code):
    """The agent user points agent.log and candidate.py at a file only root can read: root
    neither echoes it (log tail on failure) nor copies it (candidate on success)."""
    import shutil
    import tempfile

    secret = tmp_path / "root-secret.txt"
    secret.write_text("TOP-SECRET-LINE\n")
    os.chmod(secret, 0o600)
    work = Path(tempfile.mkdtemp(prefix="hwtune-agent-test-", dir="/tmp"))
    try:
        os.chmod(work, 0o755)
        script = (f"echo ordinary agent output; rm -f agent.log; ln -s {secret} agent.log; "
                  f"ln -s {secret} candidate.py; exit {exit_code}")
        outcome = run_agent(AgentConfig(argv=["/bin/sh", "-c", script], timeout_s=60, user="nobody"), work)
        assert "TOP-SECRET" not in outcome.reason and b"TOP-SECRET" not in outcome.data
        assert outcome.status == "failed"
        if exit_code:
            assert "ordinary agent output" in outcome.reason
        else:
            assert "refused" in outcome.reason and "link" in outcome.reason
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_an_agent_command_that_cannot_start_is_refused_before_the_search(tmp_path):
    """A missing program, or one the agent user cannot reach (root's pyenv as nobody), failed
    every round as "cannot start ...: Permission denied" and the search ended with exit 0."""
    from conftest import run_hwtune

    proc = run_hwtune("--state-dir", tmp_path, "search", "rmsnorm", "--device", "cpu", "--strategy", "agent",
                      "--agent-command", "no-such-agent-program --x")
    assert proc.returncode == 2 and "no such program on PATH" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "agent").exists()
    assert command_problem(AgentConfig(argv=[])) == "an empty command"
    if os.geteuid() != 0:
        return
    import shutil
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="hwtune-agent-test-", dir="/tmp"))   # pytest's tmp is 0700
    try:
        os.chmod(top, 0o755)
        hidden = top / "private"
        hidden.mkdir(mode=0o700)
        exe = hidden / "agent.sh"
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
        assert "cannot enter" in command_problem(AgentConfig(argv=[str(exe)], user="nobody"))
        hidden.chmod(0o755)
        exe.chmod(0o700)
        assert "cannot read and run" in command_problem(AgentConfig(argv=[str(exe)], user="nobody"))
        exe.chmod(0o755)
        assert command_problem(AgentConfig(argv=[str(exe)], user="nobody")) is None
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_agent_user_is_dropped_to_only_when_running_as_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert _demote("nobody") is None
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert _demote("nobody") == "nobody" and _demote(None) is None


@pytest.mark.skipif(os.geteuid() == 0, reason="checks the path that does not drop privileges")
def test_agent_user_is_ignored_when_not_root(tmp_path):
    config = _agent("silent.py")
    config.user = "nobody"
    assert run_agent(config, tmp_path).status == "missing"   # ran as us, no chown attempted


def test_agent_rounds_go_through_the_harness_and_every_outcome_is_a_ledger_row(tmp_path):
    state = tmp_path / "state"
    common = dict(state_dir=state, strategy="agent", budget=1, device="cpu", shapes=SHAPE,
                  ceilings={"copy_gb_s": 10.0, "matmul_tflops": 0.1}, timeout_s=120)
    good = search("rmsnorm", agent=_agent("copy_baseline.py"), **common)
    # baseline + the agent's candidate, each one child run
    assert good.evaluations == 2
    # later rounds resume the baseline from the ledger: only the agents' own work is new
    search("rmsnorm", agent=_agent("garbage.py"), resume=True, **common)
    search("rmsnorm", agent=_agent("hang.py", timeout_s=2), resume=True, **common)
    with Ledger(state / "ledger.sqlite") as ledger:
        rows = ledger.attempts(kernel="rmsnorm")
    assert [(r["strategy"], r["accepted"]) for r in rows][:2] == [("agent", True), ("agent", True)]
    assert rows[2]["guard"] == "static" and not rows[2]["accepted"]
    assert rows[3]["guard"] == "agent" and "killed after 2 s" in rows[3]["reason"]
    assert len(rows) == 4
    kept = list((state / "candidates").glob("rmsnorm-*.py"))
    assert len(kept) == 2  # the good and the garbage file are kept for inspection


def test_a_helper_that_left_the_agents_session_is_killed_with_it(tmp_path):
    """setsid() in a double-forked helper took it out of the agent's process group, which was
    all that was killed: it lived on after the round, free to rewrite the agent's files."""
    outcome = run_agent(_agent("escape.py"), tmp_path)
    assert outcome.status == "ok", outcome.reason
    _assert_gone(int((tmp_path / "escaped.pid").read_text()))


def test_stopping_the_search_during_an_agent_round_ends_the_agent_and_its_helpers(tmp_path):
    """SIGTERM (or Ctrl-C) raised out of the wait for the agent and left it running."""
    import signal
    import subprocess

    script = ("import signal, sys\n"
              "from pathlib import Path\n"
              "from kernelsearch.agent import AgentConfig, run_agent\n"
              "def stop(*_): raise KeyboardInterrupt\n"
              "signal.signal(signal.SIGTERM, stop)\n"
              f"run_agent(AgentConfig(argv=[sys.executable, {str(AGENTS / 'hang.py')!r}], timeout_s=60), "
              f"Path({str(tmp_path)!r}))\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stderr=subprocess.DEVNULL)
    for _ in range(200):
        if (tmp_path / "helper.pid").exists():
            break
        time.sleep(0.05)
    helper = int((tmp_path / "helper.pid").read_text())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) != 0
    _assert_gone(helper)


def test_agent_output_is_bounded(tmp_path, monkeypatch):
    """An agent printing without end filled the disk through agent.log."""
    import kernelsearch.agent as agent_mod

    monkeypatch.setattr(agent_mod, "MAX_AGENT_FILE_BYTES", 2 << 20)
    outcome = run_agent(AgentConfig(argv=[sys.executable, str(AGENTS / "flood.py"), "8"], timeout_s=60),
                        tmp_path)
    assert outcome.status == "failed"
    assert (tmp_path / "agent.log").stat().st_size <= 2 << 20


@pytest.mark.skipif(os.geteuid() != 0, reason="a private /tmp needs root (mount namespace)")
def test_what_an_agent_leaves_in_tmp_stays_in_its_work_dir():
    """The agent user wrote to the host's /tmp, and what it left there outlived the round."""
    import shutil
    import tempfile
    import uuid

    python = "/usr/bin/python3"
    if not os.access(python, os.X_OK):
        pytest.skip("no system python the agent user can run")
    name = f"hwtune-agent-litter-{uuid.uuid4().hex}"
    # the state dir's place (/var/lib/hwtune): not under /tmp, which stays as it is for a work dir there
    top = Path(tempfile.mkdtemp(prefix="hwtune-agent-test-", dir=ROOT))
    work = top / "round-1"
    try:
        os.chmod(top, 0o755)
        work.mkdir(mode=0o755)
        shutil.copy(AGENTS / "litter.py", work / "litter.py")
        config = AgentConfig(argv=[python, str(work / "litter.py"), name], timeout_s=60, user="nobody")
        outcome = run_agent(config, work)
        assert outcome.status == "ok", outcome.reason
        assert not (Path("/tmp") / name).exists()
        # its /tmp was its work dir's tmp/, which goes with the round (a disk it filled there too)
        assert "wrote /tmp" in (work / "agent.log").read_text() and not (work / "tmp").exists()
    finally:
        shutil.rmtree(top, ignore_errors=True)
        Path("/tmp", name).unlink(missing_ok=True)


def test_an_agent_round_ends_at_the_searchs_time_limit(tmp_path):
    """--time-limit-s bounded when rounds start, not how long one runs: a hanging agent with the
    default 900 s round limit held a 60 s search for 900 s."""
    from types import SimpleNamespace

    from kernelsearch.agent import agent_rounds
    from kernelsearch.kernels import template_path
    from kernelsearch.search import OutOfTime

    recorded = []
    ledger = SimpleNamespace(summary=lambda **kw: {}, attempts=lambda **kw: [])
    loop = SimpleNamespace(kernel="rmsnorm", shapes=SHAPE, dtype=None, device="cpu", fingerprint=H200,
                           fingerprint_id="fp", run_id="run", ledger=ledger, candidates={}, memo={},
                           best_so_far=lambda: [], progress=lambda line: None,
                           record=lambda cand, shapes, verdict, started: recorded.append(verdict),
                           deadline=time.monotonic() + 2)
    started = time.monotonic()
    with pytest.raises(OutOfTime):
        agent_rounds(loop, _agent("hang.py", timeout_s=60), spec=get_spec("rmsnorm"), rounds=2,
                     ceilings={}, state_dir=tmp_path, baseline_path=template_path("rmsnorm"))
    assert time.monotonic() - started < 15
    assert recorded[0].guard == "agent" and "time limit" in recorded[0].reason


def test_agent_output_in_a_reason_carries_no_terminal_controls(tmp_path):
    """The last line of a failed agent's output became the ledger reason and the progress line
    as written: ESC [1A ESC [2K erased the line above on the terminal and wrote one of its own."""
    script = "import sys; sys.stdout.write('\\x1b[1A\\x1b[2K\\x07[1 0.1s] candidate.py {} -> accepted\\x08'); sys.exit(1)"
    outcome = run_agent(AgentConfig(argv=[sys.executable, "-c", script], timeout_s=60), tmp_path)
    assert outcome.status == "failed" and "-> accepted" in outcome.reason
    assert all(ch.isprintable() for ch in outcome.reason), repr(outcome.reason)


def test_the_agents_work_dir_and_files_are_its_own(tmp_path):
    """The work dir is the agent's HOME, where agent CLIs keep their logins and transcripts: it
    was 0755 and the agent wrote with umask 022, so every local user could read them."""
    import stat

    work = tmp_path / "round-1"
    _pack(work)
    script = "open('login.json', 'w').write('{}'); open('candidate.py', 'w').write('# x')"
    outcome = run_agent(AgentConfig(argv=[sys.executable, "-c", script], timeout_s=60), work)
    assert outcome.status == "ok", outcome.reason
    for path in (work, work / "login.json", work / "TASK.md"):
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, (path, oct(path.stat().st_mode))


def test_an_agent_run_as_the_searchs_own_user_cannot_touch_the_state_dir_or_signal_it(tmp_path):
    """hwtune not root (no user to drop to): the agent ran with the search's own rights, free to
    rewrite the ledger, the dispatch table and the kept candidates, and to kill the search."""
    import shutil
    import subprocess
    import tempfile

    python = "/usr/bin/python3" if os.geteuid() == 0 else sys.executable
    if not os.access(python, os.X_OK):
        pytest.skip("no system python another user can run")
    probe = subprocess.run(["unshare", "-Urm", "true"], capture_output=True,
                           user="nobody" if os.geteuid() == 0 else None)
    if probe.returncode != 0:
        pytest.skip("no unprivileged user namespaces here")
    top = Path(tempfile.mkdtemp(prefix="hwtune-agent-test-", dir=ROOT))
    try:
        os.chmod(top, 0o755)
        script = (
            "import os, sys\n"
            "from pathlib import Path\n"
            "from kernelsearch.agent import AgentConfig, run_agent\n"
            "state = Path(sys.argv[1]) / 'state'\n"
            "work = state / 'agent' / 'round-1'\n"
            "work.mkdir(parents=True)\n"
            "(state / 'ledger.sqlite').write_text('real')\n"
            "out = run_agent(AgentConfig(argv=[sys.executable, sys.argv[2], str(state / 'ledger.sqlite'),"
            " str(os.getpid())], timeout_s=60), work)\n"
            "print(out.status, out.reason, (state / 'ledger.sqlite').read_text(), out.data.decode())\n")
        if os.geteuid() == 0:
            shutil.chown(top, "nobody")
        proc = subprocess.run([python, "-c", script, str(top), str(AGENTS / "same_user.py")], cwd=ROOT,
                              capture_output=True, text=True, timeout=120,
                              user="nobody" if os.geteuid() == 0 else None, env={"PATH": "/usr/bin:/bin"})
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("ok") and "real" in proc.stdout, proc.stdout
        assert "# []" in proc.stdout, proc.stdout
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to the agent user needs root")
def test_an_agent_run_as_nobody_writes_only_its_work_dir_and_signals_no_other_process_of_nobody():
    """As nobody the agent could write any world-writable directory on the host and signal any
    other process of nobody (another search's sandbox, a daemon run as nobody)."""
    import shutil
    import subprocess
    import tempfile

    python = "/usr/bin/python3"
    if not os.access(python, os.X_OK):
        pytest.skip("no system python the agent user can run")
    top = Path(tempfile.mkdtemp(prefix="hwtune-agent-test-", dir=ROOT))
    other = subprocess.Popen(["sleep", "60"], user="nobody")
    try:
        os.chmod(top, 0o755)
        shared = top / "shared"
        shared.mkdir()
        os.chmod(shared, 0o1777)
        work = top / "round-1"
        work.mkdir()
        shutil.copy(AGENTS / "same_user.py", work / "agent.py")
        config = AgentConfig(argv=[python, str(work / "agent.py"), str(shared / "x"), str(other.pid)],
                             timeout_s=60, user="nobody")
        outcome = run_agent(config, work)
        assert outcome.status == "ok", outcome.reason
        assert outcome.data == b"# []\n"
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
        shutil.rmtree(top, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to the agent user needs root")
def test_an_agent_reaches_its_home_under_roots_0700_state_dir_and_nothing_else_there():
    """hwtune makes its state directory 0700: the agent, run as nobody in a work dir under it,
    could not reach its HOME (nor {workdir}) by path, so an agent CLI writing ~/.config failed."""
    import shutil
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="hwtune-agent-test-", dir=ROOT))
    try:
        os.chmod(top, 0o755)   # as /var/lib is
        state = top / "state"
        state.mkdir(mode=0o700)
        (state / "ledger.sqlite").write_text("LEDGER-ROWS")
        work = state / "agent" / "run" / "round-1"
        work.mkdir(parents=True)
        script = ('cd "$HOME" && mkdir -p "$HOME/.config" && echo "# from HOME" > "$HOME/candidate.py"; '
                  'cat ../../../ledger.sqlite 2>/dev/null; ls ../../..')
        outcome = run_agent(AgentConfig(argv=["/bin/sh", "-c", script], timeout_s=60, user="nobody"),
                            work, hide=state)
        assert outcome.status == "ok", outcome.reason
        assert outcome.data == b"# from HOME\n" and (work / ".config").is_dir()
        log = (work / "agent.log").read_text()
        assert "LEDGER-ROWS" not in log and "ledger.sqlite" not in log, log
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_an_agent_gains_no_privileges_through_setuid_programs(tmp_path):
    """The agent could run setuid-root programs (su, sudo, passwd, mount helpers) with their
    privileges: one flaw in any of them was root for a command the search runs unvetted."""
    script = ("status = open('/proc/self/status').read(); "
              "open('candidate.py', 'w').write([l for l in status.splitlines() if l.startswith('NoNewPrivs')][0])")
    outcome = run_agent(AgentConfig(argv=[sys.executable, "-c", script], timeout_s=60), tmp_path)
    assert outcome.status == "ok", outcome.reason
    assert outcome.data.split() == [b"NoNewPrivs:", b"1"]


def test_an_agent_that_takes_the_hosts_memory_is_the_out_of_memory_killers_first_choice(tmp_path):
    """An agent's memory is not bounded (agent CLIs need gigabytes of address space), and the
    OOM killer could pick the search, the daemon or the trusted executor instead of it."""
    script = "open('candidate.py', 'w').write(open('/proc/self/oom_score_adj').read())"
    outcome = run_agent(AgentConfig(argv=[sys.executable, "-c", script], timeout_s=60), tmp_path)
    assert outcome.status == "ok", outcome.reason
    assert int(outcome.data) == 1000


def test_an_agent_run_without_its_namespaces_is_said(tmp_path, monkeypatch):
    """Not root where user namespaces are not allowed (Ubuntu's default AppArmor), or under a
    unit that forbids them, the agent ran with all of this user's rights and nothing said so."""
    from types import SimpleNamespace

    import kernelsearch.agent as agent_mod
    from kernelsearch.kernels import template_path

    reaper = tmp_path / "bare_reaper.py"   # the reaper where no namespace can be made
    reaper.write_text("import json, os, subprocess, sys\n"
                      "cmd = sys.argv[sys.argv.index('--') + 1:]\n"
                      "rc = subprocess.call(cmd)\n"
                      "os.write(int(sys.argv[1]), json.dumps({'exited': True, 'rc': rc, 'left': 0,"
                      " 'isolation': [], 'exec_error': None}).encode())\n")
    monkeypatch.setattr(agent_mod, "REAPER", reaper)
    lines = []
    ledger = SimpleNamespace(summary=lambda **kw: {}, attempts=lambda **kw: [])
    loop = SimpleNamespace(kernel="rmsnorm", shapes=SHAPE, dtype=None, device="cpu", fingerprint=H200,
                           fingerprint_id="fp", run_id="run", ledger=ledger, candidates={}, memo={},
                           best_so_far=lambda: [], progress=lines.append,
                           record=lambda *a: None, measure=lambda cands: None, deadline=None)
    agent_mod.agent_rounds(loop, _agent("silent.py"), spec=get_spec("rmsnorm"), rounds=2, ceilings={},
                           state_dir=tmp_path / "state", baseline_path=template_path("rmsnorm"))
    warnings = [line for line in lines if line.startswith("warning: the agent ran without its namespaces")]
    assert len(warnings) == 1 and "rights on the whole host" in warnings[0], lines


@pytest.mark.skipif(os.geteuid() != 0, reason="a private /tmp needs root (mount namespace)")
def test_an_agent_program_under_tmp_still_runs():
    """The agent's /tmp became its work dir's tmp/, hiding the host's: an agent command under
    /tmp (a script beside pytest's tmp_path, /tmp/agent.sh) was 'cannot start ...: No such
    file'. Such a /tmp is now left as it is, read-only, with TMPDIR the agent's tmp/."""
    import shutil
    import tempfile
    import uuid

    here = Path(tempfile.mkdtemp(prefix="hwtune-agent-prog-", dir="/tmp"))
    top = Path(tempfile.mkdtemp(prefix="hwtune-agent-test-", dir=ROOT))
    name = f"hwtune-agent-litter-{uuid.uuid4().hex}"
    try:
        os.chmod(here, 0o755)
        os.chmod(top, 0o755)
        script = here / "agent.sh"
        script.write_text("#!/bin/sh\n"
                          f"touch /tmp/{name} 2>/dev/null && echo wrote /tmp\n"
                          'f=$(mktemp) && echo "# via $f" > candidate.py\n')
        script.chmod(0o755)
        work = top / "round-1"
        work.mkdir()
        outcome = run_agent(AgentConfig(argv=[str(script)], timeout_s=60, user="nobody"), work)
        assert outcome.status == "ok", outcome.reason
        assert not Path("/tmp", name).exists()
        assert outcome.data.startswith(f"# via {work}/tmp/".encode()), outcome.data
    finally:
        shutil.rmtree(here, ignore_errors=True)
        shutil.rmtree(top, ignore_errors=True)
        Path("/tmp", name).unlink(missing_ok=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to the agent user needs root")
def test_the_agent_and_its_helpers_die_with_a_killed_reaper():
    """SIGKILL to the reaper (the OOM killer, the search's last resort) left the agent, in its
    own PID namespace, and its helpers running with no one to end them."""
    import shutil
    import tempfile
    import threading

    top = Path(tempfile.mkdtemp(prefix="hwtune-agent-test-", dir=ROOT))
    try:
        os.chmod(top, 0o755)
        work = top / "round-1"
        work.mkdir()
        config = AgentConfig(argv=["/usr/bin/python3", str(AGENTS / "hang.py")], timeout_s=60, user="nobody")
        worker = threading.Thread(target=run_agent, args=(config, work))
        worker.start()
        for _ in range(200):
            if (work / "helper.pid").exists() and (work / "helper.pid").read_text():
                break
            time.sleep(0.05)
        time.sleep(0.2)
        parents = {}
        for p in filter(str.isdigit, os.listdir("/proc")):
            try:
                parents[int(p)] = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                pass
        reaper = [p for p, parent in parents.items() if parent == os.getpid()
                  and b"agent_reaper.py" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(reaper) == 1
        below, todo = [], list(reaper)
        while todo:
            up = todo.pop()
            kids = [p for p, parent in parents.items() if parent == up]
            below += kids
            todo += kids
        assert len(below) >= 2   # the agent and its helper (host pids)
        os.kill(reaper[0], 9)
        worker.join(30)
        for pid in below:
            _assert_gone(pid)
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to the agent user needs root")
def test_the_processes_an_agent_may_start_are_bounded(monkeypatch):
    """A fork bomb run as the agent user had the host's process table to itself for its round."""
    import shutil
    import tempfile

    import kernelsearch.agent as agent_mod

    monkeypatch.setattr(agent_mod, "MAX_AGENT_PROCESSES", 40)
    top = Path(tempfile.mkdtemp(prefix="hwtune-agent-test-", dir=ROOT))
    try:
        os.chmod(top, 0o755)
        work = top / "round-1"
        work.mkdir()
        outcome = run_agent(AgentConfig(argv=["/usr/bin/python3", str(AGENTS / "fork_many.py")],
                                        timeout_s=60, user="nobody"), work)
        assert outcome.status == "ok", outcome.reason
        assert int(outcome.data.split()[1]) < 40
    finally:
        shutil.rmtree(top, ignore_errors=True)
