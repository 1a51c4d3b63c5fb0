"""swarmkit's built-in plugins, installed as the package ``swarmkit_plugins``.

Each sub-package is registered through the entry-point group ``swarmkit``,
exactly like a third-party plugin. Their ``__init__`` modules are light: they
register import strings and config schemas, never the engines themselves.
"""
