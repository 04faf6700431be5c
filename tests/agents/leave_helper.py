"""A scripted agent that writes a candidate, then exits 0 leaving a helper of its own running."""
import pathlib
import subprocess
import sys

helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
pathlib.Path("helper.pid").write_text(str(helper.pid))
pathlib.Path("candidate.py").write_text("# placeholder\n")
