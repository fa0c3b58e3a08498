"""The distributed mesh's processes: run settings (``settings``), start-up (``bootstrap``), what both roles
share (``stage``), the fast step loop (``worker``) and the anchor replica's (``anchor_worker``), mesh
checkpoints (``checkpoint``), results and the run summary (``results``), and ``MeshTrainer.train()`` on
several processes (``job``). The mechanisms they run live below: ``anchor/``, ``dp/``, ``pipeline/``."""
