"""Pauses a rank at a named point of a checkpoint write, so a test can kill a node there (test-only).

Put on PYTHONPATH with DILOCO_TEST_PAUSE="<point>:<rank>:<min_step>:<folder>"; Python imports this file at
start-up. The rank whose RANK is <rank> stops at <point> of the first checkpoint of a step >= <min_step>,
writes `<folder>/paused-step<S>-launcher<PID>` (its node's launch_ranks.py) and waits until `<folder>/go` exists,
then goes on. Points: `rank-file` (before this rank writes its file), `meta` (all rank files written,
before rank 0 marks the checkpoint complete), `prune` (marked complete, before the old ones are pruned and
the ranks leave together). Events are files: the test waits for the marker, kills, then writes `go`.
"""

import os
import sys
import time

_SPEC = os.environ.get("DILOCO_TEST_PAUSE")


def _install(spec: str) -> None:
    point, rank, min_step, folder = spec.split(":", 3)
    if os.environ.get("RANK") != rank:
        return
    import diloco.checkpoint as ckpt

    seen = {"step": -1}  # the step of the checkpoint being written (from this rank's file's path)

    def pause_at(here: str, step: int) -> None:
        if here != point or step < int(min_step) or os.path.exists(f"{folder}/released"):
            return
        open(f"{folder}/paused-step{step}-launcher{os.environ['DILOCO_LAUNCHER_PID']}", "w").close()
        while not os.path.exists(f"{folder}/go"):
            time.sleep(0.05)  # waiting on the test's file, which it writes after its kill
        open(f"{folder}/released", "w").close()

    def paused(original, here: str):
        def run(*args, **kwargs):
            if here == "rank-file":
                seen["step"] = _step_of(args[0])
            pause_at(here, seen["step"])
            return original(*args, **kwargs)

        return run

    ckpt.write_atomic_with = paused(ckpt.write_atomic_with, "rank-file")  # module globals: save() calls these
    ckpt.write_atomic = paused(ckpt.write_atomic, "meta")
    ckpt.prune = paused(ckpt.prune, "prune")


def _step_of(path) -> int:
    """The step of a checkpoint file's path (.../checkpoints/step_00000009/rank0.pt)."""
    return int(os.path.basename(os.path.dirname(str(path)))[len("step_") :])


class _AfterImport:
    """Installs the pause once diloco.checkpoint is imported (this file runs before anything else)."""

    def find_spec(self, name, path=None, target=None):
        if name != "diloco.checkpoint":
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        loader = spec.loader
        run_module = loader.exec_module

        def exec_module(module):
            run_module(module)
            sys.modules[name] = module
            _install(_SPEC)

        loader.exec_module = exec_module
        return spec


if _SPEC:
    sys.meta_path.insert(0, _AfterImport())
