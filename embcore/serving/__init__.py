"""Serving: plain-torch lookups over snapshot tables, quantized or not."""
