"""Configuration: where each setting's default lives and how a run's config is built.

- :mod:`.schema`: dataclasses of the core groups (``model``, ``task``,
  ``server``, ``trainer``) and of the whole config; components' groups are
  typed by the schema their plugin registers.
- :mod:`.compose`: Hydra composition of the packaged ``conf/`` (and plugins'
  search paths), for the command line and the controller API alike.
- :mod:`.validate`: every problem of a config reported at once, before
  anything heavy loads.
- :mod:`.plain`: a plain dict from a dict, dataclass or OmegaConf node.
"""
