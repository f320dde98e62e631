"""One trial: capacity check -> engine start -> warm-up -> load ladder -> teardown."""
