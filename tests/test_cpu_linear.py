"""oneDNN pre-packed linear: same products as F.linear (to rounding) on both sides of the row threshold."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model import cpu_linear
from pdserve.model.attention import SDPABackend
from pdserve.model.cpu_linear import OneDNNWeight, pack_model_linears, use_onednn
from pdserve.model.layers.linear import Embedding, Linear
from pdserve.model.native_ops import KernelSelection

pytestmark = pytest.mark.skipif(not cpu_linear.onednn_available(), reason="PyTorch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 7, cpu_linear.PACKED_MAX_ROWS, cpu_linear.PACKED_MAX_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    lin = nn.Linear(576, 200, bias=bias)
    x = torch.randn(rows, 576)
    torch.testing.assert_close(OneDNNWeight(lin.weight).forward(x, lin.bias), F.linear(x, lin.weight, lin.bias),
                               rtol=1e-5, atol=1e-5)


def test_pack_model_keeps_tied_weight_shared() -> None:
    kernels = KernelSelection(SDPABackend())
    model = nn.Module()
    model.embed = Embedding(100, 32, kernels)
    model.head = Linear(32, 100, False, kernels)
    model.head.weight = model.embed.weight
    model.block = nn.Sequential(Linear(32, 32, True, kernels), nn.ReLU())
    for p in model.parameters():
        nn.init.normal_(p)
    x = torch.randn(3, 32)
    want = model.block[0](x)
    pack_model_linears(model)
    assert isinstance(model.head.packed, OneDNNWeight) and isinstance(model.block[0].packed, OneDNNWeight)
    assert model.embed.weight is not None and model.head.packed.weight.data_ptr() == model.embed.weight.data_ptr()
    torch.testing.assert_close(model.block[0](x), want, rtol=1e-5, atol=1e-5)


def test_backend_choice() -> None:
    assert use_onednn("auto", torch.float32) and use_onednn("onednn", torch.float32)
    assert not use_onednn("auto", torch.bfloat16) and not use_onednn("torch", torch.float32)
    with pytest.raises(ValueError, match="float32"):
        use_onednn("onednn", torch.bfloat16)
    with pytest.raises(ValueError, match="linear_backend"):
        use_onednn("mkl", torch.float32)
