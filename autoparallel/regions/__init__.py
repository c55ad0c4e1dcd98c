"""``local_map`` regions: model code written for local tensors, with explicit collectives.

``local_map.py`` is the user's wrapper and the two graph ops a region becomes;
``collectives.py`` the differentiable collectives a body calls by mesh dim; ``context.py``
the scopes that tell a region op which mesh and body it runs; ``profile.py`` what a body
does on one rank (for the cost model).
"""

from autoparallel.regions import collectives
from autoparallel.regions.context import current_mesh
from autoparallel.regions.local_map import LocalMapError, local_map

__all__ = ["LocalMapError", "collectives", "current_mesh", "local_map"]
