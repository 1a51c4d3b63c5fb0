"""How a sample becomes weights: the engine-agnostic training core.

- :mod:`.samples`: pool records → merged, advantage-labelled :class:`TrainSample` s.
- :mod:`.trainer`: :class:`Trainer`, what the server drives (engine, checkpoints).
- :mod:`.engine`: :class:`~swarmkit.training.engine.TrainingEngine`, the step loop the
  ``fsdp`` and ``deepspeed`` engines share (they add only the distributed parts).
- :mod:`.packing`, :mod:`.policy`, :mod:`.logprob`: micro-batch packing, the scoring
  model and its chunked logprob kernel.
- :mod:`.lora`: the one LoRA merge (peft's exact scaling), also used by the backends.
- :mod:`.group`, :mod:`.worker`: training in a torchrun group the server drives.

Importing this package does not import torch; the engine modules do.
"""

from swarmkit.contract.samples import TrainSample
from swarmkit.training.samples import build_samples
from swarmkit.training.trainer import CHECKPOINT_DIR, LATEST, Trainer, build_algo

__all__ = ["CHECKPOINT_DIR", "LATEST", "TrainSample", "Trainer", "build_algo", "build_samples"]
