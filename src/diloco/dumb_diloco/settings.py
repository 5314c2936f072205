"""A DumbDiLoCo node's settings: the `distributed:` block on top of the typed schema
(diloco.schema.DumbDiLoCoConfig, keys and defaults), plus the error a node reports in one line. The one
checker is diloco.config's (`validate`, `check_distributed`): `Settings.of` takes a block it has checked
and does not check it again; `Settings.from_config` runs it on a raw block. Prose: docs/dumb_diloco.md
("Configuration").
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from diloco.config import check_distributed
from diloco.errors import ConfigError, RunError
from diloco.schema import DumbDiLoCoConfig

from .store.transport import RetryPolicy

log = logging.getLogger("diloco.dumb_diloco")


class DumbDiLoCoError(RunError):
    """A node that cannot take part or go on (unreachable repository, no master, a foreign global, a
    refused token): one readable line naming the node. A bad setting is a ConfigError instead."""


@dataclass
class Settings(DumbDiLoCoConfig):
    """The `distributed:` block of a DumbDiLoCo node (keys and defaults: diloco.schema). Built directly
    (tests, scripts) it is normalised, not checked: `diloco.config.check_dumb_diloco(s)` checks it."""

    def __post_init__(self) -> None:
        if not self.enabled:
            self.role = "single"
        if isinstance(self.collaborators, str) or not hasattr(self.collaborators, "__iter__"):
            raise ConfigError(_COLLABORATORS + f"got {self.collaborators!r}")
        self.collaborators = tuple(self.collaborators)
        self.repo_id = self.repo_id.strip() if isinstance(self.repo_id, str) else self.repo_id
        self.state_dir = str(self.state_dir)
        if not isinstance(self.retry, RetryPolicy):
            try:
                self.retry = RetryPolicy(**(self.retry if isinstance(self.retry, dict) else vars(self.retry)))
            except TypeError as err:
                raise ConfigError(f"distributed.retry: {err}") from None

    @classmethod
    def from_config(cls, dcfg: Any) -> Settings:
        """A raw config block (DictConfig or dict), typed and checked by diloco.config.check_distributed;
        raise ConfigError naming the key. The trainer's path is `of`, on the block validate checked."""
        if (mode := dcfg.get("mode", "dumb_diloco")) != "dumb_diloco":
            raise ConfigError(f"distributed.mode must be dumb_diloco here, got {mode!r}")
        if isinstance(dcfg, DictConfig):  # resolved within the whole config (state_dir: ${out_dir}/...)
            dcfg = OmegaConf.to_container(dcfg, resolve=True)
        if isinstance(dcfg.get("collaborators"), str):  # before OmegaConf turns the string away
            raise ConfigError(_COLLABORATORS + f"got {dcfg.get('collaborators')!r}")
        return cls.of(check_distributed({**dcfg, "mode": "dumb_diloco"}))

    @classmethod
    def of(cls, block: DumbDiLoCoConfig) -> Settings:
        """The settings of a typed block that diloco.config has checked (not checked again)."""
        s = cls(**asdict(block))  # every DumbDiLoCoConfig field (retry as a dict: __post_init__ types it)
        if s.token is not None and s.role != "single":
            log.warning(
                "distributed.token is set in the config: prefer the HF_TOKEN environment variable or "
                "`hf auth login`, and never commit a token to a config file (it is not logged or saved)"
            )
        return s

    @property
    def is_master(self) -> bool:
        return self.role == "master"

    def error(self, message: str) -> DumbDiLoCoError:
        return DumbDiLoCoError(f"{'master' if self.is_master else 'node'} {self.node_id}: {message}")


_COLLABORATORS = "distributed.collaborators must be a list of node IDs, e.g. '[worker-1,worker-2]', "
