"""A scripted agent that starts sleeping processes until it may start no more (or 300 of them),
then writes how many it started as its candidate."""
import os
import time

started = 0
for _ in range(300):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    started += 1
with open("candidate.py", "w") as f:
    f.write(f"# {started}\n")
