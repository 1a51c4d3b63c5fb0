"""swarmkit's Hydra launcher plugin (Hydra only accepts plugins under ``hydra_plugins``)."""
