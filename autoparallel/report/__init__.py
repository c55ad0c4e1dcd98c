"""Reports on a plan, built from its JSON form (``ShardingOptimizer.get_json()``).

Reports read the plain JSON dict rather than live objects, so a plan saved to disk can be
rendered again later, on a machine without the model or torch.distributed set up.
``html`` renders the page (its cost sections in ``html_costs``, memory in ``html_memory``,
regions in ``html_regions``; on ``template``: shell, CSS, JS, HTML building blocks), ``summary``
prints the summary, ``diff`` the difference of two plans.
"""

from autoparallel.report.html import render_html, write_html

__all__ = ["render_html", "write_html"]
