"""`make stale-rounds` (issue 55): the spec's outer step, the paper's delayed Nesterov and delayed Nesterov
with staleness weights on an uneven, stale round schedule emulated in one process, against even rounds.

The study lives in `diloco.experiments.studies.stale_rounds` (its docstring says what it runs and
records); this file keeps the command the Makefile, the README and the record name.
"""

import sys

from diloco.experiments.studies.stale_rounds import main

if __name__ == "__main__":
    sys.exit(main())
