import pytest
from ledger import Money, parse_money


def test_add_and_subtract():
    assert Money(150, "EUR") + Money(75, "EUR") == Money(225, "EUR")
    assert (Money(150, "EUR") - Money(200, "EUR")).cents == -50
    with pytest.raises(ValueError):
        Money(1, "EUR") + Money(1, "USD")


def test_allocate():
    parts = Money(100, "EUR").allocate([1, 1, 1])
    assert [p.cents for p in parts] == [34, 33, 33]
    assert sum(p.cents for p in Money(1001, "USD").allocate([3, 7])) == 1001
    with pytest.raises(ValueError):
        Money(5, "EUR").allocate([0, 0])


def test_format():
    assert Money(-1205, "EUR").format() == "-12.05 EUR"
    assert Money(7, "GBP").format() == "0.07 GBP"


def test_parse_money():
    assert parse_money("12.5 EUR") == Money(1250, "EUR")
    assert parse_money(" -3 USD ").cents == -300
    for bad in ("12.345 EUR", "12 euro", ""):
        with pytest.raises(ValueError):
            parse_money(bad)
