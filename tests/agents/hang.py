"""A scripted agent that never finishes (and leaves a child of its own behind)."""
import pathlib
import subprocess
import sys
import time

helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
pathlib.Path("helper.pid").write_text(str(helper.pid))
time.sleep(600)
