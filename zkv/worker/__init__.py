"""Per-rank worker actor: executes batches of copy ops and acks them."""
