"""Write an experiment's candidate file: a kernelsearch template with the experiment's diff applied.

    python3 bench/experiments/candidate.py NAME OUT

NAME.patch (in bench/experiments/) is a unified diff from kernelsearch/kernels/<template>.py (its
`---` line names it) to the candidate that was measured; text above the `---` line says what the
experiment is. The experiment scripts write the candidate into their state directory and search it
with `hwtune search KERNEL --source OUT`, so each experiment keeps only what it changes, not a copy
of the template. Every hunk must match the template exactly where it says: a template that has
changed since stops this script instead of producing a different candidate.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
HUNK = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def apply(patch: str) -> str:
    lines = patch.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("--- "))
    template = ROOT / lines[start][4:].strip().split("\t")[0].removeprefix("a/")
    src = template.read_text().splitlines(keepends=True)
    out, pos, i = [], 0, start + 2
    while i < len(lines):
        m = HUNK.match(lines[i])
        if not m:
            raise SystemExit(f"not a hunk header at patch line {i + 1}: {lines[i]!r}")
        at = int(m.group(1)) - (0 if m.group(2) == "0" else 1)
        out += src[pos:at]
        pos, i = at, i + 1
        while i < len(lines) and not lines[i].startswith("@@"):
            tag, text = lines[i][:1], lines[i][1:]
            if tag not in " -+":  # e.g. "\ No newline at end of file": none of ours needs it
                raise SystemExit(f"unsupported patch line {i + 1}: {lines[i]!r}")
            if tag in " -":
                if pos >= len(src) or src[pos] != text:
                    raise SystemExit(f"{template} changed: line {pos + 1} is not {text!r}")
                pos += 1
            if tag in " +":
                out.append(text)
            i += 1
    return "".join(out + src[pos:])


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.strip().splitlines()[2].strip())
    patch = HERE / f"{sys.argv[1]}.patch"
    if not patch.is_file():
        raise SystemExit(f"no {patch}; there are: {', '.join(sorted(p.stem for p in HERE.glob('*.patch')))}")
    Path(sys.argv[2]).write_text(apply(patch.read_text()))
