"""The bundled micro reasoning model: training (`train`), the capacity-accuracy table (`table`), the shipped
sample traces (`samples`). Run as `python -m tracer.micro ...`; see README.md here."""
