"""How long an engine may take to start: a budget sized from the checkpoint, not one number for every model.

A fixed start-up timeout is either too short for a large checkpoint on slow storage (a 140 GB checkpoint read at
0.5 GB/s takes 280 s before anything compiles) or far too long for a small one, so a hung start holds its GPUs
for many minutes. The budget is the sum of what a start does, each part from a stated source:

- ``load_s``: the checkpoint's bytes on disk (its safetensors headers, ``checkpoint.py``; else the parameter
  count at the checkpoint's dtype) read at ``load_gbps``. The ranks of one replica (TP x PP) read their shards
  side by side from the node's storage, so together they read the checkpoint once; each data-parallel replica
  reads all of it, from the same storage, so DP multiplies the bytes.
- ``compile_s``: vLLM's ``torch.compile`` of the layers one rank holds (layers / PP), cold; none with
  ``enforce_eager``.
- ``cuda_graphs_s``: CUDA-graph capture (GPU, not ``enforce_eager``).
- ``distributed_s``: the ranks' start and their communicators (TP x PP > 1).
- ``process_s``: importing vLLM, the API server, the tokenizer, the memory profile and the KV cache.

The timeout is ``MARGIN`` times that, and never under ``FLOOR_S``. A download from the hub is not in it: it is a
cost of the cluster, not of the configuration (trial/failures.py retries a start that timed out downloading).
"""

from __future__ import annotations

from dataclasses import dataclass

from servetune.capacity.arch import ModelArch
from servetune.capacity.arith import cdiv
from servetune.capacity.checkpoint import DTYPE_BYTES
from servetune.capacity.params import weight_bytes_per_rank

#: The assumed read rate of a node's storage, GB/s (1e9 bytes). Overridable: ``load.weights_load_gbps``.
#: Source: AWS's EBS volume types (docs.aws.amazon.com/ebs/latest/userguide/general-purpose.html): gp3 gives
#: 125 MiB/s unless provisioned up to 1,000 MiB/s; a local NVMe reads several GB/s and the page cache more. 0.5 GB/s
#: is a provisioned network volume's rate: a cold read of a network disk fits in the budget, a local one with room.
LOAD_GBPS = 0.5
#: ``torch.compile`` of a Llama-3.1-8B-shaped stack, cold, on an H200 (DESIGN.md, measured): 4 layers 13.2 s, 32
#: layers 32.0 s, i.e. about 10.5 s plus 0.67 s a layer.
COMPILE_BASE_S = 10.5
COMPILE_PER_LAYER_S = 0.67
#: CUDA-graph capture: vLLM logs "Graph capturing finished in 12 secs" for an 8B model (engine/startup.py's
#: example); the allowance is twice that, for its default capture sizes on larger models.
CUDA_GRAPHS_S = 25.0
#: Starting the ranks of a TP/PP replica (the multiprocessing executor, NCCL's communicators, the custom
#: all-reduce's buffers): an allowance a rank beyond the first.
DISTRIBUTED_PER_RANK_S = 5.0
#: Importing vLLM, the API server and tokenizer, the memory profile and the KV cache: vLLM's CPU build starts a
#: 2.5M-parameter model in 40-66 s on the development hosts (DESIGN.md), nearly all of it this part.
PROCESS_S = 90.0
#: The budget is this many times the expected start (a busy node, a slower disk than assumed).
MARGIN = 2.0
#: No budget under this: the CPU build on a shared 2-core host has started a tiny model in up to ~200 s.
FLOOR_S = 600.0
#: Where the checkpoint cannot be sized (its architecture unknown offline): the timeout of before.
UNSIZED_S = 900.0


@dataclass(frozen=True)
class StartupBudget:
    """The expected start of one engine, by part, and the timeout it gives."""

    timeout_s: float
    expected_s: float | None = None  # None: not sized (``reason`` says why)
    checkpoint_bytes: int | None = None
    load_gbps: float = LOAD_GBPS
    load_s: float = 0.0
    compile_s: float = 0.0
    cuda_graphs_s: float = 0.0
    distributed_s: float = 0.0
    process_s: float = PROCESS_S
    margin: float = MARGIN
    reason: str | None = None

    def describe(self) -> str:
        """One line: what was expected, part by part, and how the timeout follows from it."""
        if self.expected_s is None:
            return f"{self.reason}: {self.timeout_s:g} s"
        parts = [f"loading {(self.checkpoint_bytes or 0) / 1e9:.1f} GB at {self.load_gbps:g} GB/s {self.load_s:.0f} s"]
        parts += [f"{name} {seconds:.0f} s" for name, seconds in (
            ("torch.compile", self.compile_s), ("CUDA graphs", self.cuda_graphs_s),
            ("ranks", self.distributed_s), ("start", self.process_s)) if seconds]  # fmt: skip
        floor = f", at least {FLOOR_S:g} s" if self.timeout_s == FLOOR_S else ""
        return f"expected {self.expected_s:.0f} s ({', '.join(parts)}) x {self.margin:g}{floor}"


def checkpoint_bytes(arch: ModelArch) -> int:
    """The checkpoint's bytes on disk: its safetensors headers' counts at their stored dtypes, else the ledger's
    weights of one whole replica in the checkpoint's own quantization and dtype (``torch_dtype``)."""
    if arch.checkpoint is not None:
        counts = arch.checkpoint.parameters
        if all(dtype in DTYPE_BYTES for dtype in counts):
            return int(sum(count * DTYPE_BYTES[dtype] for dtype, count in counts.items()))
    width = {"float32": 4, "float16": 2, "bfloat16": 2}.get(str(arch.torch_dtype), 2)
    return weight_bytes_per_rank(arch, arch.quant, width)  # the ledger's formula, in the checkpoint's quantization


def startup_budget(
    arch: ModelArch,
    *,
    device: str = "gpu",
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    enforce_eager: bool = False,
    load_gbps: float = LOAD_GBPS,
) -> StartupBudget:
    """The budget for one engine of ``arch`` with TP x PP ranks a replica and ``dp`` replicas (see the module)."""
    size = checkpoint_bytes(arch)
    load_s = size * dp / (load_gbps * 1e9)
    compile_s = 0.0 if enforce_eager else COMPILE_BASE_S + COMPILE_PER_LAYER_S * cdiv(arch.num_layers, pp)
    graphs_s = CUDA_GRAPHS_S if device == "gpu" and not enforce_eager else 0.0
    ranks_s = DISTRIBUTED_PER_RANK_S * (tp * pp - 1)
    expected = load_s + compile_s + graphs_s + ranks_s + PROCESS_S
    return StartupBudget(
        timeout_s=round(max(FLOOR_S, MARGIN * expected)), expected_s=expected, checkpoint_bytes=size,
        load_gbps=load_gbps, load_s=load_s, compile_s=compile_s, cuda_graphs_s=graphs_s, distributed_s=ranks_s,
    )  # fmt: skip


def unsized(reason: str) -> StartupBudget:
    """The budget where the checkpoint cannot be sized: the fixed timeout of before, and why."""
    return StartupBudget(timeout_s=UNSIZED_S, reason=f"not sized from the checkpoint ({reason})")
