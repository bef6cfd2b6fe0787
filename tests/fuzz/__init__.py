"""The property-based suite: random programs run with and without checkpointing must agree exactly."""
