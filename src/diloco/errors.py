"""The project's two user-facing errors, in a module that imports nothing of the project: every layer may
raise them (config checks, the distributed set-up, DumbDiLoCo's nodes) without importing `config`."""


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and the problem."""


class RunError(RuntimeError):
    """A run that cannot go on for a reason outside its config (an unreachable or foreign repository, a
    refused token, a stopped peer, an unreadable state file): one readable line, printed without a
    traceback."""
