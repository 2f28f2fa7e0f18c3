"""Seconds per test module (setup + call + teardown) from a pytest log written with
`--durations=0 --durations-min=0.05`: `python modules.py LOG`."""

from __future__ import annotations

import collections
import re
import sys

LINE = re.compile(r"\s*([\d.]+)s (setup|call|teardown)\s+(\S+?)::")


def main(path: str) -> None:
    modules: collections.Counter[str] = collections.Counter()
    phases: collections.Counter[str] = collections.Counter()
    with open(path) as log:
        for line in log:
            if match := LINE.match(line):
                seconds = float(match.group(1))
                modules[match.group(3)] += seconds
                phases[match.group(2)] += seconds
    print(f"total {sum(modules.values()):.0f}", {k: round(v) for k, v in phases.items()})
    for module, seconds in modules.most_common():
        print(f"{seconds:7.1f} {module}")


if __name__ == "__main__":
    main(sys.argv[1])
