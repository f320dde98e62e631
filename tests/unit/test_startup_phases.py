"""Start-up phases read from vLLM's own log lines (engine/startup.py) and where the report shows them."""

import pytest

from servetune.accounting import device_time_lines, startup_lines
from servetune.engine.startup import startup_phases
from servetune.tracking.fields import trial_metrics
from tests.builders import level, trial

GPU_LOG = """\
(EngineCore pid=1) INFO 12-01 10:00:01 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='m'
(Worker pid=2) INFO 12-01 10:00:09 [gpu_model_runner.py:5150] Model loading took 14.99 GiB memory and 5.270000 seconds
(Worker pid=2) INFO 12-01 10:00:30 [monitor.py:40] torch.compile took 21.30 s in total
(Worker pid=2) INFO 12-01 10:00:44 [gpu_model_runner.py:6582] Graph capturing finished in 12 secs, took 0.55 GiB
(EngineCore pid=1) INFO 12-01 10:00:45 [core.py:396] init engine (profile, create kv cache, warmup model) took 40.10 s (compilation: 21.30 s)
"""

CPU_LOG = """\
(Worker pid=3) INFO 12-01 03:41:29 [base_loader.py:82] Initializing model took 0.122900 seconds
(Worker pid=3) INFO 12-01 03:41:29 [default_loader.py:501] Loading weights took 0.03 seconds
(EngineCore pid=1) INFO 12-01 03:41:31 [core.py:402] init engine (profile, create kv cache, warmup model) took 1.25 s
"""


def test_gpu_start_up_phases():
    phases = startup_phases(GPU_LOG, startup_s=75.0)
    assert phases["load_weights_s"] == 5.27 and phases["compile_s"] == 21.3 and phases["cuda_graphs_s"] == 12.0
    assert phases["kv_profile_warmup_s"] == pytest.approx(
        40.1 - 21.3 - 12.0
    )  # compile and graphs run inside init engine
    assert phases["other_s"] == pytest.approx(75.0 - 5.27 - 40.1)
    assert phases["compile_cache_hit"] == 0.0
    hit = (
        GPU_LOG
        + "(Worker pid=2) INFO [backends.py:296] Directly load the compiled graph(s) for compile range (1, 8192) from the cache, took 2.1 s\n"
    )
    assert startup_phases(hit, 75.0)["compile_cache_hit"] == 1.0


# vllm/model_executor/model_loader/weight_utils.py: "Time spent downloading weights for %s: %.6f seconds".
DOWNLOAD = (
    "(Worker pid=2) INFO 12-01 10:00:08 [weight_utils.py:533] Time spent downloading weights for m: 93.512000 seconds\n"
)


def test_a_download_during_the_start_is_recorded_apart_from_loading_the_weights():
    gpu = startup_phases(GPU_LOG.replace("5.270000 seconds", f"{93.512 + 5.27:.6f} seconds") + DOWNLOAD, 170.0)
    assert gpu["download_s"] == pytest.approx(93.512) and gpu["load_weights_s"] == pytest.approx(5.27)
    assert gpu["other_s"] == pytest.approx(170.0 - 93.512 - 5.27 - 40.1)  # the download is a phase of its own
    cpu = startup_phases(DOWNLOAD + CPU_LOG, 130.0)  # the CPU loader's clock starts after the download
    assert cpu["download_s"] == pytest.approx(93.512) and cpu["load_weights_s"] == pytest.approx(0.1529, abs=1e-3)
    assert "download_s" not in startup_phases(GPU_LOG, 75.0)
    downloaded, cached = trial("d", {}, [level(1, 100, 10)]), trial("c", {}, [level(1, 100, 10)])
    downloaded.startup_phases, cached.startup_phases = gpu, startup_phases(GPU_LOG, 75.0)
    (line,) = startup_lines([downloaded, cached])
    assert "downloading weights (the starts that did) 93.5 s, loading weights 5.3 s" in line


def test_vllm_logs_the_download_and_the_cpu_loaders_clock_starts_after_it():
    from importlib.util import find_spec
    from pathlib import Path

    spec = find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    root = Path(next(iter(spec.submodule_search_locations))) / "model_executor" / "model_loader"
    assert '"Time spent downloading weights for %s: %.6f seconds"' in (root / "weight_utils.py").read_text()
    loader = (root / "default_loader.py").read_text()
    prepared = loader.index("self._prepare_weights(\n                source.model_or_path")
    assert prepared < loader.index("self.counter_before_loading_weights = time.perf_counter()")


def test_cpu_start_up_phases_and_a_log_without_them():
    phases = startup_phases(CPU_LOG, startup_s=36.5)
    assert (
        phases["load_weights_s"] == pytest.approx(0.1529, abs=1e-3)
        and "compile_s" not in phases
        and "cuda_graphs_s" not in phases
    )
    assert phases["other_s"] == pytest.approx(36.5 - 0.1529 - 1.25, abs=1e-3)
    assert startup_phases("no such lines\n", 30.0) == {}


def test_the_summary_and_mlflow_carry_the_phases():
    a, b = trial("a", {}, [level(8, 1000, 300)]), trial("b", {}, [level(8, 1000, 300)])
    for t, log in (
        (a, GPU_LOG),
        (b, GPU_LOG.replace("21.30 s in total", "1.00 s in total") + "Directly load the compiled graph(s)\n"),
    ):
        t.startup_s, t.duration_s = 75.0, 200.0
        t.startup_phases = startup_phases(log, 75.0)
    line = startup_lines([a, b])[0]
    assert line.startswith(
        "engine start-up, mean of 2: loading weights 5.3 s, torch.compile 11.2 s, CUDA graphs 12.0 s"
    )
    assert line.endswith("compile cache hit in 1 of 2")
    assert line in device_time_lines([a, b], "gpu", 1)
    assert {m.key: m.value for m in trial_metrics(a)}["startup/compile_s"] == 21.3
    assert startup_lines([trial("c", {})]) == []
