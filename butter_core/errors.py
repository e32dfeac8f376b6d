"""Exceptions butter raises for bad input. Each message names what was wrong and what is valid."""


class ButterError(Exception):
    """Base class of every error butter raises on purpose."""


class ConfigError(ButterError, ValueError):
    """A configuration value (a cache kind, an eviction policy, a load option) is invalid."""


class UnknownSchemeError(ConfigError):
    """A KV cache scheme was asked for that no installed plugin provides."""


class AmbiguousSchemeError(ConfigError):
    """A scheme name, CLI string or eviction that more than one installed plugin claims."""


class PluginError(ButterError):
    """A plugin could not be loaded or registered, or its code failed (the message names its distribution)."""


class ModelLoadError(ButterError):
    """A model, its weights, its config or its tokenizer could not be loaded."""


class ChatTemplateError(ButterError, ValueError):
    """A model's chat template rejected the messages, or failed to render them."""


class ButterWarning(UserWarning):
    """Something butter accepted but that the user should know about (a context beyond what the model was trained on)."""
