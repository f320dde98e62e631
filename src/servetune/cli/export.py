"""``servetune export``: one operating point of a study as a command or config to deploy."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DESCRIPTION = """\
Print the configuration of one operating point of a study:

  --format vllm       the `vllm serve MODEL --flag ...` command, with its environment
                      (secrets shown as ***)
  --format ray-serve  a Ray Serve LLM application config for `serve run` (ray.serve.llm
                      LLMConfig: model_loading_config, engine_kwargs, deployment_config with
                      data parallelism as replicas, accelerator_type when given),
                      with Serve's autoscaling derived from the trial's measured knee
                      (the highest level meeting the SLO): min/max replicas,
                      target_ongoing_requests, max_ongoing_requests, the hard queue cap
                      max_queued_requests, delays; the reasoning as comments; and
                      the router `servetune serve-check --routers` measured best for
                      this trial (request_router_config), when it named one,
                      and the stream batching interval serve-check deployed it at
                      (--stream-batching-ms), in place of the trial's own; with
                      --keep-ingress, the ingress and the engines as two applications, so
                      that `serve deploy` of another point replaces only the engines
  --format json       the configuration and its measured numbers
  --format kubernetes a Deployment running `vllm serve` with the same flags (GPUs = TP x PP x DP,
                      /dev/shm in memory, /health probes, secrets from a Secret by reference),
                      a Service, and an autoscaler on what predicts an SLO breach, with the
                      thresholds derived as for ray-serve: requests in flight and requests
                      waiting per replica, and the fullest engine's KV-cache usage (the most
                      replicas any asks for; --autoscaling-policy inflight: in flight only);
                      an autoscaling/v2 HPA (--autoscaler hpa, the default) or a KEDA
                      ScaledObject with a Prometheus trigger per signal (--autoscaler keda);
                      each threshold's origin in the object's annotations
  --format kserve     a KServe InferenceService (serving.kserve.io/v1beta1) with the same container,
                      scaled by KEDA on the same signals (raw deployment mode)
  --format llm-d      the values of llm-d's ModelService Helm chart (llm-d-incubation/llm-d-modelservice
                      v0.3.8): decode pods with the same container, tensor/data parallelism as the chart
                      names them, replicas fixed at what the peak needs (the chart makes no autoscaler),
                      no prefill pods (no disaggregation), no routing sidecar; the model as hf://ID or a
                      PersistentVolumeClaim holding the local directory
  --format prometheus-rules
                      Prometheus alerting rules (groups:, a PrometheusRule's spec): latency
                      percentiles over the SLO's bounds, a growing queue, KV-cache usage where
                      the trial saw preemptions (else 0.9), preemptions, and request rate above
                      80% of the capacity measured; each says where its threshold came from
  --format grafana    a Grafana dashboard (JSON) with a panel per alert's signal and its threshold

--pick best (default) is the recommendation of `servetune report`; --pick N is row N
(counting from 0) of the cost vs P99 TTFT Pareto table, cheapest first, as summary.md and
report.html number it; --pick TRIAL_ID is that trial at its level at capacity where the capacity search
found a bracket, else at its best level meeting the SLO (else the highest load it measured).

Engine arguments the trial left to vLLM (max_num_seqs, max_num_batched_tokens, block size...)
are pinned at the values vLLM resolved when the trial started, so the shipped configuration
does not change when vLLM's defaults do.
"""


FORMATS = ("vllm", "ray-serve", "json", "kubernetes", "kserve", "llm-d", "prometheus-rules", "grafana")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export",
        help="one operating point as a vllm serve command, a Ray Serve LLM config, Kubernetes/KServe objects, or JSON",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: servetune export servetune-results/chat-latency --pick best --format ray-serve > serve.yaml",
    )
    p.add_argument("study_dir", type=Path, metavar="STUDY_DIR", help="the study directory (servetune-results/<study>)")
    p.add_argument(
        "--pick", default="best", metavar="best|N|TRIAL_ID",
        help="best (the recommendation, default), a row of the cost vs P99 TTFT Pareto table, or a trial id",
    )  # fmt: skip
    p.add_argument("--format", required=True, choices=FORMATS, help="what to print")
    p.add_argument(
        "--price-per-gpu-hour", type=float, metavar="X",
        help="cost with this price per device-hour, as `servetune report --price-per-gpu-hour` does",
    )  # fmt: skip
    p.add_argument("--accelerator-type", metavar="NAME", help="Ray accelerator type for --format ray-serve, e.g. H100")
    p.add_argument(
        "--peak", type=float, metavar="X",
        help="for --format ray-serve|kubernetes|kserve|llm-d|prometheus-rules: the peak load to scale out to, in the ladder's unit (clients in flight, or "
             "req/s for a rate ladder); default: the top of the study's ladder",
    )  # fmt: skip
    p.add_argument(
        "--image", metavar="IMAGE",
        help="for --format kubernetes|kserve|llm-d: the vLLM server image (default: vllm/vllm-openai:v0.32.0)",
    )  # fmt: skip
    p.add_argument(
        "--autoscaler", choices=("hpa", "keda"), default="hpa",
        help="for --format kubernetes: an autoscaling/v2 HPA (default) or a KEDA ScaledObject",
    )  # fmt: skip
    p.add_argument(
        "--prometheus-url", metavar="URL",
        help="for --autoscaler keda and --format kserve: the Prometheus KEDA queries (default: http://prometheus-operated.monitoring.svc:9090)",
    )  # fmt: skip
    p.add_argument(
        "--headroom", type=float, default=0.8, metavar="X",
        help="for --format ray-serve, kubernetes, kserve, llm-d: autoscale each replica at X times the lower of its capacity at the SLO and its "
             "knee (where throughput stops growing with load); default 0.8",
    )  # fmt: skip
    p.add_argument(
        "--autoscaling-policy", choices=("inflight", "predictive"),
        help="for --format ray-serve|kubernetes|kserve: scale on requests in flight only, or also on what predicts a "
             "breach, requests waiting and KV-cache usage, at thresholds derived from the study. Default: inflight "
             "for ray-serve (predictive is servetune's custom Serve policy: servetune must be installed on the "
             "cluster), predictive for kubernetes and kserve (the autoscaler takes the most replicas of its "
             "Prometheus metrics)",
    )  # fmt: skip
    p.add_argument(
        "--keep-ingress", action="store_true",
        help="for --format ray-serve: write the OpenAI ingress and the engines as two applications, so that `serve "
             "deploy` of another point's config replaces only the engine replicas and keeps the ingress (servetune "
             "must be importable on the cluster)",
    )  # fmt: skip
    p.add_argument("--skip-unreadable", action="store_true", help="do not stop at an invalid result.json")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from servetune.report import build_report, deploy, load_study
    from servetune.report.autoscale import Autoscaling
    from servetune.report.export import (
        admission_for,
        autoscaling_for,
        pick_point,
        point_json,
        ray_serve_yaml,
        vllm_command,
    )

    report = build_report(load_study(args.study_dir, args.skip_unreadable), args.price_per_gpu_hour)
    point = pick_point(report, args.pick)
    policy = args.autoscaling_policy or ("inflight" if args.format == "ray-serve" else "predictive")

    def derived_autoscaling() -> Autoscaling | str:
        derived = autoscaling_for(report, point, args.peak, args.headroom)
        return derived if isinstance(derived, str) else derived.with_policy(policy)

    if args.format == "vllm":
        text = vllm_command(point, admission_for(report, point))
    elif args.format == "ray-serve":
        checked = report.serve_check
        text = ray_serve_yaml(
            point, args.accelerator_type, derived_autoscaling(),
            checked.router if checked else None, checked.layout if checked else None,
            checked.stream_batching if checked else None, args.keep_ingress,
        )  # fmt: skip
    elif args.format == "kubernetes":
        text = deploy.kubernetes_yaml(
            point, derived_autoscaling(), args.image or deploy.DEFAULT_IMAGE, args.autoscaler,
            args.prometheus_url or deploy.DEFAULT_PROMETHEUS, admission_for(report, point),
        )  # fmt: skip
    elif args.format == "kserve":
        text = deploy.kserve_yaml(
            point, derived_autoscaling(), args.image or deploy.DEFAULT_IMAGE,
            args.prometheus_url or deploy.DEFAULT_PROMETHEUS, admission_for(report, point),
        )  # fmt: skip
    elif args.format == "llm-d":
        from servetune.report.llmd import llmd_yaml

        text = llmd_yaml(point, derived_autoscaling(), args.image or deploy.DEFAULT_IMAGE, admission_for(report, point))
    elif args.format in ("prometheus-rules", "grafana"):
        from servetune.report import alerts

        trial_points = [p for p in report.points if p.trial_id == point.trial_id]
        rules = alerts.alert_rules(point, trial_points, report.slo, autoscaling_for(report, point, args.peak))
        write = alerts.prometheus_rules_yaml if args.format == "prometheus-rules" else alerts.grafana_json
        text = write(point, rules)
    else:
        text = point_json(report, point)
    sys.stdout.write(text)
    return 0
