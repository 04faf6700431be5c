"""Put a candidate's searched entries into a copy of a dispatch table (bench/experiments' scripts).

    python3 bench/experiments/merge_entries.py GIVEN FOUND OUT LABEL

Every entry of FOUND (a table `hwtune search --source ... --dispatch-out` wrote) replaces GIVEN's
entry for the same (kernel, shape), or is added; the result goes to OUT, GIVEN is not changed. One
line a merged entry says both harness times (each from its own search, so they compare loosely:
the step rows on both tables are the same-run comparison).
"""
from __future__ import annotations

import json
import sys


def _key(entry: dict) -> tuple:
    return entry["kernel"], json.dumps(entry["shape"], sort_keys=True)


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    given_path, found_path, out_path, label = argv
    with open(given_path) as f:
        given = json.load(f)
    with open(found_path) as f:
        found = json.load(f)
    print(f"given table {given.get('fingerprint_id')}, {label} table {found.get('fingerprint_id')}")
    index = {_key(e): i for i, e in enumerate(given["entries"])}
    for e in found["entries"]:
        i = index.get(_key(e))
        old = given["entries"][i] if i is not None else None
        print(f"{e['kernel']} {e['shape']}: {label} {e['params']} {e['candidate_ms'] * 1e3:.2f} us "
              f"(stock {e['stock_ms'] * 1e3:.2f}); given "
              + (f"{old['params']} {old['candidate_ms'] * 1e3:.2f} us" if old else "none (stock)"))
        if i is None:
            given["entries"].append(e)
        else:
            given["entries"][i] = e
    with open(out_path, "w") as f:
        json.dump(given, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
