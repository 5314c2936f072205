"""A DumbDiLoCo node's counters: what it did so far, for its metrics, its summary and its checkpoint.

Invariant: the counters are exactly these fields (a misspelt one is an AttributeError, never a new metric);
a checkpoint stores them by field name and loads them back field by field, each cast to its field's type.
Prose: docs/dumb_diloco.md ("Metrics").
"""

import dataclasses
from dataclasses import dataclass, fields


@dataclass
class Counters:
    installs: int = 0  # globals installed into the live model
    uploads: int = 0  # deltas uploaded
    upload_failures: int = 0
    skipped_boundaries: int = 0  # boundaries that captured nothing (an upload in flight, or the snapshot cap)
    poll_failures: int = 0
    boundaries: int = 0
    rejected_globals: int = 0  # globals that failed validation or did not fit this model
    bytes_uploaded: int = 0
    bytes_downloaded: int = 0
    stall_seconds: float = 0.0  # the training thread's time inside the node, every step
    boundary_stall_seconds: float = 0.0  # the same, at boundaries only

    def state_dict(self) -> dict[str, int | float]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's values where it has them (an older checkpoint may lack some), in place: the
        node's parts that count (uploader, poller, stall meter) hold these counters."""
        values = dataclasses.asdict(self)
        for f in fields(self):
            if f.name in state:
                values[f.name] = f.type(state[f.name])
        self.__init__(**values)  # the same object, every field set again
