"""Every patched model of the DeepSeek family (test/tiny_family.py), a mini model trained natively and patched from
the same weights on the same batches: per-step losses, top-k log-probs after training, final weights.

fp32 runs every model on CUDA, and on a CPU (Triton's interpreter, 20-30 s a model) the two whose kernel variants
test_mini_deepseek_v3.py does not train: deepseek_v2 (softmax router, RoPE on pairs) and minicpm3 (RoPE on halves,
scaled head input). The others' fp32 parity on CPU is test/transformers/family's. bf16 runs on CUDA only (the
interpreter has no bf16). A model the installed transformers lacks is skipped.
"""

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_family import CASES  # noqa: E402
from tiny_models import train_on_batches  # noqa: E402

TOP_K = 5
CPU_SUBSET = ("deepseek_v2", "minicpm3")
STEPS = {torch.float32: 4, torch.bfloat16: 8}

# (loss atol/rtol, top-k log-prob atol, parameter atol/rtol), as in test_mini_deepseek_v3.py. fp32: kernels reorder
# fp32 sums (1e-6 level per op); AdamW divides each update by the gradient's running RMS, so where a gradient is near
# zero a 1e-7 difference moves a weight by a visible fraction of lr (1e-3): weights get 5e-5 absolute, or twice
# the distance between two native fp32 runs that differ only in their experts' summation order where that is more;
# a weight still further from native's must be no further than twice native's distance from an fp64 native run.
# bf16: 8 mantissa bits, activations rounded at every kernel boundary; a router score within rounding of its
# neighbour can pick another expert for a token, which moves that token's loss by about 1e-2 of its value.
TOLERANCES = {
    torch.float32: dict(loss=1e-5, logprob=1e-4, param_atol=5e-5, param_rtol=1e-4),
    torch.bfloat16: dict(loss=2e-2, logprob=1e-1, param_atol=2e-2, param_rtol=2e-2),
}


def train(model, batches, steps):
    return train_on_batches(model, batches, steps, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01))


def top_log_probs(model, input_ids):
    model.eval()
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=input_ids).logits.float(), dim=-1).topk(TOP_K, dim=-1).values


def check(model_type, dtype, device):
    case = CASES[model_type]
    native = case.build().to(device=device, dtype=dtype)
    patched = copy.deepcopy(native)
    case.apply_fn()(model=patched)
    generator = torch.Generator().manual_seed(7)
    vocab = native.config.get_text_config().vocab_size
    batches = [torch.randint(0, vocab, (2, 16), generator=generator).to(device) for _ in range(2)]
    native_losses = train(native, batches, STEPS[dtype])
    patched_losses = train(patched, batches, STEPS[dtype])
    # the same batches again: lower losses, else the comparison would be vacuous
    assert (native_losses[2:4] < native_losses[:2]).all(), f"the native run did not learn: {native_losses}"
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(patched_losses, native_losses, atol=tol["loss"], rtol=tol["loss"])
    native_lp, patched_lp = top_log_probs(native, batches[0]), top_log_probs(patched, batches[0])
    torch.testing.assert_close(patched_lp, native_lp, atol=tol["logprob"], rtol=0)
    floor = native_noise_floor(case, dtype, device, batches) if dtype == torch.float32 else {}
    exact = fp64_weights(case, device, batches) if dtype == torch.float32 else {}
    for (name, p_native), (_, p_patched) in zip(native.named_parameters(), patched.named_parameters()):
        atol = max(tol["param_atol"], 2 * floor.get(name, 0.0))
        if name in exact and not torch.allclose(p_patched.float(), p_native.float(), atol=atol, rtol=tol["param_rtol"]):
            # AdamW's noise where a gradient is near zero: judged against the fp64 run, no further from it than
            # twice what native fp32 is
            native_error = (p_native.double() - exact[name]).abs().max().item()
            patched_error = (p_patched.double() - exact[name]).abs().max().item()
            assert patched_error <= max(2 * native_error, tol["param_atol"]), (
                f"{name}: {patched_error:.2e} from the fp64 run, native fp32 {native_error:.2e}"
            )
            continue
        torch.testing.assert_close(
            p_patched.float(),
            p_native.float(),
            atol=atol,
            rtol=tol["param_rtol"],
            msg=lambda m, n=name, a=atol: f"{n} (atol {a:.2e}, native-vs-native {floor.get(n, 0.0):.2e}): {m}",
        )


def native_noise_floor(case, dtype, device, batches) -> dict[str, float]:
    """{name: max |difference|} between the native model trained with transformers' two implementations of its
    experts (grouped GEMMs and the per-expert loop): the same arithmetic summed in another order, so the distance
    that AdamW's normalisation alone puts between two correct fp32 runs. Empty where the model has one."""
    runs = []
    for implementation in ("grouped_mm", "eager"):
        model = case.build().to(device=device, dtype=dtype)
        try:
            model.set_experts_implementation(implementation)
        except (AttributeError, ValueError):  # a dense model (MiniCPM3)
            return {}
        train(model, batches, STEPS[dtype])
        runs.append(dict(model.named_parameters()))
    return {name: (p - runs[1][name]).abs().max().item() for name, p in runs[0].items()}


def fp64_weights(case, device, batches) -> dict[str, torch.Tensor]:
    """{name: weight} of the native model trained in fp64 (per-expert loop: grouped GEMMs take no fp64); empty
    where the model does not run in fp64."""
    model = case.build().to(device=device, dtype=torch.float64)
    try:
        model.set_experts_implementation("eager")
    except (AttributeError, ValueError):
        pass
    try:
        train(model, batches, STEPS[torch.float32])
    except (RuntimeError, NotImplementedError):
        return {}
    return {name: p.detach() for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    "model_type", [m if m in CPU_SUBSET else pytest.param(m, marks=pytest.mark.cuda) for m in sorted(CASES)]
)
def test_mini_family_fp32(model_type, device):
    check(model_type, torch.float32, device)


@pytest.mark.cuda
@pytest.mark.parametrize("model_type", sorted(CASES))
def test_mini_family_bf16(model_type):
    check(model_type, torch.bfloat16, "cuda")
