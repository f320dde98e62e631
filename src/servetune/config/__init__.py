"""Typed, validated configuration: workloads, SLOs, load protocol."""
