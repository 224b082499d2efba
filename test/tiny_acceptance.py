"""A tiny drafter trained on a tiny random target's own greedy continuations (what its acceptance is measured on).

The target is the tiny random Qwen3 with its attention outputs scaled by ``ATTENTION_SCALE``: its next token is then
mostly a fixed random function of the current one (a little of the context still counts), so its greedy
continuations walk a random map into short cycles, and a few hundred native fp32 steps on the CPU (a few seconds)
raise the drafter's acceptance length from about 1 to about 3 of the block's 4. The trained drafter is built once per
test process (:func:`trained_drafter`).
"""

import contextlib
import copy
import functools

import torch

from liger_dspine.drafter_training.evaluation import EvalSequence
from liger_dspine.models.dspine import DSpineObjective
from liger_dspine.models.dspine.capture import TargetCapture
from tiny_dspine import TINY_MASK_TOKEN
from tiny_dspine import seeded_draft
from tiny_dspine import tiny_draft_config
from tiny_dspine import tiny_target

PROMPT = 4
CONTINUATION = 28
TRAIN_ROWS = 64
ROWS_PER_STEP = 2
EVAL_ROWS = 6
EVAL_ANCHORS = 20
STEPS = 300
LR = 2e-2
ATTENTION_SCALE = 0.2


def drafter_config():
    """The tiny drafter without the alignment ramp (its weight is at its final value from step 0)."""
    return tiny_draft_config(
        dspine_config={"transfer_rank": 8, "message_size": 4, "top_k": 3, "alignment_warmup_steps": 0}
    )


def mostly_bigram_target():
    """The tiny random Qwen3 target with its attention outputs scaled by ``ATTENTION_SCALE``."""
    target = tiny_target()
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(ATTENTION_SCALE)
    return target


def random_prompts(rows: int, length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY_MASK_TOKEN, (rows, length), generator=generator)


@torch.no_grad()
def continued(target, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """[R, S + new_tokens]: the target's greedy continuations (equal-length prompts, no padding, no stop token)."""
    return target.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),  # no padding: a token equal to the pad id is not masked
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )


def training_batches(target, target_layer_ids) -> list[dict]:
    """The objective's inputs of every training micro-batch, captured once (the target is frozen)."""
    rows = continued(target, random_prompts(TRAIN_ROWS, PROMPT, seed=1), CONTINUATION)
    capture = TargetCapture(target, target_layer_ids)
    return [capture(rows[i : i + ROWS_PER_STEP]) for i in range(0, TRAIN_ROWS, ROWS_PER_STEP)]


def eval_sequences(target, target_layer_ids, block_size: int) -> list[EvalSequence]:
    """Held-out prompts (another seed) continued greedily; each continuation position anchors a full block."""
    rows = continued(target, random_prompts(EVAL_ROWS, PROMPT, seed=2), EVAL_ANCHORS + block_size - 1)
    capture = TargetCapture(target, target_layer_ids)
    return [EvalSequence(row, PROMPT, EVAL_ANCHORS, capture(row[None])["hidden_states"]) for row in rows]


def objective_of(draft, target, **kwargs) -> DSpineObjective:
    return DSpineObjective(draft, target.lm_head, target.model.embed_tokens, num_anchors=16, **kwargs).train()


def train(objective, optimizer, batches: list[dict], first_step: int, steps: int, total_steps: int) -> list[float]:
    """``steps`` AdamW steps from ``first_step``, batch ``step % len(batches)``; returns each step's loss."""
    losses = []
    draft = objective.draft_model
    for step in range(first_step, first_step + steps):
        output = objective(**batches[step % len(batches)], global_step=step, total_steps=total_steps)
        output.loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(output.loss.detach()))
    return losses


@contextlib.contextmanager
def one_thread():
    """Tiny ops run several times faster on one thread than on two a busy machine shares."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@functools.lru_cache(maxsize=1)
def trained_drafter():
    """(target, drafter trained natively for STEPS steps, a copy of its AdamW state dict, training batches, eval
    sequences)."""
    target = mostly_bigram_target()
    config = drafter_config()
    draft = seeded_draft(target, config, seed=0)
    with one_thread():
        batches = training_batches(target, config.target_layer_ids)
        torch.manual_seed(3)
        optimizer = torch.optim.AdamW(draft.parameters(), lr=LR)
        train(objective_of(draft, target), optimizer, batches, 0, STEPS, STEPS)
        sequences = eval_sequences(target, config.target_layer_ids, config.block_size)
    state = copy.deepcopy(optimizer.state_dict())  # load_state_dict shares its tensors, and steps update them in place
    return target, draft.eval(), state, batches, sequences
