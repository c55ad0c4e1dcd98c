"""Stage 1, trace: a model and its global example inputs -> :class:`~autoparallel.types.graph.JointGraph`.

``export.trace_joint`` is the entry point. ``repeated_layers`` finds identical layers and
``layer_stamping`` builds the N-layer graph from 3 and 4 traced ones; ``mixed_precision``
wraps the model so casts appear in the graph; ``sharding_constraint`` is the custom op a
model uses to pin a placement. Facts about the traced graph that later stages read live in
``graph/``.
"""
