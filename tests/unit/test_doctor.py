"""servetune doctor's verdicts (servetune/doctor.py) from nodes' facts as the probe gathers them."""

from servetune.doctor import evaluate, failed, node_facts

DRIVER = {"vllm": "0.32.0", "ray": "2.60.0", "servetune": "0.2.0", "torch": "2.13.0"}


def node(**over):
    facts = {**DRIVER, "gpus": [{"index": i, "name": "NVIDIA H100 80GB HBM3", "total_gib": 79.6, "used_gib": 0.5,
                                 "mig": False, "pids": []} for i in range(2)],
             "ray_resources": {"CPU": 32, "GPU": 2}, "niceness": 0, "shm_gib": 64.0, "metrics_interval_ms": 1000,
             "vllm_cache": {"path": "/home/u/.cache/vllm", "filesystem": "ext4", "writable": True}}  # fmt: skip
    facts.update(over)
    return facts


def by_name(checks):
    return {(c.node, c.name): c for c in checks}


def test_a_healthy_gpu_node_passes():
    checks = evaluate({"a" * 16: node()}, DRIVER, gpu="H100-SXM")
    assert not failed(checks) and not [c for c in checks if c.status == "WARN"], checks
    assert by_name(checks)[("a" * 12, "GPUs")].evidence.startswith("2 x NVIDIA H100")


def test_a_gpu_another_process_holds_is_named_with_its_pids():
    held = node()
    held["gpus"][1].update(used_gib=40.2, pids=[4242])
    (bad,) = failed(evaluate({"n1": held}, DRIVER))
    assert bad.name == "GPU free" and "GPU 1" in bad.evidence and "40.2 GiB" in bad.evidence and "4242" in bad.evidence


def test_versions_shm_niceness_mig_and_gpu_type_each_say_what_is_wrong():
    odd = node(vllm="0.29.0", torch="2.11.0", shm_gib=0.06, niceness=15, metrics_interval_ms=10000)
    odd["gpus"][0]["mig"] = True
    checks = by_name(evaluate({"n1": odd}, DRIVER, gpu="A100-80GB", serve=True))
    assert checks[("n1", "vllm version")].status == "FAIL" and "0.29.0 here, 0.32.0 on the driver" in (
        checks[("n1", "vllm version")].evidence
    )
    assert {checks[("n1", n)].status for n in ("torch version", "/dev/shm", "worker niceness", "metrics interval",
                                                  "MIG", "GPU type")} == {"WARN"}  # fmt: skip
    assert "A100-80GB" in checks[("n1", "GPU type")].evidence


def test_ray_s_gpus_against_nvml_and_the_cpu_build_needing_none():
    assert failed(evaluate({"n1": node(gpus=None)}, DRIVER))[0].evidence.startswith("Ray advertises 2 GPU(s), NVML")
    one = node()
    one["gpus"] = one["gpus"][:1]
    assert "NVML sees 1" in failed(evaluate({"n1": one}, DRIVER))[0].evidence
    assert not failed(evaluate({"n1": node(gpus=None)}, DRIVER, device="cpu"))  # the CPU stand-in: no GPU checks


def test_the_space_s_gpu_type_must_be_a_type_some_node_declares():
    h100 = node(ray_resources={"CPU": 32, "GPU": 2, "accelerator_type:H100": 1.0})
    a100 = node(ray_resources={"CPU": 32, "GPU": 8, "accelerator_type:A100": 1.0})
    (bad,) = [c for c in failed(evaluate({"n1": h100, "n2": a100}, DRIVER, gpu="L40S")) if c.node == "cluster"]
    assert bad.name == "GPU type placement" and "L40S (Ray type L40S) is on no node" in bad.evidence
    assert "the cluster's GPUs are A100, H100" in bad.evidence
    ok = by_name(evaluate({"n1": h100, "n2": a100}, DRIVER, gpu="H100-PCIe"))[("cluster", "GPU type placement")]
    assert ok.status == "PASS" and "1 node(s)" in ok.evidence
    # Nodes that declare no type (GPUs given by hand) pin nothing, and are not judged.
    assert ("cluster", "GPU type placement") not in by_name(evaluate({"n1": node()}, DRIVER, gpu="L40S"))


def test_an_unreachable_node_a_missing_model_and_an_unwritable_cache_fail():
    checks = evaluate({"n1": {"error": "task failed"}, "n2": node(model_present=False,
                       vllm_cache={"path": "/ro/vllm", "filesystem": "ext4", "writable": False})}, DRIVER)  # fmt: skip
    assert {(c.node, c.name) for c in failed(checks)} == {("n1", "reachable"), ("n2", "model"), ("n2", "vLLM cache")}


def test_this_machine_s_facts_have_what_the_checks_read(tmp_path):
    facts = node_facts(str(tmp_path))
    assert facts["ray"] and facts["servetune"] and facts["model_present"] is False
    assert {"gpus", "niceness", "shm_gib", "vllm_cache", "metrics_interval_ms"} <= set(facts)


def test_a_mig_board_s_slices_are_read_counted_as_ray_hands_them_and_named(monkeypatch):
    """NVML's facts of a node whose GPU 1 is in MIG mode (the fake pynvml of test_telemetry): its slices with their
    profiles, memory and UUIDs; Ray advertising either the boards or the slices passes; another count fails."""
    import sys

    from servetune.doctor import _gpus
    from tests.unit.test_telemetry import MIG_UUIDS, fake_nvml

    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml({}, slices={1: ["3g.40gb", "1g.10gb"]}))
    gpus = _gpus()
    assert [g["mig"] for g in gpus] == [False, True] and "slices" not in gpus[0]
    assert [(s["profile"], s["total_gib"], s["uuid"]) for s in gpus[1]["slices"]] == [
        ("3g.40gb", 40.0, MIG_UUIDS[0]), ("1g.10gb", 10.0, MIG_UUIDS[1])]  # fmt: skip
    for advertised in (2, 3):  # the two boards, or GPU 0 and the two slices (CUDA_VISIBLE_DEVICES=GPU-...,MIG-...)
        checks = by_name(evaluate({"n1": node(gpus=gpus, ray_resources={"CPU": 32, "GPU": advertised})}, DRIVER))
        assert checks[("n1", "GPUs")].status == "PASS" and "2 MIG slice(s): 3g.40gb 40.0 GiB" in (
            checks[("n1", "GPUs")].evidence
        )
    checks = by_name(evaluate({"n1": node(gpus=gpus, ray_resources={"CPU": 32, "GPU": 4})}, DRIVER))
    assert checks[("n1", "GPUs")].status == "FAIL" and "NVML sees 2 (2 MIG slice(s)" in checks[("n1", "GPUs")].evidence
    mig = checks[("n1", "MIG")]
    assert (
        mig.status == "WARN"
        and "3g.40gb 40.0 GiB" in mig.evidence
        and "no utilization, power or energy" in (mig.evidence)
    )
