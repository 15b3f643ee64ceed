"""Fields of the settings dataclasses (TrainConfig, DistillConfig): each carries its --help text, or names the
option other subcommands take (`shared`), so that options.py builds the command's flags from the dataclass."""

from __future__ import annotations

import dataclasses


def option(default, help: str, **extra):
    """A config field with its --help text; extra: required=True, choices=(...)."""
    return _field(default, {"help": help, **extra})


def head_option(default, help: str, **extra):
    """A field of the heads' architecture: `default` for new heads. It stays None until then, so that with
    --init-heads a flag left out (the saved heads' value) is told from one given equal to the default."""
    return _field(None, {"help": help, "head_default": default, **extra})


def head_defaults(cls) -> dict:
    """{field name: default for new heads} of `cls`'s head_option fields."""
    return {f.name: f.metadata["head_default"] for f in dataclasses.fields(cls) if "head_default" in f.metadata}


def shared(default, **extra):
    """A config field whose flag is medusa_spec.flags.FLAGS[its name], as other subcommands define it; extra:
    required=True, aliases=("--old-name",) (an old spelling of the flag, and of its recipe key, still accepted)."""
    return _field(default, {"shared": True, **extra})


def _field(default, metadata: dict):
    if isinstance(default, list):  # a fresh list per instance
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def typed(flag: str, value) -> str:
    """A setting as it is typed: --share-lm-head / --no-share-lm-head for a switch, else the flag and its value."""
    if isinstance(value, bool):
        return flag if value else flag.replace("--", "--no-", 1)
    return f"{flag} {value}"
