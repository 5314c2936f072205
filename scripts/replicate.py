"""Run a family of experiments in order (`make replicate-150m`, `replicate-1b`, `ablation-fp16`,
`replicate-tiny`, `replicate-tiny-law`, `replicate-gpu`).

The runners (local, one GPU, ssh to each node) live in `diloco.experiments.run`, whose docstring
lists the commands; this file keeps the command the Makefile and the README name.
"""

import sys

from diloco.experiments.run import main, take_ctrl_c

if __name__ == "__main__":
    take_ctrl_c()
    sys.exit(main())
