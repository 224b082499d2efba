"""``train-drafter --report-to tensorboard|wandb``: each step's metrics logged there too, beside the progress bar and
``--metrics-csv``, under Trainer's names (``train/loss``, ...). Rank 0 reports; the packages are optional extras."""

import os

# the metrics of each step, as the loop computes them (``step`` is the x axis)
LOGGED = ("loss", "accuracy", "candidate_coverage", "lr", "tokens_per_s", "step_s", "capture_s", "peak_gib")


class _TensorBoard:
    def __init__(self, output_dir: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(output_dir, "runs"))
        self.writer.add_text("args", "\n".join(f"{key}: {value}" for key, value in sorted(config.items())))

    def log(self, metrics: dict) -> None:
        for key in LOGGED:
            self.writer.add_scalar(f"train/{key}", metrics[key], metrics["step"])

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, output_dir: str, config: dict):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(dir=output_dir, config=config, job_type="train-drafter")

    def log(self, metrics: dict) -> None:
        self.run.log({f"train/{key}": metrics[key] for key in LOGGED}, step=metrics["step"])

    def close(self) -> None:
        self.run.finish()


REPORTERS = {"tensorboard": _TensorBoard, "wandb": _WandB}


def open_reporter(report_to: str, output_dir: str, args) -> object | None:
    """The reporter ``--report-to`` names (None for ``none``), its run's settings being the arguments' plain values."""
    if report_to in (None, "none"):
        return None
    config = {key: value for key, value in vars(args).items() if isinstance(value, (bool, int, float, str, list))}
    os.makedirs(output_dir, exist_ok=True)
    return REPORTERS[report_to](output_dir, config)
