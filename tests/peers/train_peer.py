"""`unison train` on the tiny model as one process of a torchrun job (run by tests/test_data_parallel.py).

    python -m torch.distributed.run --nproc-per-node 2 tests/peers/train_peer.py MODEL_DIR OUT [--key=value ...]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: conftest and the test modules
from test_train_e2e import run_cfg, task  # noqa: E402

from unison.train.loop import train  # noqa: E402

if __name__ == "__main__":
    model_dir, out, *overrides = sys.argv[1:]
    train(run_cfg(model_dir, out, "--optim.lr=1e-3", *overrides), task())
