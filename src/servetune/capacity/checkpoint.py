"""A checkpoint's size as its safetensors headers give it (a GGUF file's tensor infos: ``gguf.py``): parameter
counts per stored dtype.

Read from the headers only (``huggingface_hub.get_safetensors_metadata`` on the hub, the files' first bytes
in a local directory), never the weights. The ledger prefers these bytes to its parameter-count formula,
which knows nothing of vision towers, extra heads or a checkpoint's own quantization layout.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

#: Bytes per element of each safetensors dtype (the format's own names).
DTYPE_BYTES: dict[str, float] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
    "F4": 0.5, "F6_E2M3": 0.75, "F6_E3M2": 0.75,
}  # fmt: skip
#: Floating dtypes vLLM casts to the served ``--dtype`` on load (a float32 checkpoint served in bfloat16).
CAST_TO_SERVED = ("F32", "F16", "BF16", "F64")


class Checkpoint(BaseModel):
    """Parameter counts per safetensors dtype of a whole checkpoint, e.g. ``{"BF16": 8030261248}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    parameters: dict[str, int]
    type_bytes: dict[str, float] = Field(
        default_factory=dict, description="bytes per element of the dtypes DTYPE_BYTES does not name (GGUF's)"
    )

    def bytes_served(self, dtype_bytes: int) -> int | None:
        """Bytes the checkpoint takes once loaded with ``dtype_bytes`` per floating weight; None where a
        dtype is one this table does not know."""
        total = 0.0
        for dtype, count in self.parameters.items():
            if dtype in CAST_TO_SERVED:
                total += count * dtype_bytes
            elif dtype in DTYPE_BYTES or dtype in self.type_bytes:
                total += count * DTYPE_BYTES.get(dtype, self.type_bytes.get(dtype, 0.0))
            else:
                return None
        return int(total)
