"""``liger-dspine train-drafter``: a DSpine drafter trained against a frozen target whose taps are captured on the fly.

Run ``liger-dspine train-drafter --help`` for the arguments; ``--tiny`` is a CPU-sized run. Under ``torchrun`` it
trains with DDP (one gradient all-reduce per accumulation window), or shards the drafter and the frozen target
(``--drafter-parallel``, ``--target-parallel``: :mod:`~liger_dspine.drafter_training.parallel`).
"""


def run(args) -> int:
    """Resolve ``args`` (parsed with ``options.add_arguments``), train, return an exit status."""
    import logging
    import os

    from liger_dspine.drafter_training.loop import train_drafter
    from liger_dspine.drafter_training.options import resolve

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    history = train_drafter(resolve(args))
    if history and os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 reports
        last = history[-1]
        print(f"step {last['step']}: loss {last['loss']:.4f}, checkpoints in {args.output_dir}")
    return 0
