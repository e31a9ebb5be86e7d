"""Cost models: the FLOPs and bytes a forward pass needs, from the model shape alone.

Two views of the same accounting, side by side:
  * `Cost` / prefill_cost / decode_cost: one whole prefill or one uniform decode step, for `pdserve calc`. FLOPs per
    token = 2 x params (every weight is one multiply-add); bytes = every weight read once + KV read + KV written;
    activations are ignored. Attention score/value work (QK^T and PV) is not in the 2·P rule; it is kept apart
    (`attn_flops`) and printed separately.
  * `StepCostModel`: one engine step of any mix (prefill chunks after cached prefixes, decodes), for the live
    roofline; it splits out the lm_head (logits only for sampled rows) and counts attention per (query, key) pair.

Intensity = FLOPs / bytes; balance = peak FLOP/s / bandwidth. Intensity above balance -> compute-bound. Floors:
compute floor = FLOPs / peak, bandwidth floor = bytes / bandwidth; no pass is faster than the larger one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.config import ModelArchConfig, kv_row_bytes
from pdserve.roofline.devices import DeviceSpec


def count_params(arch: ModelArchConfig) -> int:
    """Parameters of a Llama-family decoder: embeddings, per layer q/k/v/o (+ q/k/v biases for Qwen2, q/k norms for
    Qwen3), gate/up/down MLP (a sparse layer: its router and every expert) and two RMSNorms, the final norm, and
    lm_head unless tied to the embeddings."""
    h, hd = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * hd, arch.num_key_value_heads * hd
    attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if arch.attention_bias else 0) + (2 * hd if arch.qk_norm else 0)
    layer = attn + 3 * h * arch.intermediate_size + 2 * h
    embeddings = arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2)
    sparse = sum(arch.moe_layers or ())
    shared = 3 * h * arch.shared_expert_intermediate_size + h if arch.shared_expert_intermediate_size else 0
    moe_layer = attn + arch.num_experts * (3 * h * arch.moe_intermediate_size + h) + shared + 2 * h
    return embeddings + (arch.num_hidden_layers - sparse) * layer + sparse * moe_layer + h


def expert_params(arch: ModelArchConfig) -> int:
    """The experts' matrices of all sparse layers (0 for a dense model): the part of count_params a token reads only
    num_experts_per_tok / num_experts of."""
    return sum(arch.moe_layers or ()) * arch.num_experts * 3 * arch.hidden_size * arch.moe_intermediate_size


def expert_share(arch: ModelArchConfig) -> float:
    """k/E: the share of a sparse layer's experts one token runs (0 for a dense model)."""
    return arch.num_experts_per_tok / arch.num_experts if arch.is_moe else 0.0


def experts_touched(share: float, tokens: int) -> float:
    """Expected share of a sparse layer's experts that `tokens` tokens read, each running `share` of them (uniform
    routing): 1 - (1 - share)^tokens."""
    return 1.0 - (1.0 - share) ** max(0, tokens)


def active_params(arch: ModelArchConfig, params: int | None = None) -> float:
    """Parameters one token multiplies by (the 2·P rule's P): `params` (count_params by default) less the experts it
    does not choose."""
    p = count_params(arch) if params is None else params
    return p - expert_params(arch) * (1 - expert_share(arch))


def weights_read(arch: ModelArchConfig, weight_bytes: float, tokens: int, params: int | None = None) -> float:
    """Bytes of `weight_bytes` (all weights as stored) a pass over `tokens` tokens reads: all of a dense model; of a
    sparse one, the experts its tokens are expected to choose (experts_touched), stored bytes spread over params."""
    experts = expert_params(arch)
    if not experts:
        return weight_bytes
    p = count_params(arch) if params is None else params
    return weight_bytes * (1 - experts / p * (1 - experts_touched(expert_share(arch), tokens)))


_DTYPE_BYTES = {"float32": 4, "fp32": 4, "float": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
                "fp8": 1, "float8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1, "float8_e4m3fn": 1,
                "float8_e5m2": 1}


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name (float32/bf16/fp16, or fp8/int8 for a quantized KV cache)."""
    key = name.strip().lower().removeprefix("torch.")
    if key not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[key]


def kv_element_bytes(name: str, head_dim: int) -> float:
    """Bytes per K/V element of a KV cache dtype name as pdserve stores it: the dtype's size, and for the one-byte
    formats (int8, fp8) their per-row scale spread over the row: (head_dim + 2) / head_dim."""
    key = name.strip().lower().removeprefix("torch.")
    size = dtype_bytes(key)
    if size == 1:
        return kv_row_bytes("int8", head_dim) / head_dim
    return float(size)


def arch_windows(arch: ModelArchConfig) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention)."""
    return tuple(arch.layer_window(i) for i in range(arch.num_hidden_layers))


def kv_bytes_per_token(arch: ModelArchConfig, kv_dtype_bytes: float) -> int:
    """2 (K and V) x layers x KV heads x head_dim x bytes per element (kv_element_bytes)."""
    return round(2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim * kv_dtype_bytes)


@dataclass(frozen=True)
class Cost:
    """One forward pass. `flops` follows the 2·P-per-token rule; `attn_flops` is the QK^T + PV work that rule
    leaves out. `bytes` = weight_bytes + kv_read_bytes + kv_write_bytes (activations ignored)."""

    flops: float
    bytes: float
    attn_flops: float = 0.0
    weight_bytes: float = 0.0
    kv_read_bytes: float = 0.0
    kv_write_bytes: float = 0.0
    tokens: int = 0  # tokens this pass processes: N for a prefill, B for a decode step

    @property
    def intensity(self) -> float:
        """FLOP per byte on the 2·P rule (the headline number)."""
        return self.flops / self.bytes

    @property
    def intensity_with_attention(self) -> float:
        return (self.flops + self.attn_flops) / self.bytes

    def compute_floor_s(self, device: DeviceSpec, with_attention: bool = False) -> float:
        return (self.flops + (self.attn_flops if with_attention else 0.0)) / device.peak_flops

    def bandwidth_floor_s(self, device: DeviceSpec) -> float:
        return self.bytes / device.mem_bandwidth

    def floor_s(self, device: DeviceSpec, with_attention: bool = False) -> float:
        """No pass is faster than this: the larger of the compute and the bandwidth floor."""
        return max(self.compute_floor_s(device, with_attention), self.bandwidth_floor_s(device))

    def bound(self, device: DeviceSpec, with_attention: bool = False) -> str:
        """"compute" when the compute floor is the larger one (intensity above the balance point), else "bandwidth"."""
        return "compute" if self.compute_floor_s(device, with_attention) > self.bandwidth_floor_s(device) \
            else "bandwidth"


def prefill_cost(arch: ModelArchConfig, n_tokens: int, weight_bytes: float, kv_dtype_bytes: float,
                 params: int | None = None) -> Cost:
    """Prefill of an `n_tokens` prompt from an empty cache: 2·P·N FLOPs; weights read once + N tokens of KV written.
    Causal attention: query i meets i+1 keys, 4·head_dim FLOPs per (query, key, head), so 2·N·(N+1)·layers·heads·d."""
    p = active_params(arch, params)
    weight_bytes = weights_read(arch, weight_bytes, n_tokens, params)
    kv_write = n_tokens * kv_bytes_per_token(arch, kv_dtype_bytes)
    attn = 2 * n_tokens * (n_tokens + 1) * arch.num_hidden_layers * arch.num_attention_heads * arch.head_dim
    return Cost(2 * p * n_tokens, weight_bytes + kv_write, attn, weight_bytes, 0, kv_write, n_tokens)


def decode_cost(arch: ModelArchConfig, batch: int, context: int, weight_bytes: float, kv_dtype_bytes: float,
                params: int | None = None) -> Cost:
    """One decode step of `batch` sequences with `context` tokens cached each: 2·P·B FLOPs; weights read once +
    B·L tokens of KV read + B tokens written. Attention: each new token meets L+1 keys, 4·B·(L+1)·layers·heads·d."""
    p = active_params(arch, params)
    weight_bytes = weights_read(arch, weight_bytes, batch, params)
    per_token = kv_bytes_per_token(arch, kv_dtype_bytes)
    kv_read, kv_write = batch * context * per_token, batch * per_token
    attn = 4 * batch * (context + 1) * arch.num_hidden_layers * arch.num_attention_heads * arch.head_dim
    return Cost(2 * p * batch, weight_bytes + kv_read + kv_write, attn, weight_bytes, kv_read, kv_write, batch)


def kv_capacity(arch: ModelArchConfig, device_memory: float, weight_bytes: float, kv_dtype_bytes: float, context: int,
                reserve_fraction: float = 0.1) -> tuple[int, int]:
    """(most KV tokens, most sequences of `context` tokens) in device_memory·(1 - reserve) - weights; (0, 0) when the
    weights alone do not fit. Block rounding of a paged cache is ignored (exact when context % block_size == 0). A
    sliding-window layer holds its window of a sequence only (KV cache groups free the rest), so sequences longer
    than a window take less than `context` tokens of every layer."""
    free = device_memory * (1 - reserve_fraction) - weight_bytes
    per_token = kv_bytes_per_token(arch, kv_dtype_bytes)
    tokens = max(0, math.floor(free / per_token))
    windows = arch_windows(arch)
    held = sum(min(context, w) if w else context for w in windows) / len(windows)  # tokens a layer holds, mean
    return tokens, max(0, math.floor(free / (per_token * max(1.0, held))))


def decode_compute_bound_batch(arch: ModelArchConfig, context: int, weight_bytes: float, kv_dtype_bytes: float,
                               device: DeviceSpec, params: int | None = None) -> float | None:
    """Smallest batch at which a decode step at `context` turns compute-bound on the 2·P rule, or None when it never
    does: 2·P·B / (W + B·(L+1)·kv) = balance  ->  B = balance·W / (2·P - balance·(L+1)·kv)."""
    p = active_params(arch, params)
    denom = 2 * p - device.balance * (context + 1) * kv_bytes_per_token(arch, kv_dtype_bytes)
    return device.balance * weight_bytes / denom if denom > 0 else None



@dataclass(frozen=True)
class StepCostModel:
    """FLOPs and bytes one engine step needs, from the model shape: the work the step asks for, not what the kernels
    happen to do (a gather copy or padding is inefficiency, not work). Per step of T tokens over sequences that had
    `c` tokens cached and compute `n` new ones:

      * FLOPs = 2 · (decoder-layer weights) · T + 2 · (lm_head weights) · S (S = rows sampled; pdserve computes logits
        only for those) + 4 · layers · heads · head_dim · Σ keys each query meets (causal: n·c + n(n+1)/2).
      * Bytes = every decoder-layer weight once + lm_head once if anything is sampled + T embedding rows
        + Σ c tokens of KV read + T tokens of KV written. Activations are ignored (as in `calc`).
      * Sparse (MoE) layers: their experts are counted apart (expert_params, expert_bytes): FLOPs 2 · expert_params
        · k/E · T (each token runs k of E experts), bytes expert_bytes · (1 - (1 - k/E)^T) (the experts T tokens are
        expected to choose, routing taken as uniform).
    """

    layer_params: int  # matmul weights of all decoder layers
    lm_head_params: int
    layer_weight_bytes: int
    lm_head_bytes: int
    embed_row_bytes: int
    kv_bytes_per_token: int
    attn_flops_per_pair: int  # 4 · layers · heads · head_dim
    expert_params: int = 0  # matmul weights of all experts (not in layer_params)
    expert_bytes: int = 0
    expert_fraction: float = 0.0  # k/E: experts a token runs of those a layer has
    layer_windows: tuple[int, ...] = ()  # per layer, its sliding window (0: full); () when no layer has one

    @classmethod
    def for_model(cls, arch: ModelArchConfig, layer_params: int, layer_weight_bytes: int, lm_head_params: int,
                  lm_head_bytes: int, embed_row_bytes: int, kv_dtype_bytes: float, expert_params: int = 0,
                  expert_bytes: int = 0) -> StepCostModel:
        return cls(layer_params, lm_head_params, layer_weight_bytes, lm_head_bytes, embed_row_bytes,
                   kv_bytes_per_token(arch, kv_dtype_bytes),
                   4 * arch.num_hidden_layers * arch.num_attention_heads * arch.head_dim, expert_params, expert_bytes,
                   expert_share(arch), windows if any(windows := arch_windows(arch)) else ())

    def keys_read(self, context: int) -> float:
        """Cached keys a query after `context` tokens reads, averaged over the layers: a sliding-window layer reads
        its window only."""
        if not self.layer_windows:
            return context
        return sum(min(context, w) if w else context for w in self.layer_windows) / len(self.layer_windows)

    def cost(self, seqs: Sequence[tuple[int, int]], num_sampled: int) -> tuple[float, float]:
        """(FLOPs, bytes) of a step computing `n` new tokens after `c` cached ones for each (c, n) in `seqs`."""
        tokens = sum(n for _, n in seqs)
        if tokens == 0:
            return 0.0, 0.0
        pairs = sum(n * self.keys_read(c) + n * (n + 1) // 2 for c, n in seqs)
        context = sum(self.keys_read(c) for c, _ in seqs)
        flops = (2 * (self.layer_params + self.expert_params * self.expert_fraction) * tokens
                 + 2 * self.lm_head_params * num_sampled + self.attn_flops_per_pair * pairs)
        experts_read = self.expert_bytes * experts_touched(self.expert_fraction, tokens)
        nbytes = (self.layer_weight_bytes + experts_read + (self.lm_head_bytes if num_sampled else 0)
                  + tokens * self.embed_row_bytes + (context + tokens) * self.kv_bytes_per_token)
        return float(flops), float(nbytes)

