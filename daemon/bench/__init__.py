"""End-to-end benchmark: a built-in Llama-style decoder, variants, energy, fingerprint, report."""
