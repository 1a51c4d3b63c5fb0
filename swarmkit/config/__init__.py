"""Configuration: dataclass schemas, Hydra composition and validation."""

from swarmkit.config.validate import validate_config

__all__ = ["validate_config"]
