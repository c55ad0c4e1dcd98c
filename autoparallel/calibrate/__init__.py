"""Measuring the cluster the planner prices: ``autoparallel calibrate`` -> a hardware profile.

``measure.py`` times collectives per mesh dim (and holds how every figure is timed) and
``measure_device.py`` the device's matmul, memory bandwidth, per-op cost, optimizer step and
the runtime's own work, on the ranks of a live process group; ``fit.py`` turns the timings
into the ``Hardware`` figures (one latency-bandwidth fit per collective and link class);
``settings.py`` says what to measure; ``run.py`` runs both on a launched group (torchrun) or on N spawned gloo ranks (the device's
steps in ``run_device.py``) and writes the profile (``cost/profile.py``).
"""
