"""Store tiers: gpu, cpu (sealed memfd), disk (content-addressed files), cloud (remote sources)."""
