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
import signal
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
    """Drops torchrun's "failed (exitcode: 130|2) local_rank: ..." line (the rank said why itself) and
    its "Sending process N closing signal" lines (ending the other ranks is routine; a real failure
    still ends in torchrun's own report)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        expected = msg.startswith("failed (exitcode") and record.args
        return not (expected and record.args[0] in (STOPPED, USER_ERROR)) and not msg.startswith(
            "Sending process"
        )


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
        # torchrun ends the other ranks (SIGTERM, then SIGKILL) as soon as one exits: whichever got there
        # first may be the only one that said why, the rest show the signal
        for ours in (STOPPED, USER_ERROR):
            if ours in codes and codes <= {ours, -signal.SIGTERM, -signal.SIGKILL}:
                return ours
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
