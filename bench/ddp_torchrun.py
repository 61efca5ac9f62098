"""torchrun's side of the training-overhead workload: one worker, writing its result as JSON.

    torchrun --nproc-per-node 4 bench/ddp_torchrun.py OUT_DIR STEPS SEED THREADS
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from bench.ddp_loop import train


def main(out: str, steps: str, seed: str, threads: str) -> None:
    dist.init_process_group("gloo")
    try:
        result = train(int(steps), int(seed), int(threads))
        Path(out, f"rank{result['rank']}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
