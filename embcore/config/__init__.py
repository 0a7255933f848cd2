"""What a user declares: tables and features, optimizers, an engine's spec as data."""
