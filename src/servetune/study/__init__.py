"""The study: Ray Tune proposes configurations, each trial runs on devices reserved for it."""
