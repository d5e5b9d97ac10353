"""Prices and cost: tokens at the tenant's prices, GPU energy at the electricity rate.

Money is :class:`decimal.Decimal` throughout (TenantQuota prices are decimal strings). Prices come
from TenantQuota objects (``spec.prices``: ``currency``, ``inputPer1kTokens``, ``outputPer1kTokens``)
or from a standalone YAML file of the same shape::

    currency: USD
    energyPerKwh: "0.12"          # electricity rate; energy cost is billed on top of token prices
    tenants:
      acme: {inputPer1kTokens: "0.50", outputPer1kTokens: "1.50"}
      globex: {inputPer1kTokens: "0.40", outputPer1kTokens: "1.20", currency: EUR}

Energy per tenant: each minute's GPU energy (from ``GpuReading.power_watts``) is split between the
tenants in proportion to their tokens in that minute (bpf/store.py); cost = kWh x rate.
"""

from __future__ import annotations

import dataclasses
import decimal
import pathlib
from decimal import Decimal
from typing import Any, Iterable, Mapping

import yaml

from zerolayer.bpf.errors import BillingError
from zerolayer.bpf.store import UsageRow

JOULES_PER_KWH = Decimal(3_600_000)
CENT = Decimal("0.000001")  # reports keep 6 decimals: a token costs well under a cent


@dataclasses.dataclass(frozen=True)
class Prices:
    currency: str = "USD"
    input_per_1k: Decimal = Decimal(0)
    output_per_1k: Decimal = Decimal(0)


@dataclasses.dataclass(frozen=True)
class PriceBook:
    tenants: Mapping[str, Prices]
    energy_per_kwh: Decimal = Decimal(0)
    currency: str = "USD"

    def of(self, tenant: str) -> Prices:
        return self.tenants.get(tenant, Prices(self.currency))


def parse_decimal(value: Any, where: str) -> Decimal:
    """A non-negative finite decimal, or :class:`BillingError` naming ``where``."""
    try:
        d = Decimal(str(value))
    except decimal.InvalidOperation as exc:
        raise BillingError(f"{where}: {value!r} is not a decimal number") from exc
    if d < 0 or not d.is_finite():
        raise BillingError(f"{where}: {value!r} must be a non-negative number")
    return d


def prices_from_spec(spec: Mapping[str, Any], where: str, default_currency: str = "USD") -> Prices:
    """``spec.prices`` of a TenantQuota (or one tenant entry of the price file)."""
    return Prices(str(spec.get("currency") or default_currency),
                  parse_decimal(spec.get("inputPer1kTokens", "0"), f"{where}.inputPer1kTokens"),
                  parse_decimal(spec.get("outputPer1kTokens", "0"), f"{where}.outputPer1kTokens"))


def price_book_from_quotas(quotas: Iterable[Mapping[str, Any]], energy_per_kwh: str = "0") -> PriceBook:
    tenants = {}
    for q in quotas:
        spec = q.get("spec") or {}
        name = (q.get("metadata") or {}).get("name", "?")
        tenants[str(spec["tenant"])] = prices_from_spec(spec.get("prices") or {}, f"TenantQuota {name}.spec.prices")
    return PriceBook(tenants, parse_decimal(energy_per_kwh, "energy price"))


def load_price_book(path: str | pathlib.Path) -> PriceBook:
    try:
        data = yaml.safe_load(pathlib.Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise BillingError(f"cannot read prices {path}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("tenants", {}), dict):
        raise BillingError(f"{path}: expected a mapping with a 'tenants' mapping")
    currency = str(data.get("currency", "USD"))
    tenants = {str(t): prices_from_spec(p or {}, f"{path}: tenants.{t}", currency)
               for t, p in (data.get("tenants") or {}).items()}
    return PriceBook(tenants, parse_decimal(data.get("energyPerKwh", "0"), f"{path}: energyPerKwh"), currency)


@dataclasses.dataclass(frozen=True)
class Bill:
    tenant: str
    model: str
    currency: str
    input_tokens: int  # billed: from events plus reconciled
    output_tokens: int
    requests: int
    reconciled_tokens: int  # part of the above booked from the runtime's counters
    energy_kwh: Decimal
    input_cost: Decimal
    output_cost: Decimal
    energy_cost: Decimal

    @property
    def total(self) -> Decimal:
        return self.input_cost + self.output_cost + self.energy_cost

    def as_dict(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "model": self.model, "currency": self.currency,
                "input_tokens": self.input_tokens, "output_tokens": self.output_tokens, "requests": self.requests,
                "reconciled_tokens": self.reconciled_tokens, "energy_kwh": str(self.energy_kwh),
                "input_cost": str(self.input_cost), "output_cost": str(self.output_cost),
                "energy_cost": str(self.energy_cost), "total": str(self.total)}


def bill(rows: Iterable[UsageRow], book: PriceBook) -> list[Bill]:
    out = []
    for r in rows:
        p = book.of(r.tenant)
        inp = r.input_tokens + r.reconciled_input
        outp = r.output_tokens + r.reconciled_output
        kwh = Decimal(repr(r.energy_joules)) / JOULES_PER_KWH
        out.append(Bill(r.tenant, r.model, p.currency, inp, outp, r.requests, r.reconciled_input + r.reconciled_output,
                        kwh.quantize(CENT), (inp * p.input_per_1k / 1000).quantize(CENT),
                        (outp * p.output_per_1k / 1000).quantize(CENT), (kwh * book.energy_per_kwh).quantize(CENT)))
    return out
