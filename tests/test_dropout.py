"""kernels.dropout: the native hashed mask against what dropout must be."""

from __future__ import annotations

import pytest
import torch

from genrec.kernels import dropout as D
from genrec.models.dropout import Dropout
from tests.conftest import kernel_or_skip


@pytest.fixture
def built() -> None:
    kernel_or_skip(D._passes(), "dropout.cpp")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_training_step_draws_its_masks_natively_not_value_by_value(built, monkeypatch, dtype):
    # PyTorch's generator drew every mask value (rand_like); the native pass draws one seed a call.
    # bf16: what the HSTU layers' gate hands its dropout under autocast
    def refuse(*a, **k):
        raise AssertionError("a mask drawn with torch.rand_like")

    monkeypatch.setattr(torch, "rand_like", refuse)
    x = torch.randn(300, 64, dtype=dtype).requires_grad_()
    y = Dropout(0.2).train()(x)
    y.sum().backward()
    assert (y == 0).any() and (x.grad == 0).any()


@pytest.mark.parametrize("p", [0.05, 0.2, 0.5, 0.9])
def test_each_element_is_kept_with_one_minus_p_independently_of_its_neighbours(built, p):
    torch.manual_seed(1)
    n = 1 << 20
    kept = (D.dropout(torch.ones(n), p) != 0).float()
    sd = (p * (1 - p) / n) ** 0.5
    assert abs(kept.mean().item() - (1 - p)) < 5 * sd
    # the two halves of one hash (elements j, j + 8 of a round of 16) and the next element:
    # their keep decisions uncorrelated
    rounds = kept.view(-1, 16)
    for a, b in ((rounds[:, :8], rounds[:, 8:]), (kept[:-1], kept[1:])):
        corr = torch.corrcoef(torch.stack([a.reshape(-1), b.reshape(-1)]))[0, 1].item()
        assert abs(corr) < 5 / (a.numel() ** 0.5)
    # every position of a round kept at the same rate (no lane is biased)
    lane = rounds.mean(0)
    assert (lane - (1 - p)).abs().max().item() < 5 * (p * (1 - p) / rounds.shape[0]) ** 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 1001])
def test_the_backward_pass_redraws_the_forward_mask_and_a_seed_repeats_it(built, n, dtype):
    x = torch.randn(n, dtype=dtype).requires_grad_()
    torch.manual_seed(7)
    y = D.dropout(x, 0.3)
    g = torch.randn(n, dtype=dtype)
    y.backward(g)
    kept = y != 0
    assert D.native_supported(x)
    torch.testing.assert_close(y[kept], (x[kept].float() / 0.7).to(dtype))  # bf16: rounded once, as PyTorch's
    torch.testing.assert_close(x.grad, torch.where(kept, (g.float() / 0.7).to(dtype), torch.zeros((), dtype=dtype)))
    torch.manual_seed(7)
    assert torch.equal(D.dropout(x, 0.3), y)  # the same seed: the same mask (a resumed run)
    assert not torch.equal(D.dropout(x, 0.3) != 0, kept) or n < 8  # the next call: another mask


def test_tensors_the_pass_does_not_take_fall_back_to_pytorch():
    torch.manual_seed(0)
    for x in (torch.randn(64, 32).t(), torch.randn(500, dtype=torch.float64), torch.randn(500).half()):
        assert not D.native_supported(x)
        y = D.dropout(x, 0.25)
        kept = y != 0
        torch.testing.assert_close(y[kept], x[kept] / 0.75)
        assert 0.5 < kept.float().mean().item() < 0.95
    x = torch.randn(500)
    y = D.dropout(x.clone(), 0.25, inplace=True)
    assert ((y == 0) | torch.isclose(y, x / 0.75)).all()
