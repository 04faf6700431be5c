"""A scripted agent that writes a candidate, then leaves a helper that escaped its process group
(double fork, setsid): killing the agent's group does not reach it."""
import os
import pathlib
import time

pathlib.Path("candidate.py").write_text("# placeholder\n")
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        pathlib.Path("escaped.pid.tmp").write_text(str(os.getpid()))
        os.rename("escaped.pid.tmp", "escaped.pid")
        time.sleep(600)
    os._exit(0)
while not pathlib.Path("escaped.pid").exists():
    time.sleep(0.01)
