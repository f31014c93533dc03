"""Many processes: tensor parallelism, exact at every degree (split.py says how)."""
