"""Stage 2, graph: facts about the joint graph that several later stages read.

``fx_args`` walks a node's arguments; ``view_ops`` says which ops are views and which values
view a parameter; ``fill_ops`` recognizes constant fills; ``layers`` maps each forward op to
its numbered layer and says what recomputing a layer runs again. Nothing here traces or
prices: the modules read a :class:`~autoparallel.types.graph.JointGraph` and return facts.
"""
