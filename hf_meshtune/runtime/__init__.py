"""The distributed mesh's processes: run settings (``settings``), start-up (``bootstrap``), the fast
step loop (``worker``; the anchor's is ``anchor.worker``), mesh checkpoints (``checkpoint``), results
and the run summary (``results``), and ``MeshTrainer.train()`` on several processes (``job``)."""
