"""Built-in dialect backends: one module per database (``sqlite``, ``postgresql``)."""

__all__: list[str] = []
