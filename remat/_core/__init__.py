"""The core layer: checkpoint regions, checkpoint_sequential and their Flax adapters (jax and flax only)."""
