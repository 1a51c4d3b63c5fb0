"""What each ``mode`` of the command line runs."""

from __future__ import annotations

import json

from omegaconf import DictConfig

from swarmkit.config.validate import to_dict


def run(cfg: DictConfig) -> int:
    if cfg.mode == "plan":
        print(json.dumps(to_dict(cfg), indent=2))
        return 0
    print("resolved configuration:")
    print(json.dumps(to_dict(cfg), indent=2))
    print(f"mode={cfg.mode}: not implemented yet")
    return 0
