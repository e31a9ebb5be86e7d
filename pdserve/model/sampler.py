"""Batched sampling on tensors: penalties, min_tokens, temperature, top-k/p, min-p, seeds, logprobs.

Each step samples one token for every request whose last pending token was computed. All rows are processed as
one [B, vocab] tensor; only the random draws of seeded rows use their own `torch.Generator`, so a seeded request
draws the same numbers whatever else is in the batch. A draw is inverse-CDF sampling (`torch.multinomial`), one
uniform number per row (searchsorted on the CDF; torch.multinomial and the exponential race draw one number per
vocabulary entry, 10x slower on a 49k vocabulary).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.request import Request


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int  # 1-based rank of the sampled token under the model's distribution
    top: list[tuple[int, float]]  # the `logprobs` most likely tokens, best first


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def _pad(rows: Sequence[Sequence[int]], pad: int) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """In place. Repetition penalty (prompt and output tokens, CTRL-style divide/multiply), then OpenAI presence
    and frequency penalties (output tokens only)."""
    b, v = logits.shape
    params = [r.sampling_params for r in requests]
    counts = torch.zeros(b, v + 1, dtype=logits.dtype)
    out_idx = _pad([r.output_token_ids for r in requests], v)  # padding goes to column v, dropped below
    counts.scatter_add_(1, out_idx, torch.ones(out_idx.shape, dtype=logits.dtype))
    counts = counts[:, :v]
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype).unsqueeze(1)
    if (rep != 1).any():
        seen = torch.zeros(b, v + 1, dtype=torch.bool)
        seen.scatter_(1, _pad([r.prompt_token_ids for r in requests], v), True)
        seen = seen[:, :v] | (counts > 0)
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, penalized, logits))
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype).unsqueeze(1)
    logits -= freq * counts + pres * (counts > 0).to(logits.dtype)


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, nucleus top-p and min-p sets. k=0, p=1, min_p=0 disable."""
    v = logits.shape[1]
    if (top_k > 0).any() or (top_p < 1).any():
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        k = torch.where(top_k > 0, top_k, v).clamp(max=v)
        pos = torch.arange(v).unsqueeze(0)
        drop = pos >= k.unsqueeze(1)
        if (top_p < 1).any():
            probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
            before = probs.cumsum(-1) - probs  # mass of strictly better tokens
            drop |= before >= top_p.unsqueeze(1)  # smallest set reaching top_p; the best token always stays
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if (min_p > 0).any():
        probs = logits.softmax(-1)
        thresh = probs.max(-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    return logits


class Sampler:
    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """logits: float32 [B, vocab], row i belongs to requests[i]."""
        params = [r.sampling_params for r in requests]
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = logits.log_softmax(-1) if any(want_logprobs) else None  # as vLLM: before any processing

        if any(p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in params):
            logits = logits.clone()
            apply_penalties(logits, requests)
        for i, r in enumerate(requests):
            if r.num_output_tokens < r.sampling_params.min_tokens:
                banned = list(r.sampling_params.stop_token_ids) + ([] if r.sampling_params.ignore_eos
                                                                   else sorted(r.eos_token_ids))
                if banned:
                    logits[i, banned] = float("-inf")

        tokens = logits.argmax(-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:  # only the random rows pay for softmax and draws
            picked = rows if len(rows) < len(params) else slice(None)
            tokens[rows] = self._random_sample(logits[picked], [requests[i] for i in rows])
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(raw_logprobs, token_list, requests))

    @staticmethod
    def _random_sample(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """One draw per row from softmax(logits / T) after top-k/p and min-p, by inverse-CDF sampling:
        unseeded rows in one draw, seeded rows each from its own generator."""
        params = [r.sampling_params for r in requests]
        temp = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
        x = logits / temp.unsqueeze(1)
        x = apply_top_k_top_p_min_p(
            x, torch.tensor([p.top_k for p in params]), torch.tensor([p.top_p for p in params], dtype=x.dtype),
            torch.tensor([p.min_p for p in params], dtype=x.dtype))
        cdf = x.softmax(-1).cumsum(-1)
        u = torch.empty(len(requests), 1, dtype=cdf.dtype)
        seeded = [i for i, r in enumerate(requests) if r.generator is not None]
        if len(seeded) < len(requests):
            u.uniform_()
        for i in seeded:
            u[i].uniform_(generator=requests[i].generator)
        # first token whose cumulative mass exceeds u * total: a zero-probability token is never chosen
        idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
        return idx.clamp_(max=cdf.shape[1] - 1)

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, tokens: list[int],
                  requests: Sequence[Request]) -> list[TokenLogprobs | None]:
        if raw is None:
            return [None] * len(requests)
        n_top = max(r.sampling_params.logprobs or 0 for r in requests)
        top_vals, top_ids = raw.topk(max(n_top, 1), dim=-1)
        idx = torch.tensor(tokens).unsqueeze(1)
        chosen = raw.gather(1, idx).squeeze(1)
        ranks = (raw > chosen.unsqueeze(1)).sum(-1) + 1
        out: list[TokenLogprobs | None] = []
        for i, r in enumerate(requests):
            n = r.sampling_params.logprobs
            if n is None:
                out.append(None)
                continue
            top = list(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist()))
            out.append(TokenLogprobs(tokens[i], float(chosen[i]), int(ranks[i]), top))
        return out
