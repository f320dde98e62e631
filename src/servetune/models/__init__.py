"""Models servetune can build itself (the tiny CPU test model)."""
