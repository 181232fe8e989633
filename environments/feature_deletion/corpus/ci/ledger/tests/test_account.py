import unittest

from ledger import Account, InsufficientFunds, Money


class AccountTest(unittest.TestCase):
    def setUp(self):
        self.account = Account("ada", "EUR", overdraft=500)

    def test_deposit_and_balance(self):
        self.assertEqual(self.account.deposit(Money(1000, "EUR")).cents, 1000)
        self.account.deposit(Money(250, "EUR"), memo="gift")
        self.assertEqual(self.account.balance, Money(1250, "EUR"))
        with self.assertRaises(ValueError):
            self.account.deposit(Money(-1, "EUR"))

    def test_withdraw_with_overdraft(self):
        self.account.deposit(Money(100, "EUR"))
        self.assertEqual(self.account.withdraw(Money(550, "EUR")).cents, -450)
        with self.assertRaises(InsufficientFunds):
            self.account.withdraw(Money(100, "EUR"))

    def test_history(self):
        self.account.deposit(Money(100, "EUR"))
        self.account.deposit(Money(5, "EUR"), memo="gift")
        self.account.withdraw(Money(30, "EUR"))
        self.assertEqual(self.account.history(), [("deposit", 100), ("gift", 5), ("withdrawal", -30)])
        self.assertEqual(self.account.history("gift"), [("gift", 5)])
