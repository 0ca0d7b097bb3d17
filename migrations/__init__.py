"""Alembic migrations of chatflow-sqlalchemy (shipped as ``chatflow_sqlalchemy._migrations``)."""
