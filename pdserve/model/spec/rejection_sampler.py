"""Verification of draft tokens (speculative decoding): a request with k drafts has 1 + k logits rows, position j
scored after its newest token and drafts[:j].

Position j is processed exactly as a plain decode would process it had drafts[:j] been output already: logit_bias,
penalties over output + drafts[:j], the min_tokens ban while output + j < min_tokens, then temperature / top-k /
top-p / min-p (the runner's SamplingMetadata has one row per position: input_batch.py). Call p_j the resulting
distribution (greedy: its argmax).

* Greedy: drafts are accepted while they equal the argmax; the first mismatch emits the argmax instead. All k
  accepted: the argmax at position k is emitted too (the bonus token). The output is the plain greedy output.
* Random: the proposer is deterministic (a draft d has proposal probability 1), so standard rejection sampling
  accepts d with probability min(1, p_j(d) / 1) = p_j(d); on rejection it samples from p_j with d removed,
  renormalised (the normalised residual max(p_j - q, 0)), and stops. All accepted: one more draw from p_k. Each
  emitted token is then distributed exactly as p_j: P(d) = p_j(d), and for t != d,
  P(t) = (1 - p_j(d)) * p_j(t) / (1 - p_j(d)) = p_j(t).

Seeded requests draw from their own generator (two uniforms at most per position), unseeded from the global one; a
request without drafts draws exactly as the plain sampler would.
Logprobs are the raw model log-softmax of each emitted token's position, as for a plain decode.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.model.sampler import Sampler, SamplerOutput, argmax_rows
from pdserve.model.sampling_metadata import SamplingMetadata


def _uniform(gen: torch.Generator | None) -> torch.Tensor:
    """One float32 uniform, drawn as the plain sampler draws a row's (so a row without drafts samples the same)."""
    return torch.empty(1, dtype=torch.float32).uniform_(generator=gen)


def _draw(p: torch.Tensor, gen: torch.Generator | None, exclude: int | None = None) -> int:
    """Inverse-CDF draw from the (unnormalised) distribution p, as Sampler._random_sample draws a row; zero-mass
    tokens are never chosen. `exclude`: draw from p with that token removed (renormalised), without copying p."""
    cdf = p.cumsum(0)
    u = _uniform(gen).to(p.device)
    if exclude is None:
        idx = torch.searchsorted(cdf, u * cdf[-1:], right=True)
    else:
        pd = p[exclude:exclude + 1]
        target = u * (cdf[-1:] - pd)
        # below the mass before `exclude`: an earlier token; else skip its mass (cdf[exclude] <= target + pd)
        idx = torch.searchsorted(cdf, target if float(target) < float(cdf[exclude] - pd) else target + pd,
                                 right=True)
    return int(idx.clamp_(max=p.shape[0] - 1))


def _verify_random(p: torch.Tensor, drafts: list[int], gen: torch.Generator | None) -> list[int]:
    """Rejection sampling over positions p[0..k] (probabilities) for a deterministic proposal."""
    out: list[int] = []
    rows, cols = torch.arange(len(drafts), device=p.device), torch.tensor(drafts, dtype=torch.long, device=p.device)
    p_drafts = p[rows, cols].tolist() if drafts else []
    for j, d in enumerate(drafts):
        if float(_uniform(gen)) < p_drafts[j] or p_drafts[j] >= 1.0:
            out.append(d)
            continue
        out.append(_draw(p[j], gen, exclude=d))
        return out
    out.append(_draw(p[len(drafts)], gen))
    return out


def _verify_greedy(argmax: list[int], drafts: list[int]) -> list[int]:
    out: list[int] = []
    for j, d in enumerate(drafts):
        out.append(argmax[j])
        if argmax[j] != d:
            return out
    out.append(argmax[len(drafts)])
    return out


class RejectionSampler(Sampler):
    """Samples a step whose requests carry drafts (SamplingMetadata.spec): per request, the tokens it emits (its
    accepted drafts, then the correction or bonus token). Per-request failure isolation as the Sampler's."""

    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """logits float32 [sum(1 + k_i), vocab] -> per request, the first token and its logprobs, then the rest
        (accepted drafts, then the correction or bonus token) and theirs."""
        spec = md.spec
        assert spec is not None, "the rejection sampler verifies drafts: SamplingMetadata.spec is required"
        raw = logits.log_softmax(-1) if md.any_logprobs else None
        processed = self.process(logits, md)
        argmax = argmax_rows(processed).tolist()
        rand = np.flatnonzero(~md.greedy)
        probs = None
        if len(rand):
            probs = self.probs(processed[rand.tolist()], md.temperature[rand], md.top_k[rand], md.top_p[rand],
                               md.min_p[rand])
        rand_pos = {int(r): k for k, r in enumerate(rand)}
        row_tokens = list(argmax)  # per row: the token emitted there (rows past a rejection keep the argmax)
        emitted: list[list[int]] = []
        for s, drafts in zip(spec.starts, spec.drafts):
            if md.greedy[s] or probs is None:
                toks = _verify_greedy(argmax[s:s + len(drafts) + 1], drafts)
            else:
                toks = _verify_random(probs[rand_pos[s]:rand_pos[s] + len(drafts) + 1], drafts, md.generators[s])
            row_tokens[s:s + len(toks)] = toks
            emitted.append(toks)
        lps = self.logprobs(raw, row_tokens, md.num_logprobs)
        return SamplerOutput([t[0] for t in emitted], [lps[s] for s in spec.starts],
                             extra_token_ids=[t[1:] for t in emitted],
                             extra_logprobs=[lps[s + 1:s + len(t)] for s, t in zip(spec.starts, emitted)])
