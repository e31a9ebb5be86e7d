"""Batched sampling on tensors: logit_bias, penalties, min_tokens, grammar masks, temperature, top-k/p, min-p,
seeds, logprobs.

Each step samples one token for every request whose last pending token was computed. All rows are processed as
one [B, vocab] tensor; only the random draws of seeded rows use their own `torch.Generator`, so a seeded request
draws the same numbers whatever else is in the batch. A draw is inverse-CDF sampling, one uniform number per row
(searchsorted on the CDF; torch.multinomial and the exponential race draw one number per vocabulary entry, 10x
slower on a 49k vocabulary); on float32 CPU logits the native kernel (csrc/sampling.cpp) finds the same kept set
with a histogram instead of a sort and draws with the same uniform number. The per-row options come as a
SamplingMetadata the runner gathers from its persistent per-request state (input_batch.py). Speculating rows are
verified by the rejection sampler (spec/), which reuses `process`, `probs` and `logprobs` from here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve import kernels
from pdserve.model.sampling_metadata import Penalties, SamplingMetadata, SpecRows
from pdserve.outputs import TokenLogprobs

logger = logging.getLogger("pdserve.sampler")


@dataclass
class SamplerOutput:
    token_ids: list[int]  # per request row: its (first) token; -1 for a row that failed
    logprobs: list[TokenLogprobs | None]
    errors: list[str | None] = field(default_factory=list)  # per row, why it failed (None: ok); empty: all ok
    # speculative decoding (spec/rejection_sampler.py): per row, the tokens it emitted after token_ids[i] (accepted
    # drafts, then the correction or bonus token) and their logprobs; empty lists when no row had drafts
    extra_token_ids: list[list[int]] = field(default_factory=list)
    extra_logprobs: list[list[TokenLogprobs | None]] = field(default_factory=list)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1), by the native kernel for float32 CPU rows (memory speed, the kernels' threads:
    ATen's argmax is several times slower) and by torch elsewhere."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and logits.size(1) \
            and logits.stride(1) == 1:
        lib = kernels.load()  # built from these sources, so it has argmax_rows
        if lib is not None:
            return lib.argmax_rows(logits)
    return logits.argmax(-1)


def _pad(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    return out.to(device)


def apply_penalties(logits: torch.Tensor, pen: Penalties) -> None:
    """In place. Repetition penalty (prompt and output tokens, CTRL-style divide/multiply), then OpenAI presence
    and frequency penalties (output tokens only)."""
    (b, v), dev = logits.shape, logits.device
    counts = torch.zeros(b, v + 1, dtype=logits.dtype, device=dev)
    out_idx = _pad(pen.output_token_ids, v, dev)  # padding goes to column v, dropped below
    counts.scatter_add_(1, out_idx, torch.ones(out_idx.shape, dtype=logits.dtype, device=dev))
    counts = counts[:, :v]
    if (pen.repetition != 1).any():  # decided on the host: no device sync
        rep = torch.as_tensor(pen.repetition, dtype=logits.dtype, device=dev).unsqueeze(1)
        seen = torch.zeros(b, v + 1, dtype=torch.bool, device=dev)
        seen.scatter_(1, _pad(pen.prompt_token_ids, v, dev), True)
        seen = seen[:, :v] | (counts > 0)
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, penalized, logits))
    freq = torch.as_tensor(pen.frequency, dtype=logits.dtype, device=dev).unsqueeze(1)
    pres = torch.as_tensor(pen.presence, dtype=logits.dtype, device=dev).unsqueeze(1)
    logits -= freq * counts + pres * (counts > 0).to(logits.dtype)


# random rows of float32 CPU logits draw with the native kernel (csrc/sampling.cpp); False: the PyTorch path below
# (benchmarks' A/B switch; the two keep the same set and draw with the same u, up to float rounding at a boundary)
NATIVE_SAMPLING = True

# how many best tokens the top-k/top-p masks look at, in turn (a row whose set is larger sorts its whole row)
NUCLEUS_CANDIDATES = (256, 4096)


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, nucleus top-p and min-p sets. k=0, p=1, min_p=0 disable.
    The three parameter tensors are on the host (which masks apply is decided there: no device sync); they are
    copied to the logits' device.

    Top-k/top-p look at each row's best NUCLEUS_CANDIDATES tokens first (a partial top-k, not a sort of the whole
    vocabulary, which cost ~40 ms a step at 32 rows x 49152): a row whose kept set ends among them (k <= the
    candidates, or the candidates' mass reaches top_p) is masked from them; the others try the next, larger
    candidate set, and past the last their whole row (a top-k of the vocabulary: a sort). The kept set is the
    definition's either way."""
    dev = logits.device
    use_k, use_p, use_min_p = bool((top_k > 0).any()), bool((top_p < 1).any()), bool((min_p > 0).any())
    if use_k or use_p:
        logits = _mask_top_k_top_p(logits, top_k, top_p, use_p)
    if use_min_p:
        probs = logits.softmax(-1)
        thresh = probs.max(-1, keepdim=True).values * min_p.to(dev).unsqueeze(1)
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    return logits


def _mask_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, use_p: bool) -> torch.Tensor:
    """The top-k/top-p masks of apply_top_k_top_p_min_p (see there)."""
    v, dev = logits.shape[1], logits.device
    top_k, top_p = top_k.to(dev), top_p.to(dev)
    unfiltered = (top_k <= 0) & (top_p >= 1)
    out = torch.full_like(logits, float("-inf"))
    out[unfiltered] = logits[unfiltered]
    rest = (~unfiltered).nonzero().flatten()
    whole = rest[:0]  # rows sent straight to the whole-row pass
    for c in sorted({min(v, n) for n in NUCLEUS_CANDIDATES} | {v}):  # the last: the whole row
        if c == v:
            rest = torch.cat([rest, whole])
        if not len(rest):
            if len(whole):  # rows waiting for the whole-row pass
                continue
            break
        sub, k, p = logits[rest], top_k[rest], top_p[rest]
        vals, idx = sub.topk(c, dim=-1)  # sorted best first
        pos = torch.arange(c, device=dev).unsqueeze(0)
        with_k = (k > 0) & (k <= c)
        drop = pos >= torch.where(with_k, k, c).unsqueeze(1)
        # normalised over the row's top-k, or over the whole row without one
        log_norm = torch.where(with_k, vals.masked_fill(drop, float("-inf")).logsumexp(-1), sub.logsumexp(-1))
        probs = (vals.masked_fill(drop, float("-inf")) - log_norm.unsqueeze(1)).exp()
        cum = probs.cumsum(-1)
        if use_p:
            # smallest set reaching top_p; the best token always stays. Rows without top-p (p = 1) keep their tail
            # even where the float cumulative sum reaches 1 before its end.
            drop |= ((cum - probs) >= p.unsqueeze(1)) & (p < 1).unsqueeze(1)
        # the set ends among the candidates: by its k, or by the mass it reached (a row with k > c cannot tell)
        fits = with_k | ((k <= 0) & (cum[:, -1] >= p)) if c < v else torch.ones_like(with_k)
        rows = rest[fits]
        out[rows] = torch.full_like(sub[fits], float("-inf")).scatter_(
            1, idx[fits], vals[fits].masked_fill(drop[fits], float("-inf")))
        # a row whose best c tokens hold under a quarter of top_p (a flat distribution) skips the larger candidate
        # sets: they would not hold its set either, and each costs a partial top-k
        flat = ~fits & (k <= 0) & (cum[:, -1] < p / 4)
        whole = torch.cat([whole, rest[flat]])
        rest = rest[~fits & ~flat]
    return out


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], masks: Sequence[torch.Tensor]) -> None:
    """In place: logits[rows[k], t] = -inf where bit t of masks[k] (int32 words, bit t % 32 of word t // 32) is
    clear. xgrammar's CPU kernel (no triton needed; 4x faster than unpacking the bits with torch), imported only
    when a row is constrained: xgrammar is installed wherever a request could be. On a GPU the bits are unpacked
    with torch ops on the device."""
    if logits.device.type != "cpu":
        apply_token_bitmask_torch(logits, rows, masks)
        return
    import xgrammar as xgr

    bits = torch.empty(logits.shape[0], masks[0].shape[0], dtype=torch.int32)  # rows outside `rows` are not read
    bits[rows] = torch.stack(list(masks))
    xgr.apply_token_bitmask_inplace(logits, bits, vocab_size=logits.shape[1], indices=rows)


def apply_token_bitmask_torch(logits: torch.Tensor, rows: list[int], masks: Sequence[torch.Tensor]) -> None:
    """apply_token_bitmask with torch ops on the logits' device (no xgrammar kernel: the GPU path)."""
    words = torch.stack(list(masks)).to(logits.device)  # [R, ceil(vocab / 32)] int32
    t = torch.arange(logits.shape[1], device=logits.device)
    allowed = (words[:, t // 32] >> (t % 32)) & 1
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = logits[idx].masked_fill(allowed == 0, float("-inf"))


def score_tokens(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """Row i's log_softmax at targets[i], its rank, and the top k (the raw model distribution, as vLLM's prompt
    logprobs): logits float32 [len(targets), vocab]."""
    lp = logits.log_softmax(-1)
    chosen = lp.gather(1, torch.tensor(targets, device=lp.device).unsqueeze(1)).squeeze(1)
    ranks = (lp > chosen.unsqueeze(1)).sum(-1) + 1
    top_vals, top_ids = lp.topk(max(k, 1), dim=-1)
    return [TokenLogprobs(t, float(chosen[i]), int(ranks[i]),
                          list(zip(top_ids[i, :k].tolist(), top_vals[i, :k].tolist())))
            for i, t in enumerate(targets)]



class Sampler:
    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """logits: float32 [rows, vocab], row i described by row i of `md`; never modified.

        One request's options must not fail its neighbours: if the batched pass raises, every request is sampled
        alone (seeded ones from their generator state before the failed pass) and only the requests that raise
        again fail, reported in `SamplerOutput.errors`."""
        groups = self._groups(md)
        states = [g.get_state() if (g := md.generators[a]) is not None else None for a, _ in groups]
        try:
            return self.sample(logits, md)
        except Exception:  # noqa: BLE001 - isolated per request below
            logger.exception("batched sampling failed; sampling %d rows one by one", len(groups))
            return self._sample_rows(logits, md, groups, states)

    @staticmethod
    def _groups(md: SamplingMetadata) -> list[tuple[int, int]]:
        """Each request's logits rows [a, b): one, or 1 + its drafts."""
        if md.spec is None:
            return [(i, i + 1) for i in range(md.num_rows)]
        return [(s, s + 1 + len(d)) for s, d in zip(md.spec.starts, md.spec.drafts)]

    def _sample_rows(self, logits: torch.Tensor, md: SamplingMetadata, groups: list[tuple[int, int]],
                     states: list[torch.Tensor | None]) -> SamplerOutput:
        out = SamplerOutput([], [], [])
        for k, (a, b) in enumerate(groups):
            gen, state = md.generators[a], states[k]
            if gen is not None and state is not None:
                gen.set_state(state)
            one_md = md.select(np.arange(a, b))
            if md.spec is not None:
                one_md.spec = SpecRows([0], [md.spec.drafts[k]])
            try:
                one = self.sample(logits[a:b], one_md)
            except Exception as exc:  # noqa: BLE001 - this request fails, the others keep their token
                one = SamplerOutput([-1], [None], [f"{type(exc).__name__}: {exc}"], extra_token_ids=[[]],
                                    extra_logprobs=[[]])
            out.token_ids.append(one.token_ids[0])
            out.logprobs.append(one.logprobs[0])
            out.errors.append(one.errors[0] if one.errors else None)
            if md.spec is not None:
                out.extra_token_ids.append(one.extra_token_ids[0] if one.extra_token_ids else [])
                out.extra_logprobs.append(one.extra_logprobs[0] if one.extra_logprobs else [])
        return out

    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """One token per row (no drafts: the rejection sampler verifies those)."""
        assert md.spec is None, "rows with drafts are verified by the rejection sampler"
        raw_logprobs = logits.log_softmax(-1) if md.any_logprobs else None  # as vLLM: before any processing
        logits = self.process(logits, md)
        tokens = argmax_rows(logits)
        rows = np.flatnonzero(~md.greedy) if not md.all_greedy else np.zeros(0, np.int64)
        if len(rows):  # only the random rows pay for softmax and draws
            idx = rows.tolist()
            picked = idx if len(rows) < md.num_rows else slice(None)
            tokens[idx] = self._random_sample(
                logits[picked], md.temperature[rows], md.top_k[rows], md.top_p[rows], md.min_p[rows],
                [md.generators[i] for i in idx])
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self.logprobs(raw_logprobs, token_list, md.num_logprobs))

    @staticmethod
    def process(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """logit_bias, penalties, min_tokens bans and grammar masks: the logits greedy takes the argmax of and
        temperature/top-k/p apply to. The input is never modified (a copy is made when anything applies)."""
        if md.logit_bias or md.banned or md.token_bitmask or md.penalties is not None:
            logits = logits.clone()  # the caller's logits stay intact for the per-row fallback
        for i, bias in md.logit_bias:  # OpenAI logit_bias: added before everything else
            logits[i, list(bias)] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
        if md.penalties is not None:
            apply_penalties(logits, md.penalties)
        for i, banned in md.banned:
            logits[i, banned] = float("-inf")
        if md.token_bitmask:  # structured output: after logit_bias, before temperature/top-k/p (greedy rows too)
            apply_token_bitmask(logits, [i for i, _ in md.token_bitmask], [m for _, m in md.token_bitmask])
        return logits

    @staticmethod
    def probs(logits: torch.Tensor, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
              min_p: np.ndarray) -> torch.Tensor:
        """The distribution a random row samples from: softmax(logits / T) after top-k/p and min-p."""
        temp = torch.as_tensor(temperature, dtype=logits.dtype, device=logits.device)
        x = logits / temp.unsqueeze(1)
        x = apply_top_k_top_p_min_p(x, torch.as_tensor(top_k, dtype=torch.long),
                                    torch.as_tensor(top_p, dtype=x.dtype), torch.as_tensor(min_p, dtype=x.dtype))
        return x.softmax(-1)

    @staticmethod
    def _random_sample(logits: torch.Tensor, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
                       min_p: np.ndarray, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        """One draw per row from softmax(logits / T) after top-k/p and min-p, by inverse-CDF sampling:
        unseeded rows in one draw, seeded rows each from its own generator. The uniforms are drawn on the host
        (requests' generators are CPU generators) and copied to the device: a seed gives the same draws on any
        device."""
        u = torch.empty(len(generators), 1, dtype=torch.float32)
        seeded = [i for i, g in enumerate(generators) if g is not None]
        if len(seeded) < len(generators):
            u.uniform_()
        for i in seeded:
            u[i].uniform_(generator=generators[i])
        lib = kernels.load() if NATIVE_SAMPLING and logits.device.type == "cpu" and logits.dtype == torch.float32 \
            and logits.stride(1) == 1 else None
        if lib is not None:  # the same kept set and draw, without a sort (csrc/sampling.cpp)
            return lib.sample_rows(  # type: ignore[no-any-return]
                logits, torch.as_tensor(temperature, dtype=torch.float32), torch.as_tensor(top_k, dtype=torch.long),
                torch.as_tensor(top_p, dtype=torch.float32), torch.as_tensor(min_p, dtype=torch.float32), u.view(-1))
        cdf = Sampler.probs(logits, temperature, top_k, top_p, min_p).cumsum(-1)
        u = u.to(cdf.device, non_blocking=True)
        # first token whose cumulative mass exceeds u * total: a zero-probability token is never chosen
        idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
        return idx.clamp_(max=cdf.shape[1] - 1)

    @staticmethod
    def logprobs(raw: torch.Tensor | None, tokens: list[int], num_logprobs: np.ndarray) -> list[TokenLogprobs | None]:
        if raw is None:
            return [None] * len(tokens)
        n_top = int(max(num_logprobs.max(initial=0), 0))
        top_vals, top_ids = raw.topk(max(n_top, 1), dim=-1)
        idx = torch.tensor(tokens, device=raw.device).unsqueeze(1)
        chosen = raw.gather(1, idx).squeeze(1)
        ranks = (raw > chosen.unsqueeze(1)).sum(-1) + 1
        out: list[TokenLogprobs | None] = []
        for i, n in enumerate(num_logprobs.tolist()):
            if n < 0:
                out.append(None)
                continue
            top = list(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist()))
            out.append(TokenLogprobs(tokens[i], float(chosen[i]), int(ranks[i]), top))
        return out
