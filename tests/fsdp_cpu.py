"""`python -m tests.fsdp_cpu train ...` under torchrun: loracls with FSDP2 sharding on CPU processes (gloo).

accelerate enables FSDP only on accelerator devices (GPU, XPU, ...); on CPU processes it silently runs plain
data parallelism. PyTorch's `fully_shard` itself works on the CPU with gloo, so this launcher lets accelerate
take the FSDP path there: the test then runs the sharding, the gathered adapter saves and the sharded
checkpoints that a multi-GPU FSDP run takes.
"""

from __future__ import annotations

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

from loracls.cli import app

_init = AcceleratorState.__init__


def _init_with_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs) -> None:
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        # every later AcceleratorState() copies the type from PartialState's shared state: set it there too
        PartialState._shared_state["distributed_type"] = self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin


AcceleratorState.__init__ = _init_with_fsdp_on_cpu

if __name__ == "__main__":
    app(prog_name="loracls")
