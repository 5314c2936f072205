"""Sharded workers (issue 53): FSDP against DDP inside a DiLoCo worker (outer step, outer state,
activation checkpointing). The benchmark lives in `diloco.bench.fsdp`; this file keeps the command."""

import sys

from diloco.bench.fsdp import main

if __name__ == "__main__":
    sys.exit(main())
