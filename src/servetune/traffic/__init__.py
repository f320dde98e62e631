"""Real traffic: reading request logs and measuring what they say (``servetune workload from-log``)."""
