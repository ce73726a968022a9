"""``python -m tests.mutants``: every named mutant, killed or survived.

Exits non-zero when a mutant survives, errs, or names a target that is no
longer in the code."""

from __future__ import annotations

import argparse
import sys
import time

from tests.mutants.catalog import MUTANTS
from tests.mutants.runner import TargetMissing, run, selected


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutants", description=__doc__)
    parser.add_argument("names", nargs="*", help="only these mutants (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and what each attacks")
    parser.add_argument("--jobs", type=int, default=2, help="mutants run at once, each in its own copy")
    args = parser.parse_args(argv)
    if args.list:
        for mutant in MUTANTS:
            sys.stdout.write(f"{mutant.name}  [{mutant.tier}]  {mutant.file}\n    attacks: {mutant.invariant}\n")
        return 0
    mutants = selected(args.names)
    started = time.monotonic()
    try:
        results = run(mutants, jobs=args.jobs)
    except TargetMissing as exc:
        sys.stderr.write(f"mutants: {exc}\n")
        return 2
    killed = sum(r.verdict == "killed" for r in results)
    survived = sum(r.verdict == "survived" for r in results)
    errors = len(results) - killed - survived
    sys.stdout.write(f"mutants: {killed} killed, {survived} survived, {errors} errors "
                     f"in {time.monotonic() - started:.0f} s\n")
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
