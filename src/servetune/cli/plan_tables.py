"""``servetune plan``'s tables: the memory ledger of a configuration and the estimate at ``--estimate``'s load."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from servetune.capacity import CapacityPlan
from servetune.estimate import Estimate, load_factors


def render_estimate(est: Estimate, console: Console) -> None:
    """The estimate under ``--estimate``'s load, with the expected error of the shipped fit."""
    errors = load_factors().held_out_error
    table = Table(title="estimate (roofline + queueing, calibrated)", title_justify="left", show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("expected error (held-out median)")

    def err(metric: str) -> str:
        return f"±{100 * errors[metric].median:.0f}%" if metric in errors else ""

    table.add_row("ttft_ms", "unbounded (saturated)" if est.ttft_ms is None else f"{est.ttft_ms:,.1f}", err("ttft_ms"))
    table.add_row("tpot_ms / itl_ms", f"{est.tpot_ms:,.2f}", err("tpot_ms"))
    table.add_row("output_throughput", f"{est.output_throughput:,.0f} tok/s", err("output_throughput"))
    table.add_row("request_throughput", f"{est.request_throughput:,.2f} req/s", "")
    table.add_row("saturated", "yes" if est.saturated else "no", "")
    if est.slot_wait is not None and not est.saturated:  # an open loop's TTFT: which wait for a slot it holds
        level = est.slot_wait == "level" and est.level_requests is not None
        table.add_row("wait for a slot", f"a level of {est.level_requests:,} requests" if level else "the long run's",
                      "sent into an empty queue" if level else "no --num-requests: near capacity, above a level's")  # fmt: skip
    table.add_row("knee", f"{est.knee} in flight", "throughput grows < 10% past it")
    if est.encoder_ms is not None:
        table.add_row("vision encoder", f"{est.encoder_ms:,.1f} ms a request", "in its TTFT")
    if est.accepted_length is not None:
        table.add_row("accepted length", f"{est.accepted_length:.2f} tokens a step", est.acceptance_source or "")
    console.print(table)


def _gib(value: float) -> str:
    return f"{value * 1024:,.1f} MiB" if abs(value) < 1 else f"{value:,.2f} GiB"


def _draft_rows(plan: CapacityPlan, ledger: Table) -> None:
    """Speculative decoding's lines: what the drafter is, its share of the KV, and the tokens a step verifies."""
    d, s = plan.draft, plan.settings
    assert d is not None
    ledger.add_row("speculative decoding", f"{d.method}, k={d.num_speculative_tokens}", d.source)
    ledger.add_row("  of which draft KV", f"{d.kv_bytes_per_token:,} B", f"{d.kv_layers} draft KV layer(s), same pool")
    ledger.add_row(
        "  tokens verified a step",
        f"{d.verify_tokens:,}",
        f"{s.max_num_seqs} seqs x (1 + {d.num_speculative_tokens}); {d.decode_seqs_per_step} seqs fit "
        f"max_num_batched_tokens {s.max_num_batched_tokens:,}",
    )
    if d.lookahead_tokens:
        ledger.add_row("  draft lookahead", f"{d.lookahead_tokens} tokens", "KV slots per request past the verified")


def render(plan: CapacityPlan, console: Console) -> None:
    s = plan.settings
    where = f"{s.gpu} ({s.gpu_memory_gib:g} GiB)" if s.device == "gpu" else "vLLM CPU build"
    layout = f"TP {s.tensor_parallel_size} x PP {s.pipeline_parallel_size}"
    if s.prefill_context_parallel_size > 1:
        layout += f" x PCP {s.prefill_context_parallel_size}"
    if s.decode_context_parallel_size > 1:  # over the TP (or PCP) ranks: no GPU of its own
        layout += f", DCP {s.decode_context_parallel_size}"
    if s.data_parallel_size > 1 or s.enable_expert_parallel:
        layout += f" (DP {s.data_parallel_size}{', expert parallel' if s.enable_expert_parallel else ''})"
    title = f"{plan.model} ({plan.parameters_b:g}B params) on {where}, {layout}"
    ledger = Table(title=title, title_justify="left", show_header=False)
    ledger.add_column("item")
    ledger.add_column("per GPU" if s.device == "gpu" else "per rank", justify="right")
    ledger.add_column("from")
    if s.device == "gpu":
        ledger.add_row(
            "budget",
            _gib(plan.requested_gib),
            f"gpu_memory_utilization {s.gpu_memory_utilization:g} x {s.gpu_memory_gib:g} GiB",
        )
        ledger.add_row("- weights", _gib(plan.weights_gib), f"dtype {s.dtype}, quantization {s.quantization}")
        if plan.draft is not None and plan.draft.weights_gib:
            ledger.add_row("- draft weights", _gib(plan.draft.weights_gib), plan.draft.source)
        if plan.lora_gib:
            ledger.add_row("- LoRA slots", _gib(plan.lora_gib), "max_loras x max_lora_rank, every linear layer")
        ledger.add_row(
            "- activation peak",
            _gib(plan.activation_gib),
            f"{s.max_num_batched_tokens:,} batched tokens, {s.max_num_seqs} seqs sampled",
        )
        comms = "NCCL / all-reduce buffers, " if s.tensor_parallel_size * s.pipeline_parallel_size > 1 else ""
        ledger.add_row("- non-torch + buffers", _gib(plan.non_torch_gib), f"{comms}CUDA context, runtime buffers")
        ledger.add_row(
            "- CUDA graphs", _gib(plan.cudagraph_gib), "enforce_eager" if s.enforce_eager else "vLLM's capture estimate"
        )
    else:
        ledger.add_row("KV space", _gib(plan.requested_gib), f"VLLM_CPU_KVCACHE_SPACE={s.cpu_kvcache_space_gib}")
        ledger.add_row("weights (host memory)", _gib(plan.weights_gib), f"dtype {s.dtype}; not taken from the KV space")
        if plan.draft is not None and plan.draft.weights_gib:
            ledger.add_row("draft weights (host memory)", _gib(plan.draft.weights_gib), plan.draft.source)
        if plan.lora_gib:
            ledger.add_row("LoRA slots (host memory)", _gib(plan.lora_gib), "not taken from the KV space")
    ledger.add_row("= KV pool", _gib(plan.kv_cache_gib), f"kv_cache_dtype {s.kv_cache_dtype}")
    ledger.add_row("KV bytes per token", f"{plan.kv_bytes_per_token:,} B", f"block size {s.block_size}")
    if plan.draft is not None:
        _draft_rows(plan, ledger)
    ledger.add_row("KV blocks / tokens", f"{plan.kv_cache_blocks:,} / {plan.kv_cache_tokens:,}", "")
    ledger.add_row("KV per full request", _gib(plan.kv_gib_per_request), f"max_model_len {s.max_model_len:,}")
    ledger.add_row("max concurrency", f"{plan.max_concurrency:.2f}x", f"requests of {s.max_model_len:,} tokens")
    if plan.mamba_layers:
        ledger.add_row(
            "Mamba state per sequence",
            _gib(plan.mamba_state_bytes_per_sequence / 2**30),
            f"{plan.mamba_layers} layers, {plan.mamba_state_blocks_per_sequence} pool blocks, whatever the length",
        )
        if plan.max_sequences is not None:
            ledger.add_row("max sequences at once", f"{plan.max_sequences:,}", "state + first KV block each")
    if plan.request_tokens != s.max_model_len:
        ledger.add_row(
            "  at request length",
            f"{plan.max_concurrency_at_request:.2f}x",
            f"requests of {plan.request_tokens:,} tokens",
        )
    ledger.add_row("vLLM memory profile", s.profile, "--vllm-version, else the installed vLLM")
    reach = "[green]yes[/]" if plan.max_num_seqs_reachable else "[yellow]no[/]"
    ledger.add_row("max_num_seqs reachable", reach, f"max_num_seqs {s.max_num_seqs}")
    console.print(ledger)
    verdict = "[bold green]fits[/]" if plan.fits else "[bold red]does not fit[/]"
    console.print(f"{verdict}: {plan.reason}")
    for line in plan.advice:
        console.print(f"  - {line}")
    for note in plan.notes:
        console.print(f"  [dim]note: {note}[/]")
