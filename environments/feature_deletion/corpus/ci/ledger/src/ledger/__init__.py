"""ledger: money amounts and accounts (a CI project of the feature-deletion environment)."""

from ledger.account import Account, InsufficientFunds
from ledger.money import Money, parse_money

__all__ = ["Account", "InsufficientFunds", "Money", "parse_money"]
