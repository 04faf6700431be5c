"""A scripted agent run as the same user as the search: it tries to rewrite a file of the state
directory (argv[1]), to signal the search (pid argv[2]) and to reach it through /proc;
candidate.py says what worked."""
import os
import sys

done = []
try:
    with open(sys.argv[1], "w") as f:
        f.write("forged by the agent\n")
    done.append("wrote the state dir")
except OSError:
    pass
try:
    os.kill(int(sys.argv[2]), 0)
    done.append("can signal the search")
except OSError:
    pass
try:
    with open(f"/proc/{int(sys.argv[2])}/environ", "rb") as f:
        f.read()
    done.append("can read the search's /proc (environ, fd, mem)")
except OSError:
    pass
if os.path.exists(f"/proc/{int(sys.argv[2])}"):
    done.append("sees the search in /proc")
with open("candidate.py", "w") as f:
    f.write(f"# {done}\n")
