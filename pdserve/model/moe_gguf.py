"""MoE GGUF files in Hugging Face terms: llama.cpp's `qwen3moe` and `qwen2moe` architectures (Qwen3-MoE; Qwen1.5/2-MoE
with its shared expert) and `llama` files with `llama.expert_count` (Mixtral; llama.cpp's converter writes Mixtral
as llama).

Tensors: the router `blk.N.ffn_gate_inp` [E, H]; the experts as 3-D tensors `blk.N.ffn_{gate,up,down}_exps` ([E, I,
H], [E, I, H], [E, H, I] in Hugging Face order) or, in older Mixtral files, one 2-D tensor per expert
(`blk.N.ffn_gate.E`, ...). A 3-D tensor is cut into one matrix per expert: views of the stored bytes, kept in their
stored type (no float copy, no copy at all) so each expert's Linear is packed as stored; types the kernels do not
read as stored are dequantized and cut the same way. A layer without a router is dense (Qwen3-MoE's
mlp_only_layers). Qwen2-MoE's shared expert is `ffn_{gate,up,down}_shexp` and its gate `ffn_gate_inp_shexp` (one
row, stored 1-D).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pdserve.model.packed_weights import GGUFMatrix

MOE_GGUF_ARCHS = {"qwen3moe": "Qwen3MoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM"}
# block tensor -> Hugging Face module under model.layers.N (3-D ones are split per expert by `split_experts`)
MOE_BLOCK_TENSORS = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
                     "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
                     "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                     "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj"}
_PER_EXPERT = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}  # blk.N.ffn_gate.E (old)


def is_moe_file(meta: Any) -> bool:
    """`meta` (gguf_config.GGUFFile) holds a sparse-MLP model this loader serves."""
    return meta.arch in MOE_GGUF_ARCHS or (meta.arch == "llama" and int(meta.get("{arch}.expert_count") or 0) > 0)


def moe_tensor_name(parts: list[str]) -> str | None:
    """Hugging Face name (without the weight suffix) of an expert tensor `blk.N.<kind>[.E]`, split on dots."""
    if len(parts) == 3 and parts[2] in MOE_BLOCK_TENSORS:
        return f"model.layers.{int(parts[1])}.{MOE_BLOCK_TENSORS[parts[2]]}"
    if len(parts) == 4 and parts[2] in _PER_EXPERT and parts[3].isdigit():
        return f"model.layers.{int(parts[1])}.mlp.experts.{int(parts[3])}.{_PER_EXPERT[parts[2]]}"
    return None


def moe_hf_config(meta: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` (the loader's Llama-family config.json fields of the file `meta`) completed with the expert fields."""
    n_expert = int(meta.get("{arch}.expert_count") or 0)
    used = int(meta.get("{arch}.expert_used_count") or 0)
    if n_expert <= 0 or not 0 < used <= n_expert:
        raise ValueError(f"{meta.path}: MoE GGUF with expert_count {n_expert} and expert_used_count {used}")
    if meta.arch == "llama":  # Mixtral: every layer sparse, experts of feed_forward_length, always renormalised
        return {**cfg, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": n_expert,
                "num_experts_per_tok": used, "sliding_window": None, "router_jitter_noise": 0.0}
    n_layers = cfg["num_hidden_layers"]
    dense = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in meta.tensors]
    first_sparse = next(i for i in range(n_layers) if i not in dense)
    inter = int(meta.get("{arch}.expert_feed_forward_length") or 0) or \
        meta.tensors[f"blk.{first_sparse}.ffn_gate_exps.weight"].hf_shape[1]
    out = {**cfg, "num_experts": n_expert, "num_experts_per_tok": used, "moe_intermediate_size": int(inter),
           "norm_topk_prob": bool(meta.get("{arch}.expert_weights_norm", meta.arch == "qwen3moe")),
           "decoder_sparse_step": 1, "mlp_only_layers": dense, "use_sliding_window": False, "sliding_window": None,
           "max_window_layers": n_layers}
    if meta.arch == "qwen2moe":  # the shared expert; q/k/v bias as the file has it
        shared = meta.get("{arch}.expert_shared_feed_forward_length") or \
            meta.tensors[f"blk.{first_sparse}.ffn_gate_shexp.weight"].hf_shape[0]
        out.update(shared_expert_intermediate_size=int(shared), qkv_bias=bool(cfg.get("attention_bias")))
    return out


def moe_layer_names(cfg: dict[str, Any]) -> dict[int, list[str]]:
    """Each sparse layer's expected expert weights (for the loader's completeness check), by layer."""
    from pdserve.arch_fields import moe_fields

    fields = moe_fields(cfg, cfg["architectures"][0])
    names = ["mlp.gate.weight"] + [f"mlp.experts.{e}.{n}.weight" for e in range(fields["num_experts"])
                                   for n in ("gate_proj", "up_proj", "down_proj")]
    if fields.get("shared_expert_intermediate_size"):
        names += ["mlp.shared_expert_gate.weight"] + [f"mlp.shared_expert.{n}.weight"
                                                       for n in ("gate_proj", "up_proj", "down_proj")]
    return {i: names for i, sparse in enumerate(fields["moe_layers"]) if sparse}


def split_experts(name: str, value: torch.Tensor | GGUFMatrix | np.ndarray, ggml_type: int,
                  shape: tuple[int, ...]) -> list[tuple[str, torch.Tensor | GGUFMatrix]]:
    """A 3-D expert tensor (`name` = model.layers.N.mlp.experts.<proj>, `shape` its Hugging Face shape [E, R, C]) as
    per-expert entries `model.layers.N.mlp.experts.E.<proj>.weight`: GGUFMatrix views when `value` is the stored
    bytes (uint8 array), else slices of the float tensor."""
    layer, _, proj = name.rpartition(".experts.")
    n_expert, rows, cols = shape
    if isinstance(value, np.ndarray):
        parts: list[torch.Tensor | GGUFMatrix] = list(expert_matrices(value, ggml_type, n_expert, rows, cols))
    else:
        assert isinstance(value, torch.Tensor)
        parts = list(value.reshape(n_expert, rows, cols).unbind(0))
    return [(f"{layer}.experts.{e}.{proj}.weight", p) for e, p in enumerate(parts)]


def expert_matrices(data: np.ndarray, ggml_type: int, n_expert: int, rows: int, cols: int) -> list[GGUFMatrix]:
    """`data`: the tensor's bytes (uint8, any shape, n_expert*rows*row_bytes in all) -> per-expert [rows, cols]
    views. Invariant: each expert's rows are contiguous in the file (ggml's outermost dimension is the expert)."""
    flat = data.reshape(-1)
    if flat.dtype != np.uint8 or flat.size % (n_expert * rows):
        raise ValueError(f"expert tensor of {flat.size} bytes ({flat.dtype}) does not split into "
                         f"{n_expert} experts x {rows} rows")
    per_expert = flat.reshape(n_expert, rows, flat.size // (n_expert * rows))
    return [GGUFMatrix(per_expert[e], ggml_type, (rows, cols)) for e in range(n_expert)]
