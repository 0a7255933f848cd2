"""The numeric rules every kernel and every torch twin follow bit for bit: the hashes (seeds,
raw-id placement) and the rounding of 16-bit rows."""
