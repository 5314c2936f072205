"""torchrun, ending the way the training entry point does (scripts/launch_node.sh runs it).

    python scripts/launch_ranks.py <torchrun arguments> -m diloco.train <overrides>

torchrun already gives the ranks their own sessions and passes a Ctrl+C or SIGTERM on to each of them
once (they finish the step, write a checkpoint, print "resume with the same command" and exit 130),
but then it raises SignalException and exits 1 under a traceback. Here that stop ends in exit 130,
with the ranks' own line as the last word. Ranks that all stop on a user error (exit 2, the one line
already printed by rank 0) end in exit 2, without torchrun's ChildFailedError report. A rendezvous
store that went away (node 0, which hosts it, died) is one line and exit 2, not the agent's tracebacks
and C++ stack frames; if node 0 only ended first (the ranks stopped or refused alike), this node ends
as its ranks did. The ranks die with this launcher (diloco.distributed.die_with_launcher). Any other failure is torchrun's own report, unchanged.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

# read once, when torch loads: the launcher's own C++ warnings (its store connection lost, with C++
# frames) stay quiet; main() gives the ranks the level they would have had
_RANKS_CPP_LOG_LEVEL = os.environ.get("TORCH_CPP_LOG_LEVEL")
os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"

from torch.distributed import run as torchrun  # noqa: E402
from torch.distributed.elastic.multiprocessing import api  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402
from torch.distributed.elastic.rendezvous import RendezvousConnectionError  # noqa: E402
from torch.distributed.launcher import api as launcher  # noqa: E402

STOPPED, USER_ERROR = 130, 2  # the exit codes of diloco.train


class _Agent(launcher.LocalElasticAgent):
    """torchrun's agent, kept where main() reads its ranks' exit codes when the rendezvous store is gone
    (node 0's launch ended first, or died): a torchrun of its own has no result to report then."""

    started: list[_Agent] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _Agent.started.append(self)

    @classmethod
    def exit_codes(cls) -> set[int | None]:
        pcontext = cls.started[-1]._pcontext if cls.started else None
        return {h.proc.returncode for h in getattr(pcontext, "subprocess_handlers", {}).values()}


def _ours(codes: set) -> int | None:
    """130 or 2 when the ranks ended so (each said why). torchrun ends the other ranks (SIGTERM, then
    SIGKILL) as soon as one exits: whichever got there first may be the only one that said why."""
    for ours in (STOPPED, USER_ERROR):
        if ours in codes and codes <= {ours, -signal.SIGTERM, -signal.SIGKILL}:
            return ours
    return None


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
    """Drops torchrun's "failed (exitcode: 130|2) local_rank: ..." line (the rank said why itself), its
    "Sending process N closing signal" lines (ending the other ranks is routine; a real failure still
    ends in torchrun's own report) and the rendezvous's warnings that node 0's store is gone (main()
    says so in one line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        expected = msg.startswith("failed (exitcode") and record.args
        gone = ("has failed to shutdown the rendezvous", "has failed to send a keep-alive heartbeat")
        routine = msg.startswith("Sending process") or any(g in msg for g in gone)  # node 0's store died
        return not (expected and record.args[0] in (STOPPED, USER_ERROR)) and not routine


def main(argv: list[str] | None = None) -> int:
    # looked up when torchrun starts the ranks (PContext.start), so replacing it here is enough
    api._terminate_process_handler = _quiet_on_stop(api._terminate_process_handler)
    for name in (api.__name__, "torch.distributed.elastic.rendezvous.dynamic_rendezvous"):
        logging.getLogger(name).addFilter(_ExpectedExits())
    os.environ.pop("TORCH_CPP_LOG_LEVEL", None)  # what the ranks inherit
    if _RANKS_CPP_LOG_LEVEL is not None:
        os.environ["TORCH_CPP_LOG_LEVEL"] = _RANKS_CPP_LOG_LEVEL
    os.environ["DILOCO_LAUNCHER_PID"] = str(os.getpid())
    launcher.LocalElasticAgent = _Agent  # what torchrun's launch_agent builds
    args = torchrun.parse_args(argv)
    try:
        torchrun.run(args)
    except api.SignalException:
        return STOPPED
    except RendezvousConnectionError:  # the agent has stopped its ranks by now
        if (code := _ours(_Agent.exit_codes())) is not None:
            return code  # node 0 ended with the run (a user error, a stop): the ranks said why
        where = args.rdzv_endpoint or "node 0"
        print(
            f"error: the rendezvous store at {where} is gone (node 0 died or is unreachable)", file=sys.stderr
        )
        return USER_ERROR
    except ChildFailedError as e:
        if (code := _ours({f.exitcode for f in e.failures.values()})) is not None:
            return code
        raise
    return 0


def _exit_now(code: int) -> None:
    """Ends this process without the interpreter's teardown. After a run, torch's C++ teardown here
    sometimes aborts ("terminate called without an active exception", exit 134; about 1 stop in 30 on
    2 CPU cores) when a native thread outlives its owner. The ranks have ended by now and said why, so
    nothing is lost by skipping it: the output is flushed and the exit code is the run's."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main())
