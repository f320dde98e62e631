import os

from servetune.telemetry import TelemetrySampler, visible_gpu_indices


def test_a_level_shorter_than_the_interval_still_gets_a_sample():
    with TelemetrySampler(None, os.getpid(), interval_s=60) as sampler:
        sum(range(100_000))
    summary = sampler.summary()
    assert summary["host_cpu_percent_mean"] >= 0 and summary["engine_rss_gib_max"] > 0
    assert not any(key.startswith("gpu_") for key in summary)  # no GPU indices given: the host is sampled


def test_visible_gpus_follow_cuda_visible_devices():
    assert visible_gpu_indices({"CUDA_VISIBLE_DEVICES": "2,3"}) == [2, 3]
    assert visible_gpu_indices({"CUDA_VISIBLE_DEVICES": ""}) == []
