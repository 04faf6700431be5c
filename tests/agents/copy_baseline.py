"""A scripted agent: checks the context pack is there, then proposes the baseline unchanged."""
import json
import pathlib
import sys

work = pathlib.Path.cwd()
for name in ("TASK.md", "baseline.py", "roofline.json", "ledger.json", "best.json"):
    if not (work / name).is_file():
        print(f"missing {name}", file=sys.stderr)
        sys.exit(3)
json.loads((work / "ledger.json").read_text())
# a comment makes it a new file (same content would be recognised by its hash and not re-run)
(work / "candidate.py").write_text((work / "baseline.py").read_text() + "\n# proposed by copy_baseline\n")
print("wrote candidate.py")
