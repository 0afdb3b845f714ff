"""hfport's exceptions: each names what is wrong and where."""


class HfportError(Exception):
    """Base class of every error hfport raises on purpose."""


class ConfigError(HfportError, ValueError):
    """A config.json that is missing a field, has a bad value, or asks for an unsupported variant."""


class CheckpointError(HfportError, ValueError):
    """A weights file that is corrupt, truncated, unsafe, or does not fit the model."""


class ModelNotFoundError(HfportError, FileNotFoundError):
    """Neither a local folder nor a repo id in the local HF cache."""
