"""`python -m tessera.estimate`: memory and time of a configured run before any GPU is allocated."""
