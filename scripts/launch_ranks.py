"""torchrun, ending the way the training entry point does (scripts/launch_node.sh runs it).

    python scripts/launch_ranks.py <torchrun arguments> -m diloco.train <overrides>

torchrun already gives the ranks their own sessions and passes a Ctrl+C or SIGTERM on to each of them
once (they finish the step, write a checkpoint, print "resume with the same command" and exit 130),
but then it raises SignalException and exits 1 under a traceback. Here that stop ends in exit 130,
with the ranks' own line as the last word. Ranks that all stop on a user error (exit 2, the one line
already printed by rank 0) end in exit 2, without torchrun's ChildFailedError report. Any other
failure is torchrun's own report, unchanged.
"""

from __future__ import annotations

import logging
import sys

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing import api
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

STOPPED, USER_ERROR = 130, 2  # the exit codes of diloco.train


def _quiet_on_stop(handler):
    """torchrun's signal handler, once (a second signal, e.g. SIGTERM to the whole job after the
    launcher passed one on, would cut torchrun's wait for the ranks' checkpoints short), after
    silencing its per-rank "closing signal" warnings."""
    stopping = []

    def handle(signum, frame):
        if stopping:
            return
        stopping.append(signum)
        logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
        handler(signum, frame)

    return handle


class _ExpectedExits(logging.Filter):
    """Drops torchrun's "failed (exitcode: 130|2) local_rank: ..." line: the rank said why itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        expected = str(record.msg).startswith("failed (exitcode") and record.args
        return not (expected and record.args[0] in (STOPPED, USER_ERROR))


def main(argv: list[str] | None = None) -> int:
    # looked up when torchrun starts the ranks (PContext.start), so replacing it here is enough
    api._terminate_process_handler = _quiet_on_stop(api._terminate_process_handler)
    logging.getLogger(api.__name__).addFilter(_ExpectedExits())
    args = torchrun.parse_args(argv)
    try:
        torchrun.run(args)
    except api.SignalException:
        return STOPPED
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        if codes in ({STOPPED}, {USER_ERROR}):
            return codes.pop()
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
