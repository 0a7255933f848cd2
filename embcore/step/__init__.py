"""One training step: preprocess, lookup, apply gradients; the fast path; the queue."""
