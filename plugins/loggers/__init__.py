"""The built-in logger plugins: ``tensorboard``, ``wandb``, ``mlflow``.

Each module is a plugin of its own (an entry point each) on the lifecycle hooks:
it acts for the runs whose config lists its name in ``logger``, keyed by their
``run_dir``, and logs the same metric names as ``metrics.jsonl``. :mod:`.common`
holds what they share.
"""
