"""Model-size ladder (issue 15): Mx DDP against DiLoCo at equal tokens, at three model sizes, on fresh data.

The study lives in `diloco.experiments.studies.ladder` (its docstring says what it runs and
records, and how); this file keeps the command the Makefile, the README and the records
name.
"""

import sys

from diloco.experiments.studies.ladder import main

if __name__ == "__main__":
    sys.exit(main())
