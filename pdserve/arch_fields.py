"""The per-architecture fields of ModelArchConfig that config.json spells its own way (config.py reads the common
ones): YaRN's completed scaling dict, Gemma 2/3's layer kinds and soft-caps, Phi-3's partial rotary and LongRoPE,
Mistral/Mixtral's sliding window, Qwen3-MoE and Mixtral's experts."""

from __future__ import annotations

from typing import Any


def yarn_defaults(cfg: dict[str, Any], scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """YaRN's dict completed as transformers completes it: the original length from the top level (or
    max_position_embeddings), the factor from the lengths' ratio when null."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return scaling
    orig = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings") \
        or cfg.get("max_position_embeddings", 4096)  # transformers prefers the top-level value (Phi-3's habit)
    factor = scaling.get("factor") or cfg.get("max_position_embeddings", orig) / orig
    kept = {k: v for k, v in scaling.items() if k != "type"}
    return {**kept, "rope_type": "yarn", "original_max_position_embeddings": orig, "factor": factor}


def gemma_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """Gemma 2/3's ModelArchConfig fields from a config.json (transformers 4's keys or 5's rope_parameters). Gemma 2:
    one rope for every layer, even layers local; soft-capping where the config sets it (Gemma 2; Gemma 3 has none)."""
    if arch not in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        return {}
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:  # older configs: every `pattern`-th layer is global (Gemma 2: every 2nd)
        pattern = 2 if arch == "Gemma2ForCausalLM" else \
            int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    common = {"layer_types": tuple(types), "sliding_window": cfg.get("sliding_window"),
              "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or head_dim),
              "attn_logit_softcapping": float(cfg.get("attn_logit_softcapping") or 0.0),
              "final_logit_softcapping": float(cfg.get("final_logit_softcapping") or 0.0)}
    if arch == "Gemma2ForCausalLM":
        return common
    local = cfg.get("rope_local_base_freq", 10000.0)
    rope_params = cfg.get("rope_parameters")
    if isinstance(rope_params, dict) and isinstance(rope_params.get("sliding_attention"), dict):
        local = rope_params["sliding_attention"].get("rope_theta", local)
    return {**common, "rope_local_theta": float(local)}


def phi3_fields(cfg: dict[str, Any], arch: str, rope_params: Any,
                 rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """Phi-3/3.5/4-mini's fields: partial rotary, one sliding window on every layer, and LongRoPE's scaling dict
    completed with what config.json keeps at its top level (original_max_position_embeddings; `factor` as
    transformers derives it: max_position_embeddings / original_max_position_embeddings)."""
    if arch != "Phi3ForCausalLM":
        return {}
    params = rope_params if isinstance(rope_params, dict) else {}
    out: dict[str, Any] = {"partial_rotary_factor": float(params.get("partial_rotary_factor")
                                                          or cfg.get("partial_rotary_factor") or 1.0)}
    if cfg.get("sliding_window"):
        out.update(sliding_window=cfg["sliding_window"], layer_types=("sliding_attention",) * cfg["num_hidden_layers"])
    if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) in ("longrope", "su"):
        orig = rope_scaling.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
        factor = rope_scaling.get("factor") or cfg.get("max_position_embeddings", orig) / orig
        kept = {k: v for k, v in rope_scaling.items() if k != "type"}  # "su": LongRoPE's old name
        out["rope_scaling"] = {**kept, "rope_type": "longrope", "original_max_position_embeddings": orig,
                               "factor": factor}
    return out


MOE_ARCHS = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")


def moe_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """The sparse-MLP fields: expert count, experts per token, each expert's intermediate size, renormalisation of the
    top-k weights, and which layers are sparse. Qwen3-MoE and Qwen2-MoE: layer i is sparse unless listed in
    mlp_only_layers, when (i + 1) % decoder_sparse_step == 0 (transformers' rule); Qwen2-MoE adds a shared expert
    (shared_expert_intermediate_size) to every sparse layer. Mixtral: every layer, always renormalised."""
    if arch == "MixtralForCausalLM":
        n = int(cfg.get("num_local_experts", 8))
        return {"num_experts": n, "num_experts_per_tok": int(cfg.get("num_experts_per_tok", 2)),
                "moe_intermediate_size": int(cfg["intermediate_size"]), "norm_topk_prob": True,
                "moe_layers": (True,) * cfg["num_hidden_layers"]}
    if arch not in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
        return {}
    n = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)  # transformers 5 writes the second
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(n > 0 and i not in dense and (i + 1) % step == 0 for i in range(cfg["num_hidden_layers"]))
    return {"num_experts": n, "num_experts_per_tok": int(cfg.get("num_experts_per_tok") or 0),
            "moe_intermediate_size": int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", arch == "Qwen3MoeForCausalLM")), "moe_layers": sparse,
            "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0)}


def mistral_window_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """Mistral 7B v0.1 (and Mixtral configs that set one): one sliding window on every layer, as transformers' mask
    applies it; later Mistral releases set none."""
    if arch not in ("MistralForCausalLM", "MixtralForCausalLM") or not cfg.get("sliding_window"):
        return {}
    return {"sliding_window": int(cfg["sliding_window"]),
            "layer_types": ("sliding_attention",) * cfg["num_hidden_layers"]}
