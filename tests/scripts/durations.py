"""Write tests/durations.json from a pytest ``--durations=0`` report (setup + call + teardown per test id).

Used by ``make test-durations``; tests/conftest.py reads the file to run the longest tests first. Tests shorter
than 0.05 s are left out (they count as the default)."""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*(?P<s>[\d.]+)s (?P<phase>setup|call|teardown)\s+(?P<id>\S.*)$")


def main(report: str, out: str) -> None:
    total: dict[str, float] = defaultdict(float)
    for line in Path(report).read_text().splitlines():
        if m := LINE.match(line):
            total[m["id"].strip()] += float(m["s"])
    kept = {k: round(v, 2) for k, v in sorted(total.items(), key=lambda kv: -kv[1]) if v >= 0.05}
    Path(out).write_text(json.dumps(kept, indent=0, sort_keys=False) + "\n")
    print(f"{out}: {len(kept)} test(s), {sum(kept.values()):.0f} s in all")


if __name__ == "__main__":
    main(*sys.argv[1:3])
