"""Why a model file cannot be served: an error naming what is wrong or unsupported, with a code callers branch on
(never on the message)."""

from __future__ import annotations

import enum


class ModelFileErrorCode(enum.StrEnum):
    UNSUPPORTED_ARCHITECTURE = "unsupported_architecture"  # general.architecture pdserve has no model for
    UNSUPPORTED_TENSOR_TYPE = "unsupported_tensor_type"  # a ggml type neither the kernels nor `gguf` can read
    UNSUPPORTED_TENSORS = "unsupported_tensors"  # tensor names the architecture does not have (e.g. MoE experts)
    GGUF_SPLIT_MISSING_PART = "gguf_split_missing_part"  # a part named by split.count is not on disk
    GGUF_SPLIT_INCONSISTENT = "gguf_split_inconsistent"  # parts disagree (count, numbering, tensor total, duplicates)
    GGUF_SPLIT_UNNAMED = "gguf_split_unnamed"  # a part whose file name does not say where the others are


class ModelFileError(ValueError):
    """A model file that cannot be served; `code` (ModelFileErrorCode) says why, the message names the part."""

    def __init__(self, message: str, code: ModelFileErrorCode) -> None:
        super().__init__(message)
        self.code = code
