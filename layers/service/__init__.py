"""Service layer: job intake, quotes, contracts, metering, invoices and provider payouts."""
