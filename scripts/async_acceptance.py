"""Issue 12's acceptance record: DumbDiLoCo against synchronous DiLoCo in the tiny family, per seed.

The study lives in `diloco.experiments.studies.async_acceptance` (its docstring says what it runs and
records, and how); this file keeps the command the Makefile, the README and the records
name.
"""

import sys

from diloco.experiments.studies.async_acceptance import main

if __name__ == "__main__":
    sys.exit(main())
