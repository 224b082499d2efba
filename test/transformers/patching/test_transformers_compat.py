"""The version helper reads each renamed attribute under its old and new names, and names what is missing."""

import pytest
import torch
from torch import nn

from liger_dspine.transformers_compat import cache_argument_name
from liger_dspine.transformers_compat import norm_epsilon


class _OldNorm(nn.Module):  # DeepseekV4UnweightedRMSNorm before transformers 5.25
    def __init__(self):
        super().__init__()
        self.eps = 1e-5


class _NewNorm(nn.Module):  # and from 5.25
    def __init__(self):
        super().__init__()
        self.variance_epsilon = 3e-6


def test_norm_epsilon_reads_either_name():
    assert norm_epsilon(_OldNorm()) == 1e-5
    assert norm_epsilon(_NewNorm()) == 3e-6


def test_norm_epsilon_of_installed_v4_norm_matches_its_forward():
    modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    norm = modeling.DeepseekV4UnweightedRMSNorm(eps=0.25)
    x = torch.randn(3, 8)
    eps = norm_epsilon(norm)
    expected = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    torch.testing.assert_close(norm(x), expected, rtol=0, atol=1e-6)
    assert eps == 0.25


def test_norm_without_epsilon_is_named():
    with pytest.raises(
        AttributeError, match=r"liger-dspine: Linear has no epsilon attribute \(variance_epsilon or eps\)"
    ):
        norm_epsilon(nn.Linear(2, 2))


def test_cache_argument_name():
    def new(self, hidden_states, cache=None): ...

    def old(self, hidden_states, past_key_values=None): ...

    def none(self, hidden_states): ...

    assert cache_argument_name(new) == "cache"
    assert cache_argument_name(old) == "past_key_values"
    with pytest.raises(TypeError, match="takes no cache argument"):
        cache_argument_name(none)
