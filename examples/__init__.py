"""Runnable examples of chatflow-sqlalchemy (see ``examples/README.md``)."""
