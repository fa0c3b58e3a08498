"""Know before you rent: a time model of the mesh's step (``plan.schedule``: the pipeline schedule on links)."""
