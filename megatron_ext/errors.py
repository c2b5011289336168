"""The one error type for bad configuration: the message names the key and what is allowed."""


class ConfigError(ValueError):
    """A bad key or value in a config file, on the command line, or in a model config."""
