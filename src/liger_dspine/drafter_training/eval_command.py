"""``liger-dspine eval-drafter``: a drafter folder, its target and a held-out dataset -> the acceptance report."""

import logging
import sys

import torch

from liger_dspine.drafter_training import data
from liger_dspine.drafter_training import eval_report
from liger_dspine.drafter_training import setup
from liger_dspine.drafter_training.eval_options import EvalDrafterOptions
from liger_dspine.drafter_training.eval_options import fail
from liger_dspine.drafter_training.evaluation import build_eval_set
from liger_dspine.drafter_training.evaluation import end_to_end_acceptance
from liger_dspine.drafter_training.evaluation import offline_acceptance
from liger_dspine.drafter_training.evaluation import prompt_of

logger = logging.getLogger(__name__)


def load_drafter(folder: str, device, dtype, liger: bool):
    """The drafter of ``folder`` (checked against its config first), in eval mode; patched with ``liger``."""
    from liger_dspine import apply_liger_kernel_to_dspine
    from liger_dspine.models.dspine.checkpoint import check_checkpoint
    from liger_dspine.models.dspine.modeling import DSpineDraftModel

    report = check_checkpoint(folder)
    if not report.ok:
        fail(f"{folder} is not a drafter this package loads: {'; '.join(report.problems)}")
    from transformers.utils import logging as transformers_logging

    bar = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()  # errors and the report stay one line each
    try:
        draft = DSpineDraftModel.from_pretrained(folder).to(device=device, dtype=dtype).eval()
    finally:
        if bar:
            transformers_logging.enable_progress_bar()
    if not bool(draft.transfer_ready):
        fail(f"the drafter of {folder} has no transfer space (transfer_ready is False): it was saved before training")
    if liger:
        apply_liger_kernel_to_dspine(model=draft)
    return draft


def _device_and_dtype(name: str):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(name)
    return device, dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)


def evaluate_drafter(options: EvalDrafterOptions) -> dict:
    """The report's columns: offline and (``end_to_end``) end-to-end acceptance, refined and plain."""
    from liger_dspine.models.dspine.configuration import DSpineDraftConfig
    from liger_dspine.models.dspine.target_fit import check_drafter_fits_target

    vocab = DSpineDraftConfig.from_pretrained(options.drafter).vocab_size
    outside = [stop for stop in options.stop_token_ids if stop >= vocab]
    if outside:
        fail(f"--stop-token-ids {outside} lie outside the drafter's vocabulary [0, {vocab})")
    device, dtype = _device_and_dtype(options.dtype)
    draft = load_drafter(options.drafter, device, dtype, options.liger)
    target = setup.build_target(options, device, dtype)
    check_drafter_fits_target(draft, target)
    tokenizer = data.TokenizerSource(options.tokenizer or options.target)
    documents = data.read_documents(options.dataset, tokenizer, vocab, draft.mask_token_id)
    documents = documents[: options.max_prompts]
    sequences = build_eval_set(
        target, documents, draft.target_layer_ids, draft.block_size, options.max_prompt_length, options.new_tokens
    )
    offline = offline_acceptance(draft, target, sequences)
    end_to_end = None
    if options.end_to_end:
        prompts = [prompt_of(ids, mask, options.max_prompt_length).to(device) for ids, mask in documents]
        end_to_end = end_to_end_acceptance(draft, target, prompts, options.new_tokens, options.stop_token_ids)
    return eval_report.columns(offline, end_to_end)


def run(options: EvalDrafterOptions) -> int:
    """Evaluate, print the table (and write the files of ``output_dir``); returns an exit status."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    report = evaluate_drafter(options)
    print(f"acceptance of {options.drafter} on {options.dataset}:")
    print(eval_report.table(report))
    if options.output_dir:
        for line in eval_report.write(report, options.output_dir, f"DSpine drafter {options.drafter}"):
            print(line)
    return 0


def main(args) -> int:
    """``eval-drafter`` from parsed arguments: a bad argument or input is one line on stderr and exit status 2."""
    from liger_dspine.drafter_training.eval_options import from_namespace

    try:
        return run(from_namespace(args))
    except ValueError as error:
        if not str(error).startswith(("liger-dspine:", "DSpine ")):  # the drafter config's own checks name DSpine
            raise
        print(error if str(error).startswith("liger-dspine:") else f"liger-dspine: {error}", file=sys.stderr)
        return 2
