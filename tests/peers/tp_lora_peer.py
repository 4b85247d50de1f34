"""One rank of a two-process tensor-parallel LoRA run (run by tests/test_lora_tensor_parallel.py; not a test module).

    python tests/peers/tp_lora_peer.py MODEL_DIR ADAPTER_DIR OUT   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)

Loads the model sharded across the two ranks with the LoRA adapters saved in ADAPTER_DIR (each rank takes its slice
of the sharded ones), then generates, trains two steps and generates again as tests/peers/tp_peer.py does, and saves
what it saw: the tokens and logprobs, the whole state dict gathered, the replicated parameters, how many linears the
local forwards switched.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the peers package
from peers.tp_peer import OPTIM, STEPS, run  # noqa: E402

from unison.dist import tensor_parallel  # noqa: E402
from unison.dist.tensor_parallel import LocalForward, full_state_dict, replicated_agree  # noqa: E402
from unison.dist.topology import init_topology  # noqa: E402
from unison.lora import LoraConfig  # noqa: E402
from unison.models import load_policy  # noqa: E402
from unison.train.optimizer import build_optimizer  # noqa: E402

LORA = LoraConfig(r=4, alpha=8)


def main():
    model_dir, adapter_dir, out = sys.argv[1:]
    topology = init_topology(2, 120.0, "cpu")
    model, _ = load_policy(model_dir, dtype=torch.float32, topology=topology, lora=LORA, adapter=adapter_dir)
    result = {"loaded": {k: v.clone() for k, v in full_state_dict(model).items()}}  # before training
    switches, training_linear = [], tensor_parallel._training_linear
    tensor_parallel._training_linear = lambda module, style: switches.append(style) or training_linear(module, style)
    result.update(run(model, lambda m: build_optimizer(m, OPTIM, STEPS, topology), topology))
    result["training_switches"] = len(switches)
    with LocalForward(model)() as switched:
        result["switched"] = switched
    replicated_agree(model, topology.tp)
    result["params"] = full_state_dict(model)
    result["replicated"] = {n: p.detach().clone() for n, p in model.named_parameters()
                            if not hasattr(p, "placements")}
    result["sharded"] = sorted(n for n, p in model.named_parameters() if hasattr(p, "placements"))
    torch.save(result, os.path.join(out, f"rank{topology.tp.rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
