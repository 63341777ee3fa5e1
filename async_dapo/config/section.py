"""What every config section shares: unknown keys are errors, assignments are validated, and a config
problem is one line naming its dotted key."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A config problem, formatted as one line: ``<dotted.key>: <problem>``."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
