"""A plan on disk: the plan JSON (write and read), boundary placements, whole saved problems.

``plan_json_graph`` turns a (Problem, Plan) into the versioned JSON every report reads;
``plan_json`` holds that JSON's format, the sections a Plan alone gives, and reads a file
back; ``placements`` keeps a plan's boundary placements to pin them again later;
``problem`` saves and loads a whole Problem as ``.npz`` (no model needed to re-solve it).
"""
