"""Training raises the offline acceptance length, natively and along the Liger path with the fused objective.

A tiny drafter trains natively for 300 steps on a tiny random target's greedy continuations (``tiny_acceptance``);
its offline acceptance length on held-out prompts must rise well above the untrained drafter's (1.0: an untrained
drafter's proposals are almost never the target's; trained, about 3 of the block's 4). On a CPU the Liger kernels run
in Triton's interpreter, about 5 s per step of this drafter, so the Liger path cannot train those 300 steps here: from
the trained state (weights and AdamW state) both paths take the same further steps on the same batches, with the same
per-step losses, and the offline acceptance lengths of the two results must stay well above the untrained drafter's
and agree within ``ACCEPTANCE_TOLERANCE``. The whole comparison from scratch at real widths is
``benchmark/bench_drafter_acceptance.py`` (GPU).
"""

import copy

import pytest
import torch

from liger_dspine import apply_liger_kernel_to_dspine
from liger_dspine.drafter_training.evaluation import offline_acceptance
from tiny_acceptance import STEPS
from tiny_acceptance import drafter_config
from tiny_acceptance import objective_of
from tiny_acceptance import one_thread
from tiny_acceptance import train
from tiny_acceptance import trained_drafter
from tiny_dspine import seeded_draft

# The rise that counts as "well above" the untrained drafter (block 4: at most 3 more tokens per block).
RISE = 1.0
# Two drafters from the same state after the same steps: a block of the 120 held-out ones may accept one token more
# or less where a candidate's score is within the two paths' rounding of the runner-up's (fp32, ~1e-6): 1/120 per
# block, five blocks' worth.
ACCEPTANCE_TOLERANCE = 0.05
# fp32 losses of the eager and the fused objective, Liger and native modules (dspine.md section 7.4: 2e-5).
LOSS_TOLERANCE = 2e-5
FURTHER_STEPS = 2


def acceptance(draft, target, sequences) -> dict[str, float]:
    return {name: stats.mean_acceptance_length for name, stats in offline_acceptance(draft, target, sequences).items()}


@pytest.fixture(scope="module")
def untrained_and_trained():
    target, draft, optimizer_state, batches, sequences = trained_drafter()
    untrained = acceptance(seeded_draft(target, drafter_config(), seed=0), target, sequences)
    return target, draft, optimizer_state, batches, sequences, untrained


def test_native_training_raises_the_offline_acceptance_length(untrained_and_trained):
    target, draft, _, _, sequences, untrained = untrained_and_trained
    trained = acceptance(draft, target, sequences)
    assert untrained["refined"] < 1.05 and untrained["plain"] < 1.05, untrained
    assert trained["refined"] > untrained["refined"] + RISE, (trained, untrained)
    assert trained["plain"] > untrained["plain"] + RISE, (trained, untrained)


def further_training(draft, target, optimizer_state, batches, liger: bool):
    draft = copy.deepcopy(draft).train()
    optimizer = torch.optim.AdamW(draft.parameters())
    optimizer.load_state_dict(copy.deepcopy(optimizer_state))  # the steps update its tensors in place
    objective = objective_of(draft, target, fused_objective=liger)
    objective.num_anchors = 4  # one row, four blocks a step: the interpreter's cost is per row
    if liger:
        report = apply_liger_kernel_to_dspine(model=objective)
        assert "LigerRMSNorm" in str(report) and "LigerSwiGLUMLP" in str(report)
    one_row = [{key: value[:1] for key, value in batch.items()} for batch in batches]
    torch.manual_seed(11)  # the same anchor draws on both paths
    with one_thread():
        losses = train(objective, optimizer, one_row, STEPS, FURTHER_STEPS, STEPS + FURTHER_STEPS)
    native = seeded_draft(target, drafter_config(), seed=0)  # evaluated with the native modules: the weights count
    native.load_state_dict(draft.state_dict())
    return native.eval(), losses


def test_liger_path_with_the_fused_objective_trains_as_the_native_path(untrained_and_trained):
    target, draft, optimizer_state, batches, sequences, untrained = untrained_and_trained
    native, native_losses = further_training(draft, target, optimizer_state, batches, liger=False)
    liger, liger_losses = further_training(draft, target, optimizer_state, batches, liger=True)
    torch.testing.assert_close(torch.tensor(liger_losses), torch.tensor(native_losses), atol=LOSS_TOLERANCE, rtol=1e-4)
    native_acceptance, liger_acceptance = acceptance(native, target, sequences), acceptance(liger, target, sequences)
    for name in ("refined", "plain"):
        assert native_acceptance[name] > untrained[name] + RISE, (native_acceptance, untrained)
        assert liger_acceptance[name] > untrained[name] + RISE, (liger_acceptance, untrained)
        assert abs(liger_acceptance[name] - native_acceptance[name]) <= ACCEPTANCE_TOLERANCE, (
            liger_acceptance,
            native_acceptance,
        )
