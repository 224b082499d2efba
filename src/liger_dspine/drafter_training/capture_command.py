"""``liger-dspine capture``: the target's taps of every training row, written once for ``train-drafter --taps``.

Its target, data and row options are ``train-drafter``'s (the same rows in the same order follow from the same
values); they are parsed into :class:`CaptureOptions` and checked before anything is loaded.
"""

import argparse
import os
import sys
from dataclasses import dataclass
from dataclasses import fields

# The CPU-sized preset: train-drafter --tiny's target, rows and taps.
TINY = dict(target_config="tiny", seq_len=32, target_layer_ids="0,1", dtype="float32")
STATED_DEFAULTS = {
    "target": "none; give it or --target-config",
    "target_config": "none; give it or --target",
    "dataset": "the embedded demo text, as bytes",
    "tokenizer": "the --target folder",
    "target_layer_ids": "required; --tiny: 0,1",
    "mask_token_id": "0 with the embedded text; required with --dataset",
    "seq_len": "2048; --tiny: 32",
    "output_dir": "required",
    "dtype": "auto, bfloat16 on CUDA and float32 on a CPU",
}


@dataclass
class CaptureOptions:
    output_dir: str
    target_layer_ids: list[int]
    target: str | None = None
    target_config: str | None = None
    target_layers: int | None = None
    dataset: str | None = None
    tokenizer: str | None = None
    seq_len: int = 2048
    mask_token_id: int | None = None
    rows_per_shard: int = 64
    batch_size: int = 1
    liger: bool = True
    dtype: str = "auto"
    seed: int = 0

    def __post_init__(self):
        def fail(message):
            raise ValueError(f"liger-dspine: {message}")

        if bool(self.target) == bool(self.target_config):
            fail("capture needs the target: --target FOLDER or --target-config tiny|CONFIG.json (one), or --tiny")
        if self.target and not os.path.isdir(self.target):
            fail(f"--target {self.target!r} is not a folder")
        if self.target_config and self.target_config != "tiny" and not os.path.isfile(self.target_config):
            fail(f"--target-config {self.target_config!r} is neither 'tiny' nor a config file")
        if self.dataset is not None and not os.path.isfile(self.dataset):
            fail(f"--dataset {self.dataset!r} is not a file")
        if self.dataset is not None and self.mask_token_id is None:
            fail("a --dataset needs --mask-token-id (the drafter's mask token, which its lines must not hold)")
        if not self.target_layer_ids:
            fail("capture needs --target-layer-ids (the drafter's taps)")
        for name in ("seq_len", "rows_per_shard", "batch_size", "target_layers"):
            value = getattr(self, name)
            if value is not None and value < 1:
                fail(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if os.path.isdir(self.output_dir) and os.listdir(self.output_dir):
            fail(f"--output-dir {self.output_dir!r} exists and is not empty")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="the target's checkpoint folder")
    parser.add_argument("--target-config", help="random weights from a config ('tiny' or a config.json), seeded")
    parser.add_argument("--target-layers", type=int, help="override num_hidden_layers of --target-config")
    parser.add_argument("--dataset", help="JSONL, as train-drafter reads it")
    parser.add_argument("--tokenizer", help="tokenizer folder for chat messages")
    parser.add_argument("--seq-len", type=int, help="tokens per packed row (train-drafter's --seq-len)")
    parser.add_argument("--target-layer-ids", help="comma-separated target layers to tap (the drafter's taps)")
    parser.add_argument("--mask-token-id", type=int, help="the drafter's mask token id")
    parser.add_argument("--output-dir", required=True, help="the folder of the shards and index.json (new or empty)")
    parser.add_argument("--rows-per-shard", type=int, default=64, help="rows per safetensors shard")
    parser.add_argument("--batch-size", type=int, default=1, help="rows per target forward")
    parser.add_argument("--liger", action=argparse.BooleanOptionalAction, default=True, help="patch the target")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto", help="the taps' dtype")
    parser.add_argument("--seed", type=int, default=0, help="seed of a --target-config target's random weights")
    parser.add_argument("--tiny", action="store_true", help="train-drafter --tiny's target, rows and taps")


def from_namespace(args: argparse.Namespace) -> CaptureOptions:
    values = {f.name: getattr(args, f.name) for f in fields(CaptureOptions) if hasattr(args, f.name)}
    if args.tiny:
        values.update({key: value for key, value in TINY.items() if values.get(key) in (None, "auto")})
    taps = values.get("target_layer_ids") or ""
    try:
        values["target_layer_ids"] = [int(i) for i in taps.split(",") if i.strip()]
    except ValueError:
        raise ValueError(f"liger-dspine: --target-layer-ids must be comma-separated integers, got {taps!r}") from None
    if values.get("seq_len") is None:
        values["seq_len"] = 2048
    if values.get("dataset") is None and values.get("mask_token_id") is None:
        values["mask_token_id"] = 0  # the NUL byte, never in the embedded text
    return CaptureOptions(**values)


def run(options: CaptureOptions) -> int:
    from liger_dspine.drafter_training import setup
    from liger_dspine.drafter_training.eval_command import _device_and_dtype
    from liger_dspine.drafter_training.offline_taps import packed_rows
    from liger_dspine.drafter_training.offline_taps import write_taps

    device, dtype = _device_and_dtype(options.dtype)
    target = setup.build_target(options, device, dtype)
    layers = target.config.get_text_config().num_hidden_layers
    outside = [i for i in options.target_layer_ids if not 0 <= i < layers]
    if outside:
        raise ValueError(f"liger-dspine: --target-layer-ids {outside} lie outside the target's layers [0, {layers})")
    vocab = target.get_output_embeddings().weight.shape[0]
    rows = packed_rows(
        options.dataset, options.tokenizer or options.target, options.seq_len, vocab, options.mask_token_id
    )
    summary = write_taps(
        target, rows, options.target_layer_ids, options.output_dir, options.rows_per_shard, options.batch_size,
        options.mask_token_id,
    )  # fmt: skip
    print(
        f"captured {summary.rows} rows ({summary.tokens} tokens) into {summary.shards} shards in {options.output_dir}: "
        f"{summary.bytes / 2**20:.1f} MiB, {summary.bytes_per_token:.0f} bytes per token"
    )
    return 0


def main(args) -> int:
    """``capture`` from parsed arguments: a bad argument or input is one line on stderr and exit status 2."""
    try:
        return run(from_namespace(args))
    except ValueError as error:
        if not str(error).startswith("liger-dspine:"):
            raise
        print(error, file=sys.stderr)
        return 2
