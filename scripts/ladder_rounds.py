"""`make ladder-rounds` (issue 55): the controlled ladder crossed with H = 10 / 30 / 90 and the outer
optimizer, 3 report seeds that also order the data, so that the size trend can be read at matched
outer rounds.

The study lives in `diloco.experiments.studies.ladder_rounds` (its docstring says what it runs and
records; its grid is configs/studies/ladder_rounds.yaml); this file keeps the command the Makefile, the
README and the record name.
"""

import sys

from diloco.experiments.studies.ladder_rounds import main

if __name__ == "__main__":
    sys.exit(main())
