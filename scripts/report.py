"""`make report`: a family's runs as a Markdown report with PNG plots, plus a W&B report when online.

The report is built by `diloco.experiments.report` (its docstring says what it writes and how to run it);
this file keeps the command the Makefile, the README and the records name.
"""

import sys

from diloco.experiments.report import main

if __name__ == "__main__":
    sys.exit(main())
