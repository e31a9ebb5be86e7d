"""The layer modules every architecture is built from (nano-vllm's / vLLM's `layers/`): RMSNorm with the residual
add fused, rotary embedding, paged attention, gated activations, linear and embedding over float or packed weights.
Each binds its PyTorch or its native implementation once, from the model's KernelSelection (model/native_ops.py)."""
