from tessera.config.manager import ConfigError, help_text, markdown_reference, parse_args, to_toml
from tessera.config.sections import JobConfig

__all__ = ["ConfigError", "JobConfig", "help_text", "markdown_reference", "parse_args", "to_toml"]
