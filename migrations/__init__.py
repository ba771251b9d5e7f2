"""Alembic migrations: the only way CPN's schema comes to exist."""
