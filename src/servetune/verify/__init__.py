"""``servetune verify``: is a study's recommendation ready to ship?

It starts the chosen configuration again and runs the stability stage of the tuning checklist
(section 14, stage 6: soak, peak, burst, long/short mix, very long outputs, disconnects,
headroom under load, repeats) at the recommended operating level, then evaluates the
acceptance list (section 15) item by item with its evidence (``checklist.py``).

Modules: ``choose.py`` (the pick and the runner-up, bad input as one line), ``scenarios.py`` and
``disconnects.py`` (the load of each scenario and how it is judged), ``stats.py`` (the pure
arithmetic: windows, jitter, bootstrap, cancellation), ``watch.py`` (``/metrics`` and the
engine's memory), ``run.py`` (the engines' lifetimes and ``verify.json``).
"""
