"""A scripted agent that writes something that is not a kernel file."""
import pathlib

pathlib.Path("candidate.py").write_text("def launch(:\n    this is not python\n")
