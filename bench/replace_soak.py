"""The replacement soak on demand (issue #51's goal: "0 ranks live twice, over 200 kills and
stops in a row"): a group with ``on_rank_death="replace"`` on a scheduler and two node agent
processes, one rank SIGKILLed or SIGSTOPped (alternately, the rank by a seeded random
generator) ``--faults`` times in a row, every replacement checked from outside.

    python -m bench.replace_soak --faults 200 --seed 1     # ~15 min on 2 cores

The faults and the checks are those of ``tests/support/replacesoak.py`` (the CI test
``tests/cluster/test_replace_soak.py`` runs 10 of them). Prints the counts (kills, stops,
standbys and fresh workers used, ranks live twice, leftovers) and the seconds from each
fault to its call's error and to the next call served, with the replacement's steps.
Exits 1 when any check failed; ``--out`` also writes the table to a file.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """Run the soak; print (and with ``--out`` write) its table."""
    parser = argparse.ArgumentParser(prog="python -m bench.replace_soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=200, help="kills and stops, one at a time (1..10000)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--per-group", type=int, default=10,
                        help="replacements before the group is rebuilt with fresh standbys (1..10000)")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    if not 1 <= args.faults <= 10_000 or not 1 <= args.per_group <= 10_000:
        parser.error("--faults and --per-group must be in 1..10000")
    from tests.support.replacesoak import ReplaceSoak, soak_cluster
    with tempfile.TemporaryDirectory(prefix="podium-replace-soak-") as work, soak_cluster(Path(work)) as agents:
        soak = ReplaceSoak(agents, args.faults, args.seed, per_group=args.per_group).run()
    table = soak.table()
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    return 1 if soak.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
