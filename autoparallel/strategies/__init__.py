"""Stage 3, strategies: per node of the JointGraph, its valid placements -> StrategySpace.

``space.build_strategy_space`` is the entry point; options come from our own rules
(``rules.py``, registered by ``@rule_for``), DTensor's registry (``dtensor_adapter.py``,
``view_rules.py``) or a logged replicate fallback.
"""
