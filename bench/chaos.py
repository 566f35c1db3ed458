"""The chaos soak on demand (issue #31): the job of ``tests/support/chaosjob.py`` on three
nodes in network namespaces, driven through ``--faults`` random faults, then its counts.

    python -m bench.chaos --faults 1000 --seed 1 --per-cycle 3    # as root, ~45 min on 2 cores

The faults, the job and what is checked are those of ``tests/support/chaos.py`` (the CI
test ``tests/cluster/test_chaos_soak.py`` runs 30 of them). ``--per-cycle`` faults land at
once (each node and the scheduler at most once per cycle); after each cycle the job must
finish a step. Exits 1 when any check failed; ``--out`` also writes the table to a file.
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import sys
import tempfile
from pathlib import Path

from tests.support.chaos import ChaosCluster, Soak
from tests.support.netlab import NetLab, unavailable


def main(argv: list[str] | None = None) -> int:
    """Run the soak; print (and with ``--out`` write) its table."""
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=1000, help="faults to inject (1..100000)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--per-cycle", type=int, default=3, help="faults landing at once (1..4)")
    parser.add_argument("--nodes", type=int, default=3, help="node hosts (3..4)")
    parser.add_argument("--out", type=Path, help="also write the table here")
    parser.add_argument("--keep", type=Path, help="keep the processes' logs and state in this folder")
    args = parser.parse_args(argv)
    if not 1 <= args.faults <= 100_000 or not 1 <= args.per_cycle <= 4 or not 3 <= args.nodes <= 4:
        parser.error("--faults must be in 1..100000, --per-cycle in 1..4, --nodes in 3..4")
    why = unavailable()
    if why:
        print(f"the chaos soak needs network namespaces: {why}", file=sys.stderr)
        return 2
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    with (contextlib.nullcontext(str(args.keep)) if args.keep else
          tempfile.TemporaryDirectory(prefix="podium-chaos-")) as work, NetLab() as lab:
        cluster = ChaosCluster(lab, Path(work), secrets.token_urlsafe(16), nodes=args.nodes)
        try:
            soak = Soak(cluster, args.faults, args.seed, per_cycle=args.per_cycle).run()
        finally:
            cluster.close()
    table = soak.table()
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    return 1 if soak.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
