"""Accounts, bearer tokens (stored as argon2 hashes) and the audit trail."""
