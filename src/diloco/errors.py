"""The project's configuration error, in a module that imports nothing of the project: every layer may
raise it (config checks, the distributed set-up, DumbDiLoCo's settings) without importing `config`."""


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and the problem."""
