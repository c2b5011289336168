"""The error types a user fixes by hand: bad configuration (the message names the key and what is allowed) and bad
data files (the message names the file and what is wrong). launch/train.py prints them as one line, no traceback."""


class ConfigError(ValueError):
    """A bad key or value in a config file, on the command line, or in a model config."""


class DataError(ValueError):
    """A missing, truncated or corrupt data or tokenizer file."""
