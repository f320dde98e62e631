"""What a device-hour costs: a price per GPU type, with the date and source of each price.

The shipped tables carry public on-demand list prices, each with the page it was read on, the date, and its
:class:`Derivation` (the offer's listed price and the GPUs it buys, so the price per device-hour can be checked by
arithmetic): ``catalog/prices.yaml`` (the ``default`` list: GPU clouds' prices) and one per hyperscaler
(``catalog/prices-aws.yaml``, ``-gcp``, ``-azure``: an instance's price over its GPUs). A space picks one with
``price_list:`` (:data:`PriceList`); its ``prices:`` overrides or adds entries (a derivation is optional there), and
its ``price_per_device_hour`` overrides them all. A trial is priced by the GPU
type it ran on (:meth:`Pricing.resolve`); the CPU stand-in keeps its price per core-hour.
"""

from __future__ import annotations

import datetime
import functools
from importlib import resources
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from servetune.capacity.hardware import find_gpu
from servetune.errors import UserError

#: The price of a device-hour where nothing names one (the space's ``price_per_device_hour`` default).
DEFAULT_PRICE = 1.0


#: The shipped price lists a space may pick (``price_list:``), each a file of ``catalog/`` (see :data:`PRICE_LIST_FILES`).
PriceList = Literal["default", "aws", "gcp", "azure"]

#: Each price list's file: ``default`` is GPU clouds' list prices; the others one hyperscaler's on-demand instances.
PRICE_LIST_FILES: dict[PriceList, str] = {
    "default": "prices.yaml",
    "aws": "prices-aws.yaml",
    "gcp": "prices-gcp.yaml",
    "azure": "prices-azure.yaml",
}

#: Seconds in each unit a page may list a price per.
_SECONDS = {"hour": 3600, "second": 1}

#: How far a listed price per device-hour may sit from its derivation (the table rounds to 4 decimals).
DERIVATION_TOLERANCE = 5e-5


class Derivation(BaseModel):
    """How a price per device-hour follows from what the page lists: ``listed_usd`` per ``per`` for the
    ``offer`` (an instance type or a serverless tier), which buys ``gpus`` GPUs of the type."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    offer: str = Field(min_length=1)  # the instance type or tier, as the page names it
    listed_usd: float = Field(gt=0)  # the price the page shows for the offer
    per: Literal["hour", "second"] = "hour"  # the unit the page lists it per
    gpus: int = Field(default=1, ge=1)  # GPUs of this type the offer buys
    region: str = Field(min_length=1)  # where the price holds ("not stated" where the page gives none)
    billing: Literal["on-demand"] = "on-demand"  # list price, no commitment, no spot

    def usd_per_device_hour(self) -> float:
        """The offer's price per hour (``listed_usd`` x the ``per`` units in an hour) over the GPUs it buys."""
        return self.listed_usd * (3600 / _SECONDS[self.per]) / self.gpus


class Price(BaseModel):
    """One GPU type's price per device-hour and where it came from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    usd_per_device_hour: float = Field(ge=0)
    source: str = Field(min_length=1)  # the page (or contract) the price was read from
    date: datetime.date  # when it was read there
    provider: str = ""
    note: str = ""
    page_date: datetime.date | None = None  # the date the page itself shows, where it shows one
    evidence: Literal["vendor", "secondary"] = "vendor"  # the provider's own page, or a page quoting it
    derivation: Derivation | None = None  # required in the shipped table (see tests/unit/test_prices.py)

    @model_validator(mode="after")
    def _derived(self) -> Price:
        if self.derivation is not None:
            derived = self.derivation.usd_per_device_hour()
            if abs(derived - self.usd_per_device_hour) > DERIVATION_TOLERANCE:
                raise ValueError(
                    f"usd_per_device_hour {self.usd_per_device_hour:g} is not its derivation's "
                    f"{self.derivation.listed_usd:g} per {self.derivation.per} / {self.derivation.gpus} GPU(s) "
                    f"= {derived:.4f}"
                )
        return self

    def device_price(self, gpu: str) -> DevicePrice:
        """This price as a trial records it: the provider before the page, and the date it was read."""
        source = f"{self.provider}: {self.source}" if self.provider else self.source
        return DevicePrice(usd_per_device_hour=self.usd_per_device_hour, source=source, date=self.date, gpu=gpu)

    def describe(self, gpu: str) -> str:
        """``L40S at $1.908 per device-hour (RunPod ...: https://..., read 2026-12-05)``, as the report cites it."""
        return self.device_price(gpu).describe()


class DevicePrice(BaseModel):
    """The price a trial was costed at, and why that one (recorded in its result)."""

    model_config = ConfigDict(extra="ignore", frozen=True)  # a record: see results.RECORD

    usd_per_device_hour: float
    source: str  # a page, or "price_per_device_hour in the space", or why the default was used
    date: datetime.date | None = None
    gpu: str | None = None  # the GPU type it is the price of (None on the CPU stand-in)

    def describe(self) -> str:
        """``H100-SXM at $3.78 per device-hour (https://..., read 2026-12-05)``."""
        what = f"{self.gpu} at " if self.gpu else ""
        when = f", read {self.date.isoformat()}" if self.date is not None else ""
        return f"{what}${self.usd_per_device_hour:g} per device-hour ({self.source}{when})"


def load_price_table(price_list: PriceList = "default") -> dict[str, Price]:
    """One shipped list's prices by GPU type (a copy: callers may add to it)."""
    return dict(_parsed_prices(price_list))


@functools.cache
def _parsed_prices(price_list: PriceList) -> dict[str, Price]:
    path = f"catalog/{PRICE_LIST_FILES[price_list]}"
    text = resources.files("servetune.capacity").joinpath(path).read_text(encoding="utf-8")
    return {name: Price.model_validate(fields) for name, fields in (yaml.safe_load(text) or {}).items()}


def gpu_type(name: str) -> str:
    """A GPU's catalogue name (``NVIDIA H100 80GB HBM3`` -> ``H100-SXM``); a name the catalogue lacks as given."""
    try:
        return find_gpu(name).name
    except UserError:
        return name


class Pricing(BaseModel):
    """How a study prices its devices: the table (shipped, then the space's own ``prices:``), and the space's
    ``price_per_device_hour`` when it set one (which overrides the table)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str = "gpu"
    table: dict[str, Price] = {}
    price_list: PriceList = "default"  # the shipped list the table starts from
    fixed: float | None = None  # the space's own price_per_device_hour
    default: float = DEFAULT_PRICE

    def resolve(self, gpu: str | None) -> DevicePrice:
        """The price of one device of this GPU type (an NVML name or a catalogue name or alias)."""
        if self.device == "cpu":
            price = self.default if self.fixed is None else self.fixed
            return DevicePrice(usd_per_device_hour=price, source="price_per_device_hour in the space (per core-hour)")
        if self.fixed is not None:
            return DevicePrice(usd_per_device_hour=self.fixed, source="price_per_device_hour in the space", gpu=gpu)
        if gpu is None:
            return DevicePrice(usd_per_device_hour=self.default, source="GPU type unknown: the default price")
        name = gpu_type(gpu)
        listed = self.table.get(name)
        if listed is None:
            known = ", ".join(self.table) or "none"
            return DevicePrice(usd_per_device_hour=self.default, gpu=name,
                               source=f"no price listed for {name} in the {self.price_list} price list (listed: {known}): "
                                      "the default price")  # fmt: skip
        return listed.device_price(name)


def price_table(overrides: dict[str, Price], price_list: PriceList = "default") -> dict[str, Price]:
    """A shipped list with a space's ``prices:`` over it, keyed by catalogue name (an alias is accepted)."""
    table = load_price_table(price_list)
    table.update({gpu_type(name): price for name, price in overrides.items()})
    return table
