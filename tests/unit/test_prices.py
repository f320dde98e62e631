"""The price list: the shipped table, a space's own prices over it, and the price a trial is costed at."""

import datetime
from typing import get_args

import pytest

from servetune.capacity.hardware import load_gpu_catalog
from servetune.capacity.prices import PRICE_LIST_FILES, PriceList, Pricing, load_price_table, price_table
from servetune.errors import UserError
from tests.unit.test_space import space


def test_every_shipped_price_list_has_its_file_and_each_file_is_a_list():
    assert set(PRICE_LIST_FILES) == set(get_args(PriceList))
    assert len(set(PRICE_LIST_FILES.values())) == len(PRICE_LIST_FILES)
    for name in PRICE_LIST_FILES:
        assert load_price_table(name), name


@pytest.mark.parametrize("price_list", list(PRICE_LIST_FILES))
def test_every_shipped_price_is_a_known_gpus_with_a_public_source_and_a_date(price_list):
    table = load_price_table(price_list)
    if price_list == "default":
        assert {"H100-SXM", "H200", "A100-80GB", "L40S", "L4"} <= set(table)
    else:  # each hyperscaler's list has its H100 and A100 instances
        assert {"H100-SXM", "A100-80GB", "A100-40GB"} <= set(table)
    catalog = load_gpu_catalog()
    for name, price in table.items():
        assert name in catalog, name  # keyed as the GPU catalogue names its GPUs, so NVML's names find them
        assert price.source.startswith("https://") and price.provider, name
        assert isinstance(price.date, datetime.date) and price.usd_per_device_hour > 0, name


UNITS_PER_HOUR = {"hour": 1, "second": 3600}
#: The reports' studies name a made-up hub id (tests/builders.py): its size is unknown here, and no hub is asked for it.
pytestmark = pytest.mark.usefixtures("no_hub")


@pytest.mark.parametrize("price_list", list(PRICE_LIST_FILES))
def test_every_shipped_price_shows_its_derivation_and_the_arithmetic_gives_the_price(price_list):
    for name, price in load_price_table(price_list).items():
        d = price.derivation
        assert d is not None and d.offer and d.region and d.billing == "on-demand", name
        assert d.listed_usd * UNITS_PER_HOUR[d.per] / d.gpus == pytest.approx(price.usd_per_device_hour, abs=5e-5), name
        assert price.page_date is None or price.page_date <= price.date, name  # a page cannot be read before its date
        if price.evidence == "secondary":  # a page quoting the provider: the note says whose price and why
            assert price.note and price.page_date is not None, name


#: Where each hyperscaler's list reads its prices (the region the issue asks for).
REGIONS = {"aws": "us-east-1", "gcp": "us-central1", "azure": "eastus"}


@pytest.mark.parametrize("price_list", list(REGIONS))
def test_a_hyperscalers_price_per_gpu_hour_is_its_instance_price_over_the_instances_gpus(price_list):
    for name, price in load_price_table(price_list).items():
        d = price.derivation
        assert d is not None and d.per == "hour" and d.region == REGIONS[price_list], name
        assert price.usd_per_device_hour == pytest.approx(d.listed_usd / d.gpus, abs=5e-5), name
        assert d.offer.split()[0] in price.provider, name  # the instance is named where the report cites the price
        if d.gpus == 1 and "as listed" in d.offer:  # a source that gave only the price per GPU says so
            assert "per GPU" in price.note or "share" in price.note, name


def test_a_price_that_its_derivation_does_not_give_is_refused_naming_the_field(tmp_path):
    derivation = "derivation: {offer: p5.48xlarge, listed_usd: 98.32, gpus: 8, region: us-east-1}"
    good = space(
        tmp_path,
        f"device: gpu\nprices:\n  H100-SXM: {{usd_per_device_hour: 12.29, source: x, date: 2026-01-01, {derivation}}}\n",
    )
    assert good.pricing.resolve("H100-SXM").usd_per_device_hour == 12.29  # 98.32 / 8 GPUs, to the cent
    with pytest.raises(UserError) as info:
        space(
            tmp_path,
            f"prices:\n  H100-SXM: {{usd_per_device_hour: 98.32, source: x, date: 2026-01-01, {derivation}}}\n",
        )
    message = str(info.value)
    assert "prices.H100-SXM" in message and "98.32 per hour / 8 GPU(s) = 12.2900" in message and "\n" not in message


def test_a_trial_is_priced_by_the_gpu_type_it_ran_on():
    pricing = Pricing(device="gpu", table=load_price_table())
    h100 = pricing.resolve("NVIDIA H100 80GB HBM3")  # as NVML names it
    listed = load_price_table()["H100-SXM"]
    assert h100.gpu == "H100-SXM" and h100.usd_per_device_hour == listed.usd_per_device_hour
    assert listed.source in h100.source and h100.date == listed.date
    assert pricing.resolve("L4").usd_per_device_hour == load_price_table()["L4"].usd_per_device_hour
    unknown = pricing.resolve("NVIDIA GeForce GTX 1080")
    assert unknown.usd_per_device_hour == 1.0 and unknown.source.startswith("no price listed for NVIDIA GeForce GTX")


def test_a_spaces_price_per_device_hour_overrides_the_list_and_the_cpu_keeps_its_core_hour():
    fixed = Pricing(device="gpu", table=load_price_table(), fixed=2.5)
    assert fixed.resolve("H100-SXM").usd_per_device_hour == 2.5
    assert fixed.resolve("H100-SXM").source == "price_per_device_hour in the space"
    cpu = Pricing(device="cpu", table=load_price_table(), default=0.05)
    assert cpu.resolve(None).usd_per_device_hour == 0.05 and "per core-hour" in cpu.resolve(None).source


def test_a_spaces_prices_override_the_shipped_ones_by_any_name_of_the_gpu(tmp_path):
    s = space(tmp_path, "device: gpu\nprices:\n  h100: {usd_per_device_hour: 1.99, source: 'our contract', date: 2026-11-01}\n"
              "  MI300X: {usd_per_device_hour: 2.5, source: 'https://example.com/mi300x', date: 2026-10-01}\n")  # fmt: skip
    own = s.pricing.resolve("NVIDIA H100 80GB HBM3")
    assert own.usd_per_device_hour == 1.99 and own.source == "our contract" and own.date == datetime.date(2026, 11, 1)
    assert s.pricing.resolve("MI300X").usd_per_device_hour == 2.5  # a GPU the catalogue lacks, by its name
    assert s.pricing.resolve("L4") == Pricing(device="gpu", table=load_price_table()).resolve("L4")  # the rest shipped
    assert s.pricing.fixed is None  # price_per_device_hour not set: the list prices
    assert space(tmp_path, "device: gpu\nprice_per_device_hour: 4.0\n").pricing.resolve("L4").usd_per_device_hour == 4.0


def test_a_space_picks_a_hyperscalers_price_list_and_the_default_is_unchanged(tmp_path):
    aws = space(tmp_path, "device: gpu\nprice_list: aws\n").pricing
    listed = load_price_table("aws")["H100-SXM"]
    h100 = aws.resolve("NVIDIA H100 80GB HBM3")
    assert h100.usd_per_device_hour == listed.usd_per_device_hour != load_price_table()["H100-SXM"].usd_per_device_hour
    assert h100.source.startswith(listed.provider) and listed.source in h100.source and h100.date == listed.date
    assert "AWS" in h100.describe() and str(listed.date) in h100.describe()  # the report names provider and date
    default = space(tmp_path, "device: gpu\n").pricing
    assert default.price_list == "default" and default.resolve("H100-SXM") == Pricing(
        device="gpu", table=load_price_table()
    ).resolve("H100-SXM")


def test_a_gpu_the_picked_list_lacks_is_priced_at_the_default_naming_the_list(tmp_path):
    gcp = space(tmp_path, "device: gpu\nprice_list: gcp\n").pricing
    missing = next(g for g in load_price_table() if g not in load_price_table("gcp"))
    price = gcp.resolve(missing)
    assert price.usd_per_device_hour == 1.0 and f"no price listed for {missing} in the gcp price list" in price.source


def test_a_spaces_prices_override_the_picked_list(tmp_path):
    s = space(tmp_path, "device: gpu\nprice_list: azure\n"
              "prices: {h100: {usd_per_device_hour: 7.5, source: 'our Azure agreement', date: 2026-11-01}}\n")  # fmt: skip
    assert s.pricing.resolve("H100-SXM").usd_per_device_hour == 7.5
    a100 = load_price_table("azure")["A100-80GB"]
    assert s.pricing.resolve("A100-80GB").usd_per_device_hour == a100.usd_per_device_hour  # the rest: Azure's


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("price_list: aws2\n", "price_list: Input should be 'default', 'aws', 'gcp' or 'azure'"),
        ("prices: {H200: {usd_per_device_hour: 3.0, source: x}}\n", "prices.H200.date: Field required"),
        ("prices: {H200: {usd_per_device_hour: -1, source: x, date: 2026-01-01}}\n", "prices.H200.usd_per_device_hour"),
        ("prices: {H200: {usd: 3, source: x, date: 2026-01-01}}\n", "prices.H200.usd"),
    ],
)
def test_a_bad_price_is_one_line_naming_file_and_field(tmp_path, text, field):
    with pytest.raises(UserError) as info:
        space(tmp_path, text)
    message = str(info.value)
    assert message.startswith(str(tmp_path / "space.yaml")) and field in message and "\n" not in message


def test_the_trial_records_the_price_it_was_costed_at_and_its_cost_uses_it():
    from servetune.trial.runner import price_trial
    from tests.builders import level, trial

    result = trial("t", {}, [level(8, 900.0, 400)], devices=2, price=1.0)
    result.environment = {"gpu_model": "NVIDIA L40S"}

    class Spec:  # what price_trial reads of a TrialSpec
        device, gpu = "gpu", None
        pricing = Pricing(device="gpu", table=price_table({}))

    price_trial(result, Spec())
    l40s = load_price_table()["L40S"].usd_per_device_hour
    assert result.price.gpu == "L40S" and result.price_per_device_hour == l40s
    cost = result.operating_points()[0].metrics["cost_per_mtok_usd"]
    assert cost == pytest.approx(l40s * 2 / (900.0 * 3600) * 1e6)
    reloaded = type(result).model_validate_json(result.model_dump_json())
    assert reloaded.price == result.price  # result.json keeps it, source and date included


def test_the_report_states_which_prices_it_used(tmp_path):
    from servetune.capacity.prices import DevicePrice
    from servetune.report import build_report, load_study, render_markdown
    from tests.builders import demo_trials, study_info, write_study

    trials = demo_trials()
    listed = load_price_table()["H100-SXM"]
    trials[0].price = DevicePrice(usd_per_device_hour=listed.usd_per_device_hour, source=listed.source,
                                  date=listed.date, gpu="H100-SXM")  # fmt: skip
    trials[0].price_per_device_hour = listed.usd_per_device_hour
    root = write_study(tmp_path / "s", study_info(), trials)
    md = render_markdown(build_report(load_study(root)))
    assert (
        f"- prices: H100-SXM at ${listed.usd_per_device_hour:g} per device-hour ({listed.source}, read {listed.date})"
        in md
    )
    overridden = render_markdown(build_report(load_study(root), price_per_device_hour=9.0))
    assert "- price: $9 per device-hour (from --price-per-gpu-hour)" in overridden and "- prices:" not in overridden


def test_the_report_names_the_hyperscaler_instance_and_date_of_the_prices_it_used(tmp_path):
    from servetune.report import build_report, load_study, render_markdown
    from tests.builders import demo_trials, study_info, write_study

    trials = demo_trials()
    price = Pricing(device="gpu", table=price_table({}, "aws"), price_list="aws").resolve("NVIDIA H100 80GB HBM3")
    trials[0].price, trials[0].price_per_device_hour = price, price.usd_per_device_hour
    md = render_markdown(build_report(load_study(write_study(tmp_path / "s", study_info(), trials))))
    listed = load_price_table("aws")["H100-SXM"]
    assert f"- prices: H100-SXM at ${listed.usd_per_device_hour:g} per device-hour ({listed.provider}: " in md
    assert f"{listed.source}, read {listed.date})" in md and "p5.48xlarge" in listed.provider


def test_the_html_report_states_which_prices_it_used_with_source_and_date(tmp_path):
    from servetune.capacity.prices import DevicePrice
    from servetune.report import build_report, load_study
    from servetune.report.html import render_html
    from tests.builders import demo_trials, study_info, write_study

    trials = demo_trials()
    listed = load_price_table()["L40S"]
    trials[0].price = DevicePrice(usd_per_device_hour=listed.usd_per_device_hour, source=listed.source,
                                  date=listed.date, gpu="L40S")  # fmt: skip
    root = write_study(tmp_path / "s", study_info(price_per_device_hour=0.5), trials)
    page = render_html(build_report(load_study(root)))
    assert f"L40S at ${listed.usd_per_device_hour:g} per device-hour ({listed.source}, read {listed.date})" in page
    assert "Costs at the prices: " in page
    assert "Costs at the price: $9 per device-hour (from --price-per-gpu-hour)" in render_html(
        build_report(load_study(root), price_per_device_hour=9.0)
    )
    for t in trials:  # results from before prices were recorded: the study's one price
        t.price = None
    older = write_study(tmp_path / "old", study_info(price_per_device_hour=0.5), trials)
    assert "Costs at the price: $0.5 per device-hour (from study.json)" in render_html(build_report(load_study(older)))


def test_study_json_records_the_spaces_own_price_and_none_where_gpu_prices_come_from_the_list(tmp_path):
    from servetune.report import build_report, load_study
    from servetune.study.driver import study_info as recorded
    from servetune.tracking.fields import study_params
    from tests.builders import demo_trials, space_from, write_study

    head = "name: p\nmodel: tiny\nload: {levels: [2]}\n"
    listed = recorded(space_from(tmp_path, head + "device: gpu\nprice_list: aws\n"), tmp_path / "s.yaml", "tiny")
    assert listed.price_per_device_hour is None  # each trial priced at its GPU type's, not at the default 1.0
    assert study_params(listed)["price_per_device_hour"] == "per GPU type (aws price list)"
    for t in (trials := demo_trials()):  # results from before prices were recorded
        t.price = None
    report = build_report(load_study(write_study(tmp_path / "st", listed, trials)))
    assert report.price_line() == "prices: each GPU type's, from the aws price list (study.json)"
    fixed = recorded(space_from(tmp_path, head + "device: gpu\nprice_per_device_hour: 2.5\n"), tmp_path / "s.yaml", "t")
    assert fixed.price_per_device_hour == 2.5
    cpu = recorded(space_from(tmp_path, head + "device: cpu\n"), tmp_path / "s.yaml", "tiny")
    assert cpu.price_per_device_hour == 1.0  # the CPU build's price per core-hour, the space's default
