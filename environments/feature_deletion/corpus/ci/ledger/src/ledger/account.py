"""Accounts: a balance and the history of what changed it."""

from ledger.money import Money


class InsufficientFunds(Exception):
    """A withdrawal larger than the balance (and any overdraft)."""


class Account:
    """An account in one currency with an optional overdraft limit (in cents)."""

    def __init__(self, owner, currency="EUR", overdraft=0):
        self.owner = owner
        self.currency = currency
        self.overdraft = overdraft
        self._entries = []

    @property
    def balance(self):
        """The current balance as ``Money``: the sum of all entries."""
        total = 0
        for _, cents in self._entries:
            total += cents
        return Money(total, self.currency)

    def deposit(self, amount, memo="deposit"):
        """Add a positive ``Money`` amount; returns the new balance."""
        if amount.currency != self.currency:
            raise ValueError("wrong currency")
        if amount.cents <= 0:
            raise ValueError("deposits must be positive")
        self._entries.append((memo, amount.cents))
        return self.balance

    def withdraw(self, amount, memo="withdrawal"):
        """Take a positive ``Money`` amount out; ``InsufficientFunds`` if the balance would fall below
        minus the overdraft. Returns the new balance."""
        if amount.currency != self.currency:
            raise ValueError("wrong currency")
        if amount.cents <= 0:
            raise ValueError("withdrawals must be positive")
        if self.balance.cents - amount.cents < -self.overdraft:
            raise InsufficientFunds(f"{self.owner} cannot withdraw {amount.format()}")
        self._entries.append((memo, -amount.cents))
        return self.balance

    def history(self, memo=None):
        """The entries as ``(memo, cents)`` pairs, oldest first; only those with ``memo`` if given."""
        if memo is None:
            return list(self._entries)
        return [entry for entry in self._entries if entry[0] == memo]
