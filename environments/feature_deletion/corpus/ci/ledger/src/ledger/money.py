"""Amounts of money in integer cents."""

import re

_AMOUNT = re.compile(r"^\s*(-?)(\d+)(?:\.(\d{1,2}))?\s+([A-Z]{3})\s*$")


class Money:
    """An amount in cents of one currency. Amounts of different currencies never mix."""

    __slots__ = ("cents", "currency")

    def __init__(self, cents, currency):
        if not isinstance(cents, int):
            raise TypeError("cents must be an int")
        self.cents = cents
        self.currency = currency

    def _check(self, other):
        if not isinstance(other, Money):
            return NotImplemented
        if other.currency != self.currency:
            raise ValueError(f"cannot mix {self.currency} and {other.currency}")
        return None

    def __add__(self, other):
        """The sum of two amounts of the same currency."""
        problem = self._check(other)
        if problem is NotImplemented:
            return NotImplemented
        return Money(self.cents + other.cents, self.currency)

    def __sub__(self, other):
        """The difference of two amounts of the same currency."""
        problem = self._check(other)
        if problem is NotImplemented:
            return NotImplemented
        return Money(self.cents - other.cents, self.currency)

    def __eq__(self, other):
        return isinstance(other, Money) and (self.cents, self.currency) == (other.cents, other.currency)

    def __hash__(self):
        return hash((self.cents, self.currency))

    def __repr__(self):
        return f"Money({self.cents}, {self.currency!r})"

    def allocate(self, ratios):
        """Split this amount by ``ratios`` (positive ints) into a list of amounts that add up to it
        exactly; the cents that do not divide evenly go one each to the first parts."""
        total = sum(ratios)
        if total <= 0 or any(r < 0 for r in ratios):
            raise ValueError("ratios must be non-negative and not all zero")
        shares = [self.cents * r // total for r in ratios]
        remainder = self.cents - sum(shares)
        for i in range(remainder):
            shares[i] += 1
        return [Money(share, self.currency) for share in shares]

    def format(self):
        """The amount as text: ``"-12.05 EUR"``."""
        sign = "-" if self.cents < 0 else ""
        whole, cents = divmod(abs(self.cents), 100)
        return f"{sign}{whole}.{cents:02d} {self.currency}"


def parse_money(text):
    """Parse ``"12.5 EUR"`` style text (up to two decimals, a three-letter currency code) into a
    ``Money``; anything else is a ``ValueError``."""
    match = _AMOUNT.match(text)
    if match is None:
        raise ValueError(f"not an amount: {text!r}")
    sign, whole, fraction, currency = match.groups()
    cents = int(whole) * 100 + int((fraction or "0").ljust(2, "0"))
    return Money(-cents if sign else cents, currency)
