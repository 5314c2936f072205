"""Issues 13 and 32: the acceptance records of compressed pseudo-gradients and streaming fragments.

The study lives in `diloco.experiments.studies.compression_acceptance` (its docstring says what it runs and
records, and how); this file keeps the command the Makefile, the README and the records
name.
"""

import sys

from diloco.experiments.studies.compression_acceptance import main

if __name__ == "__main__":
    sys.exit(main())
