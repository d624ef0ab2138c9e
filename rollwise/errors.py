"""The error a user's settings raise, in a module of its own: the config, the device checks and
the task checks all raise it, and none of them needs to import another for it."""


class ConfigError(ValueError):
    """A config problem, phrased for the user."""
