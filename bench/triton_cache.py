"""How much of a cold ``torch.compile`` a shared Triton cache saves when the graph's key changes.

vLLM keys its compile cache on the configuration (``VllmConfig.compute_hash``, which holds
``max_num_seqs`` and ``max_num_batched_tokens``) and points Inductor's cache inside that keyed
directory, so a trial with another ``max_num_batched_tokens`` compiles cold. Triton's cache is
the exception: vLLM keeps a ``TRITON_CACHE_DIR`` its caller set (``InductorAdaptor.initialize_cache``),
and Triton keys each kernel on its own source, so kernels that come out the same for another
bound on the token count load instead of compiling.

This script measures that on the GPU it runs on, with a Llama-3.1-8B-shaped stack of decoder
layers (bf16, GQA, SDPA attention left to its own kernel as vLLM leaves attention out of its
compiled pieces), compiled with a dynamic token count bounded as ``max_num_batched_tokens``
bounds vLLM's. Each variant is a fresh process with its own caches:

- ``cold``: empty Inductor and Triton caches, bound 8192;
- ``triton_warm``: an empty Inductor cache (another key) but ``cold``'s Triton cache, bound 2048:
  a trial with another ``max_num_batched_tokens`` when the node shares Triton's cache;
- ``full_warm``: ``cold``'s Inductor and Triton caches, bound 8192: vLLM's own cache hit;
- ``cold_again``: empty caches, bound 2048: the cold time again (its noise).

    python3 bench/triton_cache.py --json OUT   # on a GPU; a small stack runs on a CPU to try it out
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = (  # name, Inductor cache, Triton cache, token bound
    ("cold", "inductor_a", "triton_a", 8192),
    ("triton_warm", "inductor_b", "triton_a", 2048),
    ("full_warm", "inductor_a", "triton_a", 8192),
    ("cold_again", "inductor_c", "triton_c", 2048),
)


def worker(args: argparse.Namespace) -> dict:
    """One fresh process: build the stack, compile it on its first call, time each phase."""
    started = time.perf_counter()
    import torch
    import torch.nn.functional as F

    imported = time.perf_counter()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    hidden, heads, kv_heads, ffn = (4096, 32, 8, 14336) if cuda else (256, 8, 2, 512)
    head_dim = hidden // heads

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1 = torch.nn.RMSNorm(hidden)
            self.qkv = torch.nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False)
            self.out = torch.nn.Linear(heads * head_dim, hidden, bias=False)
            self.norm2 = torch.nn.RMSNorm(hidden)
            self.gate_up = torch.nn.Linear(hidden, 2 * ffn, bias=False)
            self.down = torch.nn.Linear(ffn, hidden, bias=False)

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            tokens = x.shape[0]
            q, k, v = self.qkv(self.norm1(x)).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
            q = q.view(tokens, heads, head_dim)
            k = k.view(tokens, kv_heads, head_dim)

            def rotate(t: torch.Tensor) -> torch.Tensor:
                a, b = t.chunk(2, -1)
                return t * cos[:, None] + torch.cat([-b, a], -1) * sin[:, None]

            q, k = rotate(q).transpose(0, 1)[None], rotate(k).transpose(0, 1)[None]
            v = v.view(tokens, kv_heads, head_dim).transpose(0, 1)[None]
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.out(attn[0].transpose(0, 1).reshape(tokens, heads * head_dim))
            gate, up = self.gate_up(self.norm2(x)).chunk(2, -1)
            return x + self.down(F.silu(gate) * up)

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(Layer() for _ in range(args.layers))
            self.norm = torch.nn.RMSNorm(hidden)

        def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            inv = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32) / head_dim))
            angles = positions[:, None].float() * inv[None]
            cos = torch.cat([angles.cos(), angles.cos()], -1).to(x.dtype)
            sin = torch.cat([angles.sin(), angles.sin()], -1).to(x.dtype)
            for layer in self.layers:
                x = layer(x, cos, sin)
            return self.norm(x)

    with torch.device(device):
        model = Stack().to(dtype).eval()
    built = time.perf_counter()
    compiled = torch.compile(model)

    def call(tokens: int) -> float:
        x = torch.randn(tokens, hidden, device=device, dtype=dtype)
        positions = torch.arange(tokens, device=device)
        torch._dynamo.mark_dynamic(x, 0, min=2, max=args.max_tokens)
        torch._dynamo.mark_dynamic(positions, 0, min=2, max=args.max_tokens)
        t0 = time.perf_counter()
        with torch.no_grad():
            compiled(x, positions)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    first = call(args.max_tokens // 2)
    other = call(args.max_tokens // 4 + 1)
    triton_dir = Path(os.environ["TRITON_CACHE_DIR"])
    return {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
        "layers": args.layers, "max_tokens": args.max_tokens,
        "import_s": round(imported - started, 2), "build_s": round(built - imported, 2),
        "first_call_s": round(first, 2), "second_size_call_s": round(other, 3),
        "triton_cache_files": sum(1 for p in triton_dir.rglob("*") if p.is_file()) if triton_dir.exists() else 0,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=4, help="decoder layers in the stack (Llama-3.1-8B has 32)")
    parser.add_argument("--json", type=Path, help="write the measurements here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--max-tokens", type=int, default=8192, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    root = Path(tempfile.mkdtemp(prefix="triton-cache-"))
    out: dict = {"variants": {}}
    for name, inductor, triton, bound in VARIANTS:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / inductor), "TRITON_CACHE_DIR": str(root / triton)}
        command = [sys.executable, __file__, "--worker", "--layers", str(args.layers), "--max-tokens", str(bound)]
        t0 = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            out["variants"][name] = {"error": done.stderr[-2000:]}
        else:
            out["variants"][name] = {
                **json.loads(done.stdout.strip().splitlines()[-1]),
                "process_s": round(time.perf_counter() - t0, 2),
            }
        print(name, json.dumps(out["variants"][name]), flush=True)
        if args.json:
            args.json.write_text(json.dumps(out, indent=1))
    cold = [v["first_call_s"] for k, v in out["variants"].items() if k.startswith("cold") and "first_call_s" in v]
    warm = out["variants"].get("triton_warm", {}).get("first_call_s")
    if cold and warm is not None:
        out["triton_warm_share_of_cold"] = round(warm / (sum(cold) / len(cold)), 3)
        print(f"compile with a shared Triton cache: {warm:.1f} s against {sum(cold) / len(cold):.1f} s cold "
              f"({out['triton_warm_share_of_cold']:.0%})")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
