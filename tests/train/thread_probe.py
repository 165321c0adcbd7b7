"""Run by torchrun in tests/train/test_threads.py: initialise the process group exactly as the trainer does
(k3train.runtime.process_groups.init_distributed) and print this rank's thread choice as one JSON line."""
import json
import os

import torch

from k3train.runtime.process_groups import init_distributed, shutdown

env = init_distributed("gloo", "cpu", 60.0)
print(json.dumps({"rank": env.rank, "threads": env.num_threads, "torch_threads": torch.get_num_threads(),
                  "reason": env.threads_reason, "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"])}),
      flush=True)
shutdown()
