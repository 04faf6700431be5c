"""Integrations of hwtune's ops into other libraries' models (one module per library)."""
