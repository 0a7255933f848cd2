"""A user's batch, validated and made canonical: one ``Bags`` per feature."""
