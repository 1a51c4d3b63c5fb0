"""Configuration: extra Hydra search-path entries shipped by plugins."""

from __future__ import annotations

from swarmkit.hookspecs import hookspec


@hookspec
def config_search_paths() -> list[str]:
    """Return Hydra search-path entries where this plugin ships config group options.

    Called once per command-line run, before Hydra composes the configuration.
    A plugin that ships ``conf/batching/c6.yaml`` inside its package returns
    ``["pkg://my_plugin.conf"]``. A component registered with a ``schema`` but
    no YAML option still gets one: its schema's defaults are stored as the
    option ``<kind>/<name>``.

    :returns: a list of search-path strings (``pkg://...`` or ``file://...``).
        Results of all implementations are concatenated.
    """
