import pytest

from servetune.config.slo import Slo
from servetune.errors import UserError
from servetune.metrics import RequestRecord
from servetune.summary import summarize


def test_parse_and_request_bounds():
    slo = Slo.parse("ttft_ms.p95=800, ttft_ms.p99=2000,tpot_ms.p95=40,error_rate=0.001")
    assert [b.name for b in slo.bounds] == ["ttft_ms_p95", "ttft_ms_p99", "tpot_ms_p95", "error_rate"]
    assert slo.request_bounds_ms() == {"ttft_ms": 800, "tpot_ms": 40}


@pytest.mark.parametrize(
    "text, needle",
    [
        ("ttft.p99=2000", "unknown metric 'ttft'"),
        ("ttft_ms.p42=2000", "unknown statistic 'p42'"),
        ("ttft_ms.p99", "not METRIC.STAT=BOUND"),
        ("ttft_ms.p99=fast", "not a number"),
        ("ttft_ms=100", "needs a statistic"),
        ("ttft_ms.p99=-1", "greater than 0"),
    ],
)
def test_bad_slo_is_one_clear_line(text, needle):
    with pytest.raises(UserError, match=needle) as info:
        Slo.parse(text)
    assert "\n" not in str(info.value)


def test_violations():
    r = RequestRecord(
        index=0, sent=0.0, input_tokens=1, max_tokens=2, chunk_times=[1.5, 1.6], end=1.6, output_tokens=2, ok=True
    )
    s = summarize([r], {"concurrency": 1})
    assert Slo.parse("ttft_ms.p99=2000").violations(s) == []
    broken = Slo.parse("ttft_ms.p99=1000,e2el_ms.p50=5000").violations(s)
    assert len(broken) == 1 and broken[0].startswith("ttft_ms_p99 = 1500")
