"""A scripted agent that writes MiB of output (its first argument) to stdout, then a candidate."""
import os
import pathlib
import sys

block = b"x" * (1 << 20)
for _ in range(int(sys.argv[1])):
    os.write(1, block)
pathlib.Path("candidate.py").write_text("# placeholder\n")
