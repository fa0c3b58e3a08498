"""``python one_gpu_per_host.py SCRIPT ARGS``: run SCRIPT with LOCAL_RANK=0, so that every process of a
mesh launched on one machine takes ``cuda:0``, as one process per internet host would (gpu_mesh_check)."""

import os
import runpy
import sys

if __name__ == "__main__":
    os.environ["LOCAL_RANK"] = "0"
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
