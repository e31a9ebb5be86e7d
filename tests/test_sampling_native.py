"""The native sampler (csrc/sampling.cpp) on every ISA level the CPU runs: the kept set of top-k, top-p and min-p is
the definition's (PyTorch path, model/sampler.py), the draw with a given uniform number is the PyTorch path's, the
frequencies follow the kept distribution, zero-probability tokens are never drawn, and bad input is refused."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from kernel_levels import lowered, machine_levels, module

from pdserve.model import sampler
from pdserve.model.sampler import Sampler, apply_top_k_top_p_min_p

LEVELS = ("generic", "avx2", "avx512")


@pytest.fixture(params=[lv for lv in LEVELS if lv in machine_levels(LEVELS)])
def lib(request: pytest.FixtureRequest) -> Iterator[Any]:
    yield from lowered(module(), request.param)


def _params(b: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row temperature, top_k, top_p, min_p: every combination of filters, some rows unfiltered."""
    temp = torch.rand(b, generator=g) * 1.4 + 0.1
    top_k = torch.randint(0, 4, (b,), generator=g) * torch.randint(1, 80, (b,), generator=g)
    top_p = torch.where(torch.rand(b, generator=g) < 0.6, torch.rand(b, generator=g) * 0.9 + 0.05, torch.ones(b))
    min_p = torch.where(torch.rand(b, generator=g) < 0.3, torch.rand(b, generator=g) * 0.2, torch.zeros(b))
    return temp, top_k, top_p, min_p


def _logits(g: torch.Generator, v: int) -> torch.Tensor:
    peaked = torch.randn(12, v, generator=g) * 6
    flat = torch.randn(12, v, generator=g) * 0.3
    model_like = torch.randn(12, v, generator=g) * 2 + torch.linspace(8, -8, v)[torch.randperm(v, generator=g)]
    return torch.cat([peaked, flat, model_like])


@pytest.mark.parametrize("v", [1000, 49152])
def test_kept_set_is_the_definitions(lib: Any, v: int) -> None:
    g = torch.Generator().manual_seed(v)
    logits = _logits(g, v)
    temp, top_k, top_p, min_p = _params(logits.shape[0], g)
    kept = lib.sampling_kept(logits, temp, top_k, top_p, min_p)
    ref = apply_top_k_top_p_min_p(logits / temp.unsqueeze(1), top_k, top_p, min_p) > float("-inf")
    assert torch.equal(kept, ref)
    assert int((top_k > 0).sum()) and int((top_p < 1).sum()) and int((min_p > 0).sum())  # every filter ran


def test_draws_equal_the_pytorch_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampler._random_sample with the same seeds: the same tokens from either path (the uniform numbers are drawn
    the same way, seeded rows from their own generators)."""
    g = torch.Generator().manual_seed(7)
    logits = _logits(g, 4096)
    b = logits.shape[0]
    temp, top_k, top_p, min_p = (t.numpy() for t in _params(b, g))

    def run(native: bool) -> list[int]:
        monkeypatch.setattr(sampler, "NATIVE_SAMPLING", native)
        gens = [torch.Generator().manual_seed(100 + i) if i % 3 else None for i in range(b)]
        torch.manual_seed(5)  # the unseeded rows' draws
        return Sampler._random_sample(logits, temp, top_k, top_p, min_p, gens).tolist()  # type: ignore[no-any-return]

    assert run(True) == run(False)


def test_frequencies_follow_the_kept_distribution(lib: Any) -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, float("-inf"), 1.5]] * 4)
    temp = torch.tensor([1.0, 0.7, 1.0, 2.0])
    top_k = torch.tensor([0, 3, 0, 0])
    top_p = torch.tensor([1.0, 1.0, 0.8, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.3])
    probs = apply_top_k_top_p_min_p(logits / temp.unsqueeze(1), top_k, top_p, min_p).softmax(-1)
    n = 20000
    u = torch.rand(n, generator=torch.Generator().manual_seed(1))
    for r in range(4):
        rows = logits[r:r + 1].expand(n, -1).contiguous()
        toks = lib.sample_rows(rows, temp[r].repeat(n), top_k[r].repeat(n), top_p[r].repeat(n), min_p[r].repeat(n), u)
        freq = torch.bincount(toks, minlength=7).double() / n
        assert float((freq - probs[r]).abs().max()) < 0.015, (r, freq, probs[r])
        assert int(freq[probs[r] == 0].sum() * n) == 0  # a token outside the kept set is never drawn


def test_edges(lib: Any) -> None:
    one = torch.ones(1)

    def draw(row: list[float], u: float, k: int = 0, p: float = 1.0, mp: float = 0.0) -> int:
        return int(lib.sample_rows(torch.tensor([row]), one, torch.tensor([k]), torch.tensor([p]),
                                   torch.tensor([mp]), torch.tensor([u]))[0])

    ninf = float("-inf")
    row = [ninf, 0.0, ninf, 0.0, ninf]
    assert draw(row, 0.0) == 1 and draw(row, 0.4999) == 1 and draw(row, 0.5001) == 3
    assert draw(row, float(np.nextafter(np.float32(1), np.float32(0)))) == 3  # u just below 1: the last kept token
    assert draw([0.0, -200.0, -200.0, -200.0], 0.999, k=3) == 0  # top-k reaching zero-probability tokens
    assert draw([1.0, 3.0, 3.0, 0.0], 0.99, mp=1.0) == 2 and draw([1.0, 3.0, 3.0, 0.0], 0.0, mp=1.0) == 1
    assert draw([5.0, 1.0, 1.0], 0.99, k=7) == 2  # k past the vocabulary: off
    assert draw([5.0, 1.0, 1.0], 0.999, p=0.5) == 0  # the best token alone holds top_p
    assert draw([float("nan"), 0.0, 0.0], 0.0) == 1  # NaN: probability 0
    with pytest.raises(RuntimeError, match="no finite logit"):
        draw([ninf, ninf], 0.5)
    ties = torch.tensor([[1.0] * 10 + [0.0] * 10])
    kept = lib.sampling_kept(ties, one, torch.tensor([4]), one, torch.zeros(1))
    assert int(kept.sum()) == 4 and bool(kept[0, :10].sum() == 4)  # 4 of the tied best, none of the others


def test_bad_input_is_refused(lib: Any) -> None:
    x = torch.randn(2, 8)
    ok = dict(temperature=torch.ones(2), top_k=torch.zeros(2, dtype=torch.long), top_p=torch.ones(2),
              min_p=torch.zeros(2), u=torch.full((2,), 0.5))
    assert lib.sample_rows(x, **ok).shape == (2,)
    for key, bad, msg in [("temperature", torch.zeros(2), "temperature must be > 0"),
                          ("top_p", torch.zeros(2), "top_p must be in"),
                          ("min_p", torch.full((2,), 1.5), "min_p must be in"),
                          ("u", torch.ones(2), "u must be in"),
                          ("top_k", torch.zeros(2, dtype=torch.int32), "top_k must be"),
                          ("temperature", torch.ones(3), "temperature must be")]:
        with pytest.raises(RuntimeError, match=msg):
            lib.sample_rows(x, **{**ok, key: bad})
    with pytest.raises(RuntimeError, match="2-D float32"):
        lib.sample_rows(x.double(), **ok)
