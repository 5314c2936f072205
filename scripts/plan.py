"""Launch plans of experiment configs (diloco.experiments.plan) on the command line.

python scripts/plan.py vars 150m/diloco_8w_h500          # shell variables for scripts/launch_node.sh
python scripts/plan.py check experiment=150m/ddp_8x ...  # validate a run's overrides as the trainer will
python scripts/plan.py show 150m/diloco_8w_h500 [...]    # the human-readable plan
python scripts/plan.py list --family tiny                # the experiment names
"""

from __future__ import annotations

import argparse
import sys

from diloco.experiments.plan import PlanError, check_run, describe, experiments, shell_vars


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["vars", "check", "show", "list"])
    p.add_argument(
        "experiments",
        nargs="*",
        help="experiment names (vars: one name, then hydra overrides; check: the trainer's overrides)",
    )
    p.add_argument("--family")
    args = p.parse_args(argv)
    try:
        if args.what == "list":
            print("\n".join(experiments(args.family)))
        elif args.what == "vars":
            print(shell_vars(args.experiments[0], args.experiments[1:]))
        elif args.what == "check":
            if notice := check_run(args.experiments):
                print(f"note: {notice}", file=sys.stderr)
        else:
            for name in args.experiments or experiments(args.family):
                print(describe(name))
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
