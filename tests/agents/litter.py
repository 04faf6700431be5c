"""A scripted agent that leaves a file in /tmp (named by its first argument) and writes a candidate."""
import pathlib
import sys

pathlib.Path("/tmp", sys.argv[1]).write_text("left by the agent\n")
pathlib.Path("candidate.py").write_text("# placeholder\n")
print("wrote /tmp/" + sys.argv[1])
