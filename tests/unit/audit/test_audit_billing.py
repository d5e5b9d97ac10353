"""Prices from TenantQuota and price files, decimal costs, energy cost."""

from __future__ import annotations

from decimal import Decimal

import pytest

from zerolayer.bpf.billing import PriceBook, Prices, bill, load_price_book, price_book_from_quotas
from zerolayer.bpf.errors import BillingError
from zerolayer.bpf.store import UsageRow


def test_prices_from_tenantquota_spec():
    book = price_book_from_quotas([
        {"metadata": {"name": "acme"}, "spec": {"tenant": "acme", "prices": {
            "currency": "EUR", "inputPer1kTokens": "0.50", "outputPer1kTokens": "1.5"}}},
        {"metadata": {"name": "free"}, "spec": {"tenant": "free"}},
    ], energy_per_kwh="0.20")
    assert book.of("acme") == Prices("EUR", Decimal("0.50"), Decimal("1.5"))
    assert book.of("free") == Prices("USD", Decimal(0), Decimal(0))
    assert book.energy_per_kwh == Decimal("0.20")


def test_price_file_and_its_errors(tmp_path):
    path = tmp_path / "prices.yaml"
    path.write_text('energyPerKwh: "0.12"\ntenants:\n  acme: {inputPer1kTokens: "0.5", outputPer1kTokens: "2"}\n')
    book = load_price_book(path)
    assert book.of("acme").output_per_1k == Decimal(2)
    path.write_text('tenants:\n  acme: {inputPer1kTokens: "cheap"}\n')
    with pytest.raises(BillingError, match="tenants.acme.inputPer1kTokens"):
        load_price_book(path)


def test_bill_is_exact_decimal_with_reconciled_tokens_and_energy():
    book = PriceBook({"acme": Prices("USD", Decimal("0.5"), Decimal("1.5"))}, energy_per_kwh=Decimal("0.12"))
    row = UsageRow("acme", "tiny", input_tokens=1000, output_tokens=1999, requests=3, events=100,
                   reconciled_input=0, reconciled_output=1, energy_joules=3_600_000.0)
    (b,) = bill([row], book)
    assert (b.input_tokens, b.output_tokens, b.reconciled_tokens) == (1000, 2000, 1)
    assert (b.input_cost, b.output_cost, b.energy_cost) == (Decimal("0.5"), Decimal("3"), Decimal("0.12"))
    assert b.total == Decimal("3.62")
    assert b.as_dict()["total"] == "3.620000"
